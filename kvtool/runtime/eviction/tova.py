"""`tova`: TOVA's generation rule. After each new token has attended, a layer over its share drops the
entry the token attended least: its attention averaged over the query heads in shared layers, per KV
head (averaged over that head's query heads) in per-head layers, where each head drops its own
victim. Sink tokens (the frozen start of the compressed prompt) are never dropped; the new token
itself may go."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction.base import EntryView, EvictRule


class Tova(EvictRule):
    name = "tova"
    needs_attention = True

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        return np.minimum(sink_tokens, np.asarray(prompt_kept, dtype=np.int64))

    def victim(self, entries: EntryView) -> torch.Tensor:
        attention = entries.attention
        if attention is None:
            raise KvtoolError(
                "the tova eviction rule needs the new token's attention probabilities, which kvtool computes "
                "for inference attention only (no dropout)"
            )
        # The attention covers the slots the token attended to (the layer's first ones, or all of
        # them); the slots after those are free.
        width = attention.shape[-1]
        valid = entries.entry_valid[..., :width]
        candidates = valid & ~entries.frozen[..., :width]
        candidates |= valid & ~candidates.any(dim=-1, keepdim=True)  # only sinks left: anyone
        received = torch.where(candidates, attention, torch.full_like(attention, float("inf")))
        return received.argmin(dim=-1)
