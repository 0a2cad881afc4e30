"""`similarity-avg`: LOOK-M's averaged merging (eq. 10).

Each evicted prompt entry goes to the kept entry with the most similar key (cosine, per KV head;
see `similarity.py`), and each kept entry becomes the plain mean of itself and everything matched
to it, keys and values alike:

    k_c' = (k_c + sum_e k_e) / (1 + L_c),   L_c = number of entries matched to c.
"""

from __future__ import annotations

from kvtool.runtime.merge.similarity import SimilarityMerge


class SimilarityAvgMerge(SimilarityMerge):
    name = "similarity-avg"
    rho = 0.0  # mass 1 per evicted entry, not mixed with its anchor first
