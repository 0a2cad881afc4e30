"""A verified draft: the answer's first tokens as the full cache gives them, read off the draft's forward.

A draft (`MethodSettings.draft`) is run through the prompt's forward once more, appended to the
prompt: its rows attend with full attention to the whole prompt and to each other, so the logits
at its positions are the full cache's own next-token predictions after each prefix of the draft.
Where the draft agrees with them it is the full cache's greedy answer; at the first disagreement
the prediction is the full cache's next token. That prefix, `Verified`, is what later rounds draft
from and what the answer starts with (`scoring.draft`, `runtime.generate`); `ForcedPrefix` feeds
it to transformers' `generate` through its public logits-processor hook.

The same forward computes the draft rows' keys and values with full attention too: for the tokens
the logits agree with, they are the full cache's own. With `reuse` (`verify_draft`) the cache stores
those instead of recomputing them through the compressed cache while the answer is fed them
(`KvtoolCache.reuse_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor


@dataclass(frozen=True)
class Verified:
    """The answer's first tokens as the full cache would give them greedily: row b's first
    `lengths[b]` (>= 1) of `tokens` [B, k]; the rest of a row is the draft's and means nothing."""

    tokens: torch.Tensor  # [B, k] long
    lengths: torch.Tensor  # [B] long
    # [B] long: row b's first `agreed[b]` tokens are the draft's own (the rest of the prefix is the
    # full cache's correction), so the draft forward's keys and values for them are the full cache's.
    agreed: torch.Tensor | None = None

    def choose(self, t: int, logits: torch.Tensor) -> torch.Tensor:
        """Step t's [B] tokens: the verified one where row b has it (t < lengths[b]), else greedy."""
        greedy = logits.argmax(dim=-1)
        if t >= self.tokens.shape[1]:
            return greedy
        return torch.where(self.lengths.to(greedy.device) > t, self.tokens[:, t].to(greedy.device), greedy)


def verified_prefix(draft: torch.Tensor, logits: torch.Tensor) -> Verified:
    """What full-attention `logits` [B, k, V] at the draft's positions confirm of `draft` [B, k]:
    logits[:, j] predict the token after draft[:, :j + 1], and draft[:, 0] is the prompt's own next
    token. A row keeps its draft while the predictions agree, then takes the first prediction that
    does not (up to k tokens)."""
    k = draft.shape[1]
    predicted = logits.argmax(dim=-1).to(draft.device)  # [B, k]
    agree = (predicted[:, : k - 1] == draft[:, 1:]).long()
    matched = 1 + agree.cumprod(dim=1).sum(dim=1)  # leading draft tokens the logits confirm
    tokens = draft.clone()
    short = matched < k
    rows = torch.nonzero(short)[:, 0]
    tokens[rows, matched[rows]] = predicted[rows, matched[rows] - 1]
    return Verified(tokens=tokens, lengths=torch.where(short, matched + 1, matched), agreed=matched)


def verify_draft(cache: Any, draft: torch.Tensor, logits: torch.Tensor, reuse: bool = False) -> Verified:
    """`verified_prefix(draft, logits)` for the draft whose forward just filled `cache`; with
    `reuse` (the cache was told `set_draft(..., keep=True)`), generation stores that forward's own
    keys and values for the agreed tokens when it feeds them (`KvtoolCache.reuse_draft`)."""
    prefix = verified_prefix(draft, logits)
    if reuse:
        cache.reuse_draft(draft, prefix.agreed.cpu().numpy())
    return prefix


class ForcedPrefix(LogitsProcessor):
    """Makes transformers' `generate` choose row b's verified tokens while it has them.

    `start` is the input width at which the next token is `prefix.tokens[:, 0]`: a call with inputs
    of width w chooses token w - start. Every other token of a forced row gets -inf, so greedy and
    sampling pick the verified one alike; rows past their prefix are left as they are.
    """

    def __init__(self, prefix: Verified, start: int):
        self.prefix = prefix
        self.start = start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        t = input_ids.shape[1] - self.start
        if t < 0 or t >= self.prefix.tokens.shape[1]:
            return scores
        rows = (self.prefix.lengths.to(scores.device) > t).nonzero()[:, 0]
        if not len(rows):
            return scores
        tokens = self.prefix.tokens[:, t].to(scores.device)[rows]
        forced = torch.full_like(scores[rows], float("-inf"))
        forced[torch.arange(len(rows), device=scores.device), tokens] = 0.0
        scores = scores.clone()
        scores[rows] = forced
        return scores
