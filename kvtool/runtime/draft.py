"""The draft: the answer's first tokens, drafted at the budget, help choose what the prompt keeps.

A question says what the answer needs only in part; the answer's own first tokens read the rest
(which name, which number). A profile's `Draft` gets that signal without holding more than the budget:

1. the prompt is compressed as usual and `tokens` greedy tokens are drafted through that cache;
   every layer also holds its whole prompt aside (`KvtoolCache.hold_prompt`);
2. that cache is dropped, and the draft runs as one forward of its own over the held prompts
   (`runtime.held`): its rows attend to the whole prompt and to each other, as they would at the end
   of the prompt's forward, and their attention joins the prompt's scores (column sums, and the
   observation window, which grows by the draft); in the same forward a fresh cache is compressed
   from the held prompts with those scores, a layer at a time (`HeldLayer.read`). The prompt never
   runs again: this equals, up to the order of floating-point additions, the prompt's forward with
   the draft appended (`KvtoolCache.set_draft`, which the tests check it against);
3. generation starts from the prompt's end with the prompt's own last logits, exactly as without a
   draft, so the first token is the full cache's and no drafted token is kept.

With `rounds` > 1, steps 1-2 repeat: each later draft comes from the cache the previous round
scored, which keeps more of what the answer reads, so the draft is closer to the full cache's own
answer and the next scores closer to what that answer needs. Each round costs `tokens` - 1 steps
through the compressed cache and one `tokens`-row forward; the held prompt is the full cache's own
size and is let go once the last round has compressed. With `jacobi` a later round costs only its
forward: its draft is the last forward's own full-attention predictions (`predicted_draft`), so
the steps, most of a draft's cost, are paid once (it keeps less than a stepped round: calibration's
cost ladder tries it before it drops a round; `kvtool eval smollm2 --budgets 0.2 --methods kvtool
--profile P` with `jacobi: true`: ROUGE-L 0.575 against the stepped round's 0.627). On a GPU
the held prompt waits in pinned host memory (`runtime.layer.held_prompt`), so the prompt phase's
peak stays below the full cache's; on a CPU the batch's rows are prepared a group at a time for the
same reason (`runtime.row_groups`).

**Verified drafts** (`verify`). The forward of step 2 runs the draft rows with full attention over
the whole prompt and over each other: its logits at the draft's positions are the full cache's own
predictions after each prefix of the draft, for a few rows of the output projection. So the draft is
checked there as speculative decoding checks one: the longest prefix the full-attention logits agree
with, plus their own next token after it, are the full cache's greedy tokens (`Verified`). A later
round drafts from that prefix on (its tokens fed, the rest greedy through the cache), and the answer
itself starts with it (`ForcedPrefix` feeds it to transformers' `generate` through its public
logits-processor hook; the scoring engine's steps call `Verified.choose`).

`prepare` is the one implementation: `kvtool generate` and `KvtoolHandle.generate` (through
`generate` here), `kvtool eval`, `kvtool bench` and calibration's draft stage all call it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from kvtool.models.forward import with_cache
from kvtool.profiles import Draft
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.graphed_generate import loop_for
from kvtool.runtime.held import HeldCache
from kvtool.runtime.layer.held_prompt import let_go
from kvtool.runtime.memory import too_short_to_compress
from kvtool.runtime.row_groups import check_rows, join_caches, rows_at_once
from kvtool.runtime.steps import Prompt, prompt_forward, step_tokens


@dataclass(frozen=True)
class Verified:
    """The answer's first tokens as the full cache would give them greedily: row b's first
    `lengths[b]` (>= 1) of `tokens` [B, k]; the rest of a row is the draft's and means nothing."""

    tokens: torch.Tensor  # [B, k] long
    lengths: torch.Tensor  # [B] long

    def choose(self, t: int, logits: torch.Tensor) -> torch.Tensor:
        """Step t's [B] tokens: the verified one where row b has it (t < lengths[b]), else greedy."""
        greedy = logits.argmax(dim=-1)
        if t >= self.tokens.shape[1]:
            return greedy
        return torch.where(self.lengths > t, self.tokens[:, t], greedy)

    def to(self, device: torch.device) -> "Verified":
        """The same prefix on `device`: a step then copies nothing from the host (on a GPU each such
        copy from pageable memory waits for the queue)."""
        return Verified(self.tokens.to(device), self.lengths.to(device))


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
    return Verified(tokens=tokens, lengths=torch.where(short, matched + 1, matched))


