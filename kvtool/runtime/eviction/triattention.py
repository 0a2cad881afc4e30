"""`triattention`: TriAttention's key score while generating. After each new token has attended, a
layer over its share drops the entry with the lowest score the `triattention` prompt scorer ranks
by (`importance.triattention`): each head's calibrated query centres rotated by RoPE averaged over
the geometric offsets after the newest token, plus the norm term, as a softmax over the layer's
entries. The paper re-scores and cuts the cache back every 128 tokens; this rule holds the budget at
every step instead (kvtool's layers never hold more than their share), re-scoring each time. Per KV
head in per-head layers, averaged over the KV heads in shared ones; sinks are never dropped (as
`expected-attention`'s rule, whose choice of victim it shares)."""

from __future__ import annotations

import torch

from kvtool.runtime.eviction.base import EntryView
from kvtool.runtime.eviction.expected_attention import ExpectedAttentionEvict
from kvtool.runtime.importance.triattention import triattention_probs


class TriAttentionEvict(ExpectedAttentionEvict):
    name = "triattention"
    # In SmolLM2's search at 0.2: 2.826 against `tova`'s 2.825 in round 1, 2.408 against 2.371 in
    # round 2 (`kvtool calibrate smollm2 --budget 0.2 --space
    # evictions=fixed-point,heavy-hitter,heavy-hitter-window,tova,expected-attention,triattention`):
    # tried when `--space evictions=` names it.
    searched = False

    def scores(self, entries: EntryView, start: torch.Tensor) -> torch.Tensor:
        return triattention_probs(entries.keys, entries.valid, entries.queries, start=start)
