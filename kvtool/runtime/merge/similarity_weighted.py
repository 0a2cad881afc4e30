"""`similarity-weighted`: LOOK-M's weighted merging (eq. 12), with weights normalized to sum to one.

Each evicted prompt entry goes to the kept entry with the most similar key (cosine `s_e`, per KV
head; see `similarity.py`) and is weighted by that similarity; the anchor itself has weight 1 (its
similarity with itself):

    k_c' = (k_c + sum_e w_e k_e) / (1 + sum_e w_e),   w_e = max(s_e, 0).

LOOK-M's eq. 12 divides by `1 + L_c` instead, so its weights do not sum to one and shrink the
anchor; kvtool normalizes (methods.md). A negative best similarity (the entry points away from every
kept key) is clamped to weight 0: that entry is dropped as under plain eviction rather than
subtracted, so the result is always a convex combination. Values follow the keys with the same
weights.
"""

from __future__ import annotations

import torch

from kvtool.runtime.merge.similarity import SimilarityMerge


class SimilarityWeightedMerge(SimilarityMerge):
    name = "similarity-weighted"
    rho = 0.0

    def mass(self, similarity: torch.Tensor) -> torch.Tensor:
        return similarity.clamp(min=0.0)
