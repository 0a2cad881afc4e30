"""Several kvtool caches run as one batch: each over its own block of rows.

Calibration measures many recipes on the same prompts. One decode step of a small model on a CPU
costs about the same for 5 rows as for 15 (reading the weights dominates), so the recipes of one
search stage run side by side: the rows of the batch are the prompts repeated once per recipe, and
each block of rows is served by that recipe's own cache. Nothing mixes between blocks: a block's
layers see only its rows, attention runs per block on that block's own slots
(`attention.kvtool_attention_forward`), and a block's results equal the same cache run alone.

Every block must hold the same prompts (same logical length and padding), which is what the
recipe search hands it. Only decoding is supported: the prompts are put in with
`calibrate.truncation.compress_recorded_prompt` per block before grouping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvtool.errors import KvtoolError
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.layer import CompressingLayer


class GroupedLayer(DynamicLayer):
    """One layer index of several caches; part i serves rows [i * rows, (i + 1) * rows)."""

    is_croppable = False
    is_compileable = False

    def __init__(self, parts: Sequence[DynamicLayer], rows: int):
        super().__init__()
        self.parts = list(parts)
        self.rows = rows
        self.is_initialized = all(p.is_initialized for p in self.parts)
        self.is_sliding = getattr(self.parts[0], "is_sliding", False)
        self.compressing = isinstance(self.parts[0], CompressingLayer)
        if any(isinstance(p, CompressingLayer) != self.compressing for p in self.parts):
            raise KvtoolError("grouped caches must compress the same layers")

    def blocks(self) -> list[slice]:
        return [slice(i * self.rows, (i + 1) * self.rows) for i in range(len(self.parts))]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            raise KvtoolError("a grouped cache only decodes: put each block's prompt in before grouping")
        if key_states.shape[0] != self.rows * len(self.parts):
            raise KvtoolError(
                f"a grouped cache of {len(self.parts)} x {self.rows} rows was fed a batch of {key_states.shape[0]}"
            )
        states = [part.update(key_states[b], value_states[b], *args, **kwargs) for part, b in zip(self.parts, self.blocks())]
        if self.compressing:
            # kvtool attention reads each block's own slots (their counts differ between blocks).
            return key_states, value_states
        # Layers kvtool leaves alone hold the same columns in every block: one tensor serves sdpa.
        return torch.cat([k for k, _ in states]), torch.cat([v for _, v in states])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise KvtoolError("a grouped cache only decodes: put each block's prompt in before grouping")

    def get_seq_length(self) -> int:
        return self.parts[0].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parts[0].get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.parts[0].get_max_length()


class GroupedCache(Cache):
    """`caches` (kvtool caches, each holding the same prompts of `rows` rows) as one batch of
    len(caches) * rows rows, cache i serving the i-th block."""

    def __init__(self, caches: Sequence[KvtoolCache], rows: int):
        if not caches:
            raise KvtoolError("a grouped cache needs at least one cache")
        if len({len(c.layers) for c in caches}) != 1:
            raise KvtoolError("grouped caches must have the same layers")
        super().__init__(layers=[GroupedLayer([c.layers[i] for c in caches], rows) for i in range(len(caches[0].layers))])
        self.caches = list(caches)
        self.rows = rows
