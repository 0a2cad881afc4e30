"""`triattention`: TriAttention's key score while generating. After each new token has attended, a
layer over its share drops the entry with the lowest score the `triattention` prompt scorer ranks
by (`importance.triattention`): each head's calibrated query centres rotated by RoPE averaged over
the geometric offsets after the newest token, plus the norm term, as a softmax over the layer's
entries. The paper re-scores and cuts the cache back every 128 tokens; this rule holds the budget at
every step instead (kvtool's layers never hold more than their share), re-scoring each time. Per KV
head in per-head layers, averaged over the KV heads in shared ones. Sinks are never dropped."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction.base import EntryView, EvictRule
from kvtool.runtime.importance.triattention import triattention_probs


class TriAttentionEvict(EvictRule):
    name = "triattention"
    needs_queries = True
    # Like `expected-attention`'s rule: tried when `--space evictions=` names it.
    searched = False

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        return np.minimum(sink_tokens, np.asarray(prompt_kept, dtype=np.int64))

    def victim(self, entries: EntryView) -> torch.Tensor:
        if entries.queries is None or entries.keys is None:
            raise KvtoolError(
                "the triattention eviction rule needs the query statistics a calibrated profile carries "
                "(kvtool calibrate records them)"
            )
        start = torch.as_tensor(entries.tokens, device=entries.valid.device)
        score = triattention_probs(entries.keys, entries.valid, entries.queries, start=start)  # [B, Hkv, S]
        if not entries.per_head:
            score = score.mean(dim=1)
        live = entries.entry_valid
        candidates = live & ~entries.frozen
        candidates |= live & ~candidates.any(dim=-1, keepdim=True)  # only sinks left: anyone
        return torch.where(candidates, score, torch.full_like(score, float("inf"))).argmin(dim=-1)
