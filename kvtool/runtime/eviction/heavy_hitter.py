"""`heavy-hitter`: H2O's generation rule. Every entry accumulates the attention it receives (the prompt's
column sums, then each new token's probabilities, averaged over query heads); the most recent half of
the layer's share is protected and the entry with the lowest accumulated score among the rest goes.
In per-head layers each KV head accumulates its own scores and drops its own victim."""

from __future__ import annotations

import torch

from kvtool.runtime.eviction.base import EntryView, EvictRule


class HeavyHitter(EvictRule):
    name = "heavy-hitter"
    needs_scores = True

    def victim(self, entries: EntryView) -> torch.Tensor:
        # Real tokens occupy the last logical columns of each row, so the newest `share // 2` of them
        # are the columns from `seen - share // 2` on.
        order = entries.order
        newest = entries.seen - entries.share // 2
        if isinstance(newest, torch.Tensor):  # fixed slots: the counters are on the device
            old = order < newest.view(-1, *([1] * (order.dim() - 1)))
        elif (newest == newest[0]).all():
            old = order < int(newest[0])  # a scalar bound: no index tensor to build
        else:
            newest = torch.as_tensor(newest, device=order.device)
            old = order < newest.view(-1, *([1] * (order.dim() - 1)))
        old &= entries.entry_valid
        # No fallback for a row with nothing old: a row over its share holds share + 1 entries of
        # distinct columns, at most share // 2 of them recent; rows within it ignore their victim.
        return torch.where(old, entries.score, float("inf")).argmin(dim=-1)