def predicted_draft(draft: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The next round's draft under `Draft.jacobi`: the prompt's own next token draft[:, 0], then the
    token full-attention `logits` [B, k, V] predict after each prefix of `draft` [B, k] (the last
    prediction has no row left). Where `draft` agrees with its predictions this is `draft` with its
    first disagreement corrected, so it starts with the verified prefix (`verified_prefix`); after
    that, each token is what the full cache predicts after the old draft's prefix. One Jacobi step
    of greedy decoding, at the cost of no decode step."""
    predicted = logits.argmax(dim=-1).to(draft.device, draft.dtype)
    return torch.cat([draft[:, :1], predicted[:, :-1]], dim=1)


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
        if self.prefix.tokens.device != scores.device:
            self.prefix = self.prefix.to(scores.device)
        rows = (self.prefix.lengths > t).nonzero()[:, 0]
        if not len(rows):
            return scores
        tokens = self.prefix.tokens[:, t][rows]
        forced = torch.full_like(scores[rows], float("-inf"))
        forced[torch.arange(len(rows), device=scores.device), tokens] = 0.0
        scores = scores.clone()
        scores[rows] = forced
        return scores


@dataclass(frozen=True)
class Prepared:
    """A cache that holds the compressed prompt, ready for the answer's first token.

    `first_logits` [B, V] are the prompt's own last logits (the first token is the full cache's, as
    without a draft); `prefix` is the last round's verified prefix (None unless the draft verifies)."""

    cache: Any
    first_logits: torch.Tensor
    prefix: Verified | None = None


def drafted(
    model: Any, cache: Any, first_logits: torch.Tensor, prompt: Prompt, tokens: int, prefix: Verified | None = None
) -> torch.Tensor:
    """[B, tokens] greedy tokens after the prompt through `cache` (which holds the prompt); with a
    `prefix`, its verified tokens are fed first."""
    chosen: list[torch.Tensor] = []
    if prefix is not None:
        prefix = prefix.to(first_logits.device)

    def pick(t: int, logits: torch.Tensor) -> torch.Tensor:
        chosen.append(logits.argmax(dim=-1) if prefix is None else prefix.choose(t, logits))
        return chosen[-1]

    step_tokens(model, cache, first_logits, prompt, tokens, pick)
    return torch.stack(chosen, dim=1)


def with_draft(prompt: Prompt, draft: torch.Tensor) -> Prompt:
    """`prompt` with `draft` [B, k] appended to every row: real tokens at the positions the rows
    continue from."""
    k = draft.shape[1]
    base = prompt.next_positions.to(prompt.position_ids.dtype)
    following = base + torch.arange(k, dtype=base.dtype, device=base.device)  # [B, k]
    if prompt.position_ids.dim() == 3:  # multimodal rope: [3, B, W], text positions on every axis
        following = following[None].expand(prompt.position_ids.shape[0], -1, -1)
    extras = dict(prompt.extras)
    for key, value in prompt.extras.items():
        if value.dim() == 2 and value.shape == prompt.input_ids.shape:  # per-token inputs (token types)
            extras[key] = torch.cat([value, value.new_zeros(value.shape[0], k)], dim=1)
    device = prompt.input_ids.device
    return dataclasses.replace(
        prompt,
        input_ids=torch.cat([prompt.input_ids, draft.to(device, prompt.input_ids.dtype)], dim=1),
        attention_mask=torch.cat([prompt.attention_mask, prompt.attention_mask.new_ones(draft.shape[0], k)], dim=1),
        position_ids=torch.cat([prompt.position_ids, following.to(prompt.position_ids.device)], dim=-1),
        extras=extras,
    )


