"""`fixed-point`: Elastic Cache's elimination, kept per layer by PrefixKV.

The first `prefix - D` entries of the compressed prompt are frozen (the instruction); everything after
them is a queue, oldest out, so the instruction and the recent tokens survive.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.eviction.base import EntryView, EvictRule, oldest_unfrozen, queue_view


def frozen_prefix(kept_prompt: np.ndarray, truncation_distance: int, sink_tokens: int) -> np.ndarray:
    """Entries frozen per sequence: `prefix - D`, never fewer than the sinks the prefix holds."""
    kept_prompt = np.asarray(kept_prompt, dtype=np.int64)
    return np.maximum(kept_prompt - truncation_distance, np.minimum(sink_tokens, kept_prompt))


class FixedPoint(EvictRule):
    name = "fixed-point"

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        return frozen_prefix(prompt_kept, truncation_distance, sink_tokens)

    def victim(self, entries: EntryView) -> torch.Tensor:
        return oldest_unfrozen(*queue_view(entries))
