"""Generation-time eviction: which entry goes when a layer is over its share.

Fixed-point elimination (Elastic Cache, kept per layer by PrefixKV): the first `prefix - D` entries of
the compressed prompt are frozen (the instruction); everything after them is a queue, oldest out.
"""

from __future__ import annotations

import numpy as np
import torch


def frozen_prefix(kept_prompt: np.ndarray, truncation_distance: int, sink_tokens: int) -> np.ndarray:
    """Entries frozen per sequence: `prefix - D`, never fewer than the sinks the prefix holds."""
    kept_prompt = np.asarray(kept_prompt, dtype=np.int64)
    return np.maximum(kept_prompt - truncation_distance, np.minimum(sink_tokens, kept_prompt))


def oldest_unfrozen(valid: torch.Tensor, frozen: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Slot of the oldest valid, unfrozen entry per sequence ([B] long).

    `order` is each slot's logical column, so the smallest one is the queue's head. Physical slot
    order does not matter: attention is permutation invariant over cached entries.
    """
    candidates = valid & ~frozen
    key = torch.where(candidates, order, torch.full_like(order, torch.iinfo(order.dtype).max))
    return key.argmin(dim=1)