def prepare(
    model: Any, prompt: Prompt, make_cache: Callable[[], Any], draft: Draft | None, *,
    part: Callable[[str], Any] | None = None, rows: int | None = None,
) -> Prepared:
    """The prompt of `prompt` in a fresh cache from `make_cache`, compressed with `draft`'s attention
    in its scores (`draft.rounds` times, each draft through the last round's cache; `draft.verify`:
    each from the last round's verified prefix on; `draft.jacobi`: each after the first from the last
    round's predictions); None is the plain prompt forward.

    The prompt runs once: its layers hold their whole prompt aside (`KvtoolCache.hold_prompt`), each
    round's draft is one forward of `draft.tokens` rows over it (`HeldCache`), and the next cache is
    compressed from it with their attention added, in that forward (`runtime.held`). `part(name)`, a
    context manager, wraps each of PARTS as it runs (benchmarks time them by it). `rows`: that many
    rows at a time, their caches joined (None: `row_groups.rows_at_once`, which splits the batch
    only where a draft's held prompt would put the peak above the full cache's)."""
    batch = prompt.input_ids.shape[0]
    cache = make_cache()
    if rows is None:
        rows = rows_at_once(batch, draft, cache, model, bool(prompt.extras))
    if rows >= batch:
        return _prepare(model, prompt, cache, make_cache, draft, part or contextlib.nullcontext)
    check_rows(rows, bool(prompt.extras))
    del cache
    parts = [prepare(model, prompt.row_slice(slice(start, start + rows)), make_cache, draft, part=part, rows=rows)
             for start in range(0, batch, rows)]
    prefixes = [p.prefix for p in parts]
    prefix = None if prefixes[0] is None else Verified(
        torch.cat([p.tokens for p in prefixes]), torch.cat([p.lengths for p in prefixes])
    )
    return Prepared(join_caches([p.cache for p in parts], make_cache), torch.cat([p.first_logits for p in parts]), prefix)


def _prepare(model: Any, prompt: Prompt, cache: Any, make_cache: Callable[[], Any], draft: Draft | None, part: Callable[[str], Any]) -> Prepared:
    """`prepare` of every row of `prompt` at once, into `cache` (fresh from `make_cache`)."""
    if draft is None:
        with part(PROMPT_FORWARD):
            return Prepared(cache, prompt_forward(model, prompt, cache))
    cache.hold_prompt()
    with part(PROMPT_FORWARD):
        first = prompt_forward(model, prompt, cache)
        held, image_mask = cache.take_held(), cache.image_mask  # the first round's cache compresses here
    prefix = logits = None
    for round_ in range(draft.rounds):
        if draft.jacobi and round_ > 0:
            tokens = predicted_draft(tokens, logits)
        else:
            with part(DRAFT_STEPS):
                tokens = drafted(model, cache, first, prompt, draft.tokens, prefix).cpu()
        del cache  # the draft's cache goes before the next one fills
        with part(DRAFT_ROWS):
            cache = make_cache()
            reading = HeldCache(model.config, held, cache.layers_to_fill(len(held), image_mask))
            logits = draft_logits(model, prompt, tokens, reading, draft.tokens if draft.verify or draft.jacobi else 1)
            if draft.verify:
                prefix = verified_prefix(tokens, logits)
            del reading
    let_go(held)
    return Prepared(cache, first, prefix)


# The parts of `prepare`, as `part` names them: the prompt's forward (its scoring and the first
# compression included), each round's greedy steps through the compressed cache, and each round's forward of the
# draft's rows over the held prompt (the next cache compressed in it, the draft verified by it).
PROMPT_FORWARD, DRAFT_STEPS, DRAFT_ROWS = "prompt forward", "draft steps", "draft rows' forward"
PARTS = (PROMPT_FORWARD, DRAFT_STEPS, DRAFT_ROWS)


