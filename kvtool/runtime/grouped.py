"""Several kvtool caches run as one batch, each over its own block of rows: the cache over
`GroupedLayer`s (the layer, and why calibration runs its recipes this way: runtime/layer/grouped.py)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers.cache_utils import Cache

from kvtool.errors import KvtoolError
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.layer.grouped import GroupedLayer


class GroupedCache(Cache):
    """`caches` (kvtool caches, each holding the same prompts of `rows` rows) as one batch of
    len(caches) * rows rows, cache i serving the i-th block; with `merge`, blocks that decode alike
    share one layer per layer index (and their caches are no longer updated)."""

    def __init__(self, caches: Sequence[KvtoolCache], rows: int, merge: bool = False):
        if not caches:
            raise KvtoolError("a grouped cache needs at least one cache")
        if len({len(c.layers) for c in caches}) != 1:
            raise KvtoolError("grouped caches must have the same layers")
        super().__init__(
            layers=[GroupedLayer([c.layers[i] for c in caches], rows, merge) for i in range(len(caches[0].layers))]
        )
        self.caches = list(caches)
        self.rows = rows
