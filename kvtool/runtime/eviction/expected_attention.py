"""`expected-attention`: Expected Attention while generating. After each new token has attended, a
layer over its share drops the entry the coming queries are expected to attend least, by the same
score the `expected-attention` prompt scorer ranks with: each head's calibrated query mean and
covariance rotated by RoPE averaged over the `future` positions after the newest token, the softmax
of the expected logits over the layer's entries, times each value's relative norm
(`importance.expected`). The keys sit at their true positions, so the score depends on each entry's
distance from the coming queries, and it moves as generation goes on (TriAttention's point). Per KV
head in per-head layers, averaged over the KV heads in shared ones. Sinks are never dropped."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction.base import EntryView, EvictRule
from kvtool.runtime.importance.expected import expected_probs, value_weighted


class ExpectedAttentionEvict(EvictRule):
    name = "expected-attention"
    needs_queries = True
    # Measured behind `tova` in SmolLM2's search (2.361 choosing, 2.894 held out, against 2.333 and
    # 2.685) and on the 16 long answers (+0.085 NLL per token against the same recipe with `tova`),
    # while it made the default calibration cost 301 s: tried when `--space evictions=` names it.
    searched = False

    def frozen_count(self, prompt_kept: np.ndarray, *, truncation_distance: int, sink_tokens: int) -> np.ndarray:
        return np.minimum(sink_tokens, np.asarray(prompt_kept, dtype=np.int64))

    def scores(self, entries: EntryView, start: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, S]: each entry's score, the coming queries' from position `start` [B] on."""
        probs = expected_probs(entries.keys, entries.valid, entries.queries, start=start)
        return value_weighted(probs, entries.values, entries.valid)

    def victim(self, entries: EntryView) -> torch.Tensor:
        if entries.queries is None or entries.keys is None:
            raise KvtoolError(
                f"the {self.name} eviction rule needs the query statistics a calibrated profile carries "
                "(kvtool calibrate records them)"
            )
        score = self.scores(entries, torch.as_tensor(entries.tokens, device=entries.valid.device))
        if not entries.per_head:
            score = score.mean(dim=1)
        live = entries.entry_valid
        candidates = live & ~entries.frozen
        candidates |= live & ~candidates.any(dim=-1, keepdim=True)  # only sinks left: anyone
        return torch.where(candidates, score, torch.full_like(score, float("inf"))).argmin(dim=-1)
