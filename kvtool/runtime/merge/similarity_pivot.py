"""`similarity-pivot`: LOOK-M's pivotal merging (eq. 11), the default of LOOK-M (`lookm` method).

Each evicted prompt entry goes to the kept entry with the most similar key (cosine, per KV head;
see `similarity.py`). Each evicted entry is first averaged with its anchor into a "pivotal token"
`p_e = (k_e + k_c) / 2`; the anchor then becomes the plain mean of itself and all its pivotal
tokens (several entries matched to one anchor each make their own pivot, and all pivots are
averaged together with the anchor in one step, as in eq. 11 and the reference code's
`scatter_reduce(mean, include_self=True)`):

    k_c' = (k_c + sum_e (k_e + k_c) / 2) / (1 + L_c)
         = k_c (1 + L_c/2) / (1 + L_c) + sum_e k_e / (2 (1 + L_c)),   L_c = entries matched to c.

One matched entry gives 3/4 anchor + 1/4 entry; the anchor's weight never falls below one half.
Values follow the keys with the same weights.
"""

from __future__ import annotations

from kvtool.runtime.merge.similarity import SimilarityMerge


class SimilarityPivotMerge(SimilarityMerge):
    name = "similarity-pivot"
    rho = 0.5  # each evicted entry is first averaged with its anchor
