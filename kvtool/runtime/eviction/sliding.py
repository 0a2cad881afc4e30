"""`sliding`: StreamingLLM's generation rule: the sink tokens stay, everything else is a queue."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.eviction.base import EntryView, EvictRule, oldest_unfrozen, queue_view


class Sliding(EvictRule):
    name = "sliding"
    searched = False  # StreamingLLM's rule, for the `local` baseline; not among calibration's recipes

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        return np.minimum(sink_tokens, np.asarray(prompt_kept, dtype=np.int64))

    def victim(self, entries: EntryView) -> torch.Tensor:
        return oldest_unfrozen(*queue_view(entries))
