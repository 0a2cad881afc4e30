"""The eviction-rule interface: which entry a layer drops when generation pushes it over its share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from kvtool.runtime.importance import NO_EXTRAS, PromptScores, ScoreRequest

if TYPE_CHECKING:
    from kvtool.runtime.layer import CompressingLayer, LayerPlan


class EvictRule(ABC):
    """After each new token has attended, a layer with `kept > ceil(R * T)` asks its rule for one victim
    slot per sequence (only rows that are over their share drop it).

    Per-head layers (`layer.per_head`) hold different entries in each KV head: their `order`, `frozen`,
    `score` and `attention` are [B, Hkv, S] while `valid` stays [B, S] (`entry_valid(layer)` is valid
    shaped to broadcast against them). A rule may then name one victim per head ([B, Hkv]); the layer
    drops each head's own victim and keeps the cache rectangular. A [B] victim is freed in every head.
    """

    name: ClassVar[str]
    # True: the layer keeps each entry's accumulated attention (prompt importance plus what every
    # generated token gave it) in `layer.score`, which costs an explicit softmax per decode step.
    needs_scores: ClassVar[bool] = False
    # True: the layer keeps the attention the current token gave each entry in `layer.attention`
    # (same explicit softmax per decode step, nothing accumulated).
    needs_attention: ClassVar[bool] = False
    # False: prompt-only compression, the layer never evicts while generating.
    holds_budget: ClassVar[bool] = True

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        """How many of each sequence's compressed prompt entries (in position order) are never evicted."""
        return np.zeros_like(np.asarray(prompt_kept, dtype=np.int64))

    def seed_request(self, plan: LayerPlan, per_head: bool) -> ScoreRequest:
        """What the prompt pass must score for `seed` beside the layer-averaged column sums."""
        return ScoreRequest(heads=per_head) if self.needs_scores else NO_EXTRAS

    def seed(self, scores: PromptScores, token_valid: torch.Tensor, plan: LayerPlan, per_head: bool) -> torch.Tensor:
        """The accumulated score each prompt column starts from ([B, n]; [B, Hkv, n] per head), for
        rules with `needs_scores`: by default H2O's, the attention every prompt row gave it."""
        return scores.heads if per_head else scores.importance

    @abstractmethod
    def victim(self, layer: CompressingLayer) -> torch.Tensor:
        """[B] long: the slot to drop in each sequence; or [B, Hkv], one per KV head (per-head layers)."""


def entry_valid(layer) -> torch.Tensor:
    """The layer's slot validity shaped to broadcast against its per-entry metadata ([B, S] or [B, 1, S])."""
    valid = layer.valid
    return valid if layer.order.dim() == valid.dim() else valid.unsqueeze(1)


def queue_view(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """valid, frozen and order for the queue rules (fixed-point, sliding), all [B, S].

    In a per-head layer these rules name one slot for every head, which the layer frees without moving
    anything. So every head keeps its compressed prompt in position order in the same slots, and each
    new token sits in the same slot in every head: the heads rank their slots by age alike, and the
    oldest unfrozen slot of head 0 is that of every head (a reference test decodes each head alone).
    """
    if layer.order.dim() == 3:
        return layer.valid, layer.frozen[:, 0], layer.order[:, 0]
    return layer.valid, layer.frozen, layer.order


def oldest_unfrozen(valid: torch.Tensor, frozen: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Slot of the oldest valid, unfrozen entry per sequence ([B] long; [B, Hkv] for per-head metadata).

    `order` is each slot's logical column, so the smallest one is the queue's head. Physical slot
    order does not matter: attention is permutation invariant over cached entries.
    """
    candidates = valid & ~frozen
    key = torch.where(candidates, order, torch.full_like(order, torch.iinfo(order.dtype).max))
    return key.argmin(dim=-1)