def draft_logits(model: Any, prompt: Prompt, draft: torch.Tensor, cache: Any, keep: int) -> torch.Tensor:
    """The forward of `draft` [B, k] after `prompt`, whose keys and values `cache` holds: the rows'
    positions and mask continue the prompt's (as `with_draft` gives them); returns the last `keep`
    positions' logits [B, keep, V]."""
    whole = with_draft(prompt, draft)
    k = draft.shape[1]
    extras = {key: value[..., -k:] for key, value in whole.extras.items() if value.shape[-1] == whole.input_ids.shape[-1]}
    device = model.device
    out = model(
        input_ids=whole.input_ids[:, -k:].to(device),
        attention_mask=whole.attention_mask.to(device),
        position_ids=whole.position_ids[..., -k:].to(device),
        **with_cache(model, cache),
        use_cache=True,
        logits_to_keep=keep,
        **{key: value.to(device) for key, value in extras.items()},
    )
    return out.logits


def generate(
    model: Any,
    inputs: Mapping[str, Any],
    make_cache: Callable[[], Any],
    draft: Draft | None,
    *,
    on_prepared: Callable[[], None] | None = None,
    **generate_kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """`model.generate(**inputs, **generate_kwargs)` through a fresh cache from `make_cache`, with
    `draft` applied first; returns generate's sequences and the cache it ended with.

    With a draft (and more than one new token) the prompt is prepared here (`prepare`; the draft is
    never longer than `max_new_tokens`) and transformers' `generate` continues from its first token
    through the prepared cache, the verified prefix forced where there is one (`ForcedPrefix`; a
    sampled answer does not start with the full cache's greedy tokens, so sampling drafts without
    verifying). The sequences are the prompt and the new tokens, as `model.generate` returns them.
    `on_prepared` is called once the prompt is compressed (what follows is decoding). A prompt too
    short for compression to save memory (`runtime.memory.too_short_to_compress`, judged on the
    longest row) runs through a plain full cache: no scoring, no draft.
    """
    limit = generate_kwargs.get("max_new_tokens", model.generation_config.max_new_tokens)
    prompt = Prompt.of(inputs)
    short = too_short_to_compress(model, prompt.attention_mask)
    if short or draft is None or (limit is not None and limit <= 1):
        cache = make_cache()
        if short and isinstance(cache, KvtoolCache):
            # Nothing worth saving: the full cache, exactly as without kvtool (runtime.memory).
            cache = DynamicCache(config=model.config)
        loop = loop_for(model, cache, inputs, generate_kwargs)
        return model.generate(**inputs, **with_cache(model, cache), **generate_kwargs, **loop), cache
    if limit is not None:
        draft = draft.capped(limit)
        generate_kwargs["max_new_tokens"] = limit - 1  # the first token is chosen here
    if draft.verify and generate_kwargs.get("do_sample", model.generation_config.do_sample):
        draft = dataclasses.replace(draft, verify=False)
    with torch.no_grad():
        ready = prepare(model, prompt, make_cache, draft)
    if on_prepared is not None:
        on_prepared()
    first = ready.first_logits.argmax(dim=-1, keepdim=True).to(prompt.input_ids.device)
    processors = LogitsProcessorList(generate_kwargs.pop("logits_processor", None) or [])
    if ready.prefix is not None:
        processors.append(ForcedPrefix(ready.prefix, prompt.input_ids.shape[1]))
    mask = prompt.attention_mask
    continued = {
        "input_ids": torch.cat([prompt.input_ids, first], dim=1),
        "attention_mask": torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1),
    }
    sequences = model.generate(
        **continued,
        **with_cache(model, ready.cache),
        logits_processor=processors,
        **generate_kwargs,
        **loop_for(model, ready.cache, continued, generate_kwargs),
    )
    return sequences, ready.cache
