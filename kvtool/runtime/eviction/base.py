"""The eviction-rule interface: which entry a layer drops when generation pushes it over its share.

A rule sees the layer's entries through `EntryView`, a read-only view the layer builds for each
decision; rules import nothing from the layer (kvtool.runtime.layer imports them). A new rule is
one module in this package and one line in `EVICT_RULES` (__init__.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from kvtool.runtime.importance import NO_EXTRAS, PromptScores, ScoreRequest


class EntryView(NamedTuple):
    """What a rule may read of one layer's entries when it names a victim: the layer's own tensors
    (not copies, so a rule must not write them) and numbers, over its physical slots S. With fixed
    slots (layer/fixed.py) `seen` and `share` are device tensors, and a rule must not read them on
    the host: the step is replayed as a CUDA graph.

    Shared layers hold one set of entries for every KV head: `order`, `frozen`, `score` and
    `attention` are [B, S]. Per-head layers hold different entries in each KV head: those are
    [B, Hkv, S] while `valid` stays [B, S] (`entry_valid` broadcasts it against them).
    """

    valid: torch.Tensor  # [B, S] the slot holds an entry
    order: torch.Tensor  # the logical column (position) of each slot's entry
    frozen: torch.Tensor  # the slot is in the compressed prompt's frozen prefix (`frozen_count`)
    # Logical columns so far, padding included: the newest token's column is seen - 1.
    seen: int | torch.Tensor
    share: np.ndarray | torch.Tensor  # [B] entries each row may hold now (rows over it drop their victim)
    # Each entry's accumulated attention (rules with `needs_scores`; None otherwise).
    score: torch.Tensor | None = None
    # The attention the newest token gave each slot (rules with `needs_attention`; None otherwise). It
    # covers the slots the token attended to, the first ones or all: the slots after it are free.
    attention: torch.Tensor | None = None
    # Rules with `needs_queries`: the layer's keys and values ([B, Hkv, S, D]), its calibrated query
    # statistics (`importance.expected.LayerQueries`) and each row's real tokens so far ([B]; the
    # next token's position), None otherwise.
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    queries: Any = None
    tokens: np.ndarray | torch.Tensor | None = None

    @property
    def per_head(self) -> bool:
        return self.order.dim() == 3

    @property
    def entry_valid(self) -> torch.Tensor:
        """Slot validity shaped to broadcast against the per-entry state ([B, S] or [B, 1, S])."""
        return self.valid.unsqueeze(1) if self.per_head else self.valid


class EvictRule(ABC):
    """After each new token has attended, a layer with `kept > ceil(R * T)` asks its rule for one victim
    slot per sequence (only rows that are over their share drop it).

    In per-head layers (`EntryView.per_head`) a rule may name one victim per KV head ([B, Hkv]); the
    layer drops each head's own victim and keeps the cache rectangular. A [B] victim is freed in
    every head.
    """

    name: ClassVar[str]
    # True: the layer keeps each entry's accumulated attention (prompt importance plus what every
    # generated token gave it) in `EntryView.score`, which costs an explicit softmax per decode step.
    needs_scores: ClassVar[bool] = False
    # True: the layer keeps the attention the current token gave each entry in `EntryView.attention`
    # (same explicit softmax per decode step, nothing accumulated).
    needs_attention: ClassVar[bool] = False
    # True: the rule ranks the entries by the calibrated query statistics (a profile must carry them),
    # and reads keys, values, statistics and token counts from `EntryView`.
    needs_queries: ClassVar[bool] = False
    # False: prompt-only compression, the layer never evicts while generating.
    holds_budget: ClassVar[bool] = True
    # False: calibration's recipe search never tries the rule (it holds the budget, but only a named
    # method uses it).
    searched: ClassVar[bool] = True

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        """How many of each sequence's compressed prompt entries (in position order) are never evicted."""
        return np.zeros_like(np.asarray(prompt_kept, dtype=np.int64))

    def seed_request(self, per_head: bool, *, window: int) -> ScoreRequest:
        """What the prompt pass must score for `seed` beside the layer-averaged column sums (`window`:
        the plan's observation window, as its scorer's)."""
        return ScoreRequest(heads=per_head) if self.needs_scores else NO_EXTRAS

    def seed(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool, *, window: int, pool: int) -> torch.Tensor:
        """The accumulated score each prompt column starts from ([B, n]; [B, Hkv, n] per head), for
        rules with `needs_scores`: by default H2O's, the attention every prompt row gave it.
        `window` and `pool`: the plan's observation window and max-pool width."""
        return scores.heads if per_head else scores.importance

    @abstractmethod
    def victim(self, entries: EntryView) -> torch.Tensor:
        """[B] long: the slot to drop in each sequence; or [B, Hkv], one per KV head (per-head layers)."""


def queue_view(entries: EntryView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """valid, frozen and order for the queue rules (fixed-point, sliding), all [B, S].

    In a per-head layer these rules name one slot for every head, which the layer frees without moving
    anything. So every head keeps its compressed prompt in position order in the same slots, and each
    new token sits in the same slot in every head: the heads rank their slots by age alike, and the
    oldest unfrozen slot of head 0 is that of every head (a reference test decodes each head alone).
    """
    if entries.per_head:
        return entries.valid, entries.frozen[:, 0], entries.order[:, 0]
    return entries.valid, entries.frozen, entries.order


def oldest_unfrozen(valid: torch.Tensor, frozen: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Slot of the oldest valid, unfrozen entry per sequence ([B] long; [B, Hkv] for per-head metadata).

    `order` is each slot's logical column, so the smallest one is the queue's head. Physical slot
    order does not matter: attention is permutation invariant over cached entries.
    """
    candidates = valid & ~frozen
    key = torch.where(candidates, order, torch.full_like(order, torch.iinfo(order.dtype).max))
    return key.argmin(dim=-1)
