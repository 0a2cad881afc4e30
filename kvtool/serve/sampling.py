"""How one request picks its tokens and where its text ends.

`Picker` chooses each next token from the logits: greedy at temperature 0, the draft's verified
prefix forced while it lasts (as `kvtool generate` forces it: `runtime.draft.ForcedPrefix`), else
sampled at `temperature` from the `top_p` nucleus with the request's own generator (seeded by
`seed`), so a request's draws never depend on its neighbours in the batch.

`StopText` turns token ids into the text a client sees: the reply is decoded whole after each
token (a token may complete a multi-byte character), text that could still become the start of a
stop sequence is held back, and the reply ends before the first stop sequence it contains.
"""

from __future__ import annotations

import torch

from kvtool.runtime.draft import Verified


class Picker:
    def __init__(self, temperature: float, top_p: float, seed: int | None, prefix: Verified | None = None):
        self.temperature = temperature
        self.top_p = top_p
        self.prefix = prefix
        self.generator = None
        if temperature > 0:
            self.generator = torch.Generator()
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)

    def pick(self, t: int, logits: torch.Tensor) -> int:
        """Token t of the reply from the [V] logits that predict it."""
        if self.temperature <= 0:
            if self.prefix is not None:
                return int(self.prefix.choose(t, logits[None].to(self.prefix.tokens.device))[0])
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            ordered, index = probs.sort(descending=True)
            # Keep the smallest head whose mass reaches top_p (its first token always).
            outside = ordered.cumsum(0) - ordered >= self.top_p
            ordered[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, index, ordered)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class StopText:
    """The reply's text so far against its stop sequences."""

    def __init__(self, decode, stops: list[str]):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = 0  # characters already handed out
        self.text = ""
        self.stopped = False

    def add(self, ids: list[int]) -> str:
        """The new text that can be handed out after the reply became `ids`; sets `stopped` when a
        stop sequence appeared (the text then ends before it)."""
        self.text = self.decode(ids)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        ready = len(self.text) - self.hold
        while ready > self.sent and self.text[ready - 1] == "\ufffd":
            ready -= 1  # an unfinished multi-byte character: wait for its next token
        if ready <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:ready], ready
        return piece

    def flush(self) -> str:
        """The rest of the text, at the reply's end."""
        piece, self.sent = self.text[self.sent:], len(self.text)
        return piece
