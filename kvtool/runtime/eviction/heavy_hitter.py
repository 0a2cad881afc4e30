"""`heavy-hitter`: H2O's generation rule. Every entry accumulates the attention it receives (the prompt's
column sums, then each new token's probabilities, averaged over query heads); the most recent half of
the layer's share is protected and the entry with the lowest accumulated score among the rest goes.
In per-head layers each KV head accumulates its own scores and drops its own victim."""

from __future__ import annotations

import torch

from kvtool.runtime.eviction.base import EvictRule, entry_valid


class HeavyHitter(EvictRule):
    name = "heavy-hitter"
    needs_scores = True

    def victim(self, layer) -> torch.Tensor:
        recent = torch.as_tensor(layer.plan.keep(layer.tokens) // 2, device=layer.order.device)
        # Real tokens occupy the last logical columns of each row, so the newest `recent` of them
        # are the columns from `seen - recent` on.
        newest = (layer.seen - recent).view(-1, *([1] * (layer.order.dim() - 1)))
        valid = entry_valid(layer)
        candidates = valid & (layer.order < newest)
        candidates |= valid & ~candidates.any(dim=-1, keepdim=True)  # nothing old enough: anyone
        score = torch.where(candidates, layer.score, torch.full_like(layer.score, float("inf")))
        return score.argmin(dim=-1)
