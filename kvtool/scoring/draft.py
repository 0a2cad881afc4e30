"""The prompt forward with a draft: the answer's first tokens, drafted at the budget, help choose what stays.

A question says what the answer needs only in part; the answer's own first tokens read the rest
(which name, which number). A lookahead (`MethodSettings.lookahead`) lets them read it by holding
more than the budget while they are generated. A draft gets the same signal at the budget:

1. the prompt is compressed as usual and `tokens` greedy tokens are drafted through that cache;
2. that cache is dropped, and the prompt runs again into a fresh cache with the draft appended: the
   draft rows attend to the whole prompt inside that one forward, their attention joins the
   prompt's scores (column sums, and the observation window, which grows by the draft), and every
   layer keeps only prompt entries (`KvtoolCache.set_draft`);
3. generation starts from the prompt's end with the prompt's own last logits, exactly as without a
   draft, so the first token is the full cache's and no drafted token is kept.

With `rounds` > 1, steps 1-2 repeat: each later draft comes from the cache the previous round
scored, which keeps more of what the answer reads, so the draft is closer to the full cache's own
answer and the next scores closer to what that answer needs.

The cache holds the budget throughout; the cost is one more prompt forward and `tokens` - 1 steps
per round.

**Verified drafts** (`verify`). The second forward of step 2 runs the draft rows with full attention
over the whole prompt and over each other: its logits at the draft's positions are the full cache's
own predictions after each prefix of the draft, and they come with that forward at the price of a
few rows of the output projection. So the draft is checked there as speculative decoding checks
one: the longest prefix of the draft the full-attention logits agree with, plus their own next token
after it, are the full cache's greedy tokens (`Verified`). A later round drafts from that prefix on
(its tokens fed, the rest greedy through the cache), so each round's draft agrees with the full
cache's answer for at least one more token than the last; the answer itself then starts with the
verified prefix and goes on through the compressed cache (`reference_continuations(prefix=...)`,
`runtime.generate.ForcedPrefix`). Nothing is held beyond the budget: the check reads logits the
prompt forward computes anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvtool.runtime.verified import Verified, verify_draft
from kvtool.scoring.batches import Batch
from kvtool.scoring.engine import prompt_forward, prompt_logits, step_tokens


def drafted(
    model: Any, cache: Any, first_logits: torch.Tensor, batch: Batch, tokens: int, prefix: Verified | None = None
) -> torch.Tensor:
    """[B, tokens] greedy tokens after the prompt through `cache` (which holds the prompt); with a
    `prefix`, its verified tokens are fed first."""
    chosen: list[torch.Tensor] = []

    def pick(t: int, logits: torch.Tensor) -> torch.Tensor:
        chosen.append(logits.argmax(dim=-1) if prefix is None else prefix.choose(t, logits))
        return chosen[-1]

    step_tokens(model, cache, first_logits, batch, tokens, pick)
    return torch.stack(chosen, dim=1)


def with_draft(batch: Batch, draft: torch.Tensor) -> Batch:
    """`batch` with `draft` [B, k] appended to every row: real tokens at the positions the rows
    continue from."""
    k = draft.shape[1]
    steps = torch.arange(k, dtype=batch.position_ids.dtype)
    following = batch.next_positions.to(batch.position_ids.dtype) + steps  # [B, k]
    if batch.position_ids.dim() == 3:  # multimodal rope: [3, B, W], text positions on every axis
        following = following[None].expand(batch.position_ids.shape[0], -1, -1)
    extras = dict(batch.extras)
    for key, value in batch.extras.items():
        if value.dim() == 2 and value.shape == batch.input_ids.shape:  # per-token inputs (token types)
            extras[key] = torch.cat([value, value.new_zeros(value.shape[0], k)], dim=1)
    return dataclasses.replace(
        batch,
        input_ids=torch.cat([batch.input_ids, draft.to(batch.input_ids.device, batch.input_ids.dtype)], dim=1),
        attention_mask=torch.cat([batch.attention_mask, batch.attention_mask.new_ones(draft.shape[0], k)], dim=1),
        position_ids=torch.cat([batch.position_ids, following], dim=-1),
        extras=extras,
    )


def draft_prompt_forward(
    model: Any, batch: Batch, make_cache: Callable[[], Any], tokens: int, rounds: int = 1, verify: bool = False,
    reuse: bool = False,
) -> tuple[Any, torch.Tensor]:
    """The prompt of `batch` in a fresh cache from `make_cache`, compressed with a `tokens`-token
    draft's attention in its scores (`rounds` times, each draft through the last round's cache;
    `verify`: each from the last round's verified prefix on; `reuse`: the verified tokens' keys and
    values are the draft forward's, `runtime.verified.verify_draft`); returns the cache and the
    prompt's last logits [B, V]. `tokens` 0 is the plain prompt forward."""
    cache, first, _ = drafted_prompt(model, batch, make_cache, tokens, rounds, verify, reuse)
    return cache, first


def drafted_prompt(
    model: Any, batch: Batch, make_cache: Callable[[], Any], tokens: int, rounds: int = 1, verify: bool = False,
    reuse: bool = False,
) -> tuple[Any, torch.Tensor, Verified | None]:
    """`draft_prompt_forward`, and with `verify` the last round's verified prefix (else None)."""
    cache = make_cache()
    first = prompt_forward(model, batch, cache)
    if tokens <= 0:
        return cache, first, None
    prefix = None
    for _ in range(rounds):
        draft = drafted(model, cache, first, batch, tokens, prefix).cpu()
        del cache  # the draft's cache goes before the next one fills: one budget at a time
        cache = make_cache()
        cache.set_draft(tokens, keep=verify and reuse)
        if verify:
            logits = prompt_logits(model, with_draft(batch, draft), cache, tokens)
            prefix = verify_draft(cache, draft, logits, reuse)
        else:
            prompt_forward(model, with_draft(batch, draft), cache)
    return cache, first, prefix
