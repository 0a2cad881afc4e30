"""The eviction-rule interface: which entry a layer drops when generation pushes it over its share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from kvtool.runtime.layer import CompressingLayer


class EvictRule(ABC):
    """After each new token has attended, a layer with `kept > ceil(R * T)` asks its rule for one victim
    slot per sequence (only rows that are over their share drop it)."""

    name: ClassVar[str]
    # True: the layer keeps each entry's accumulated attention (prompt importance plus what every
    # generated token gave it) in `layer.score`, which costs an explicit softmax per decode step.
    needs_scores: ClassVar[bool] = False

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        """How many of each sequence's compressed prompt entries (in position order) are never evicted."""
        return np.zeros_like(np.asarray(prompt_kept, dtype=np.int64))

    @abstractmethod
    def victim(self, layer: CompressingLayer) -> torch.Tensor:
        """[B] long: the slot to drop in each sequence."""


def oldest_unfrozen(valid: torch.Tensor, frozen: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Slot of the oldest valid, unfrozen entry per sequence ([B] long).

    `order` is each slot's logical column, so the smallest one is the queue's head. Physical slot
    order does not matter: attention is permutation invariant over cached entries.
    """
    candidates = valid & ~frozen
    key = torch.where(candidates, order, torch.full_like(order, torch.iinfo(order.dtype).max))
    return key.argmin(dim=1)
