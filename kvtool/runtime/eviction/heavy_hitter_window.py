"""`heavy-hitter-window`: H2O's rule with the accumulation started from the question.

`heavy-hitter` starts each prompt entry's score at the attention every prompt row gave it, so an
entry that only the question read (a needle that the observation window kept) starts near zero and
is the first to go once generation pushes the layer over its share: the answer loses the fact the
prompt compression kept for it. Here each entry starts from what the last `window` prompt rows gave
it, max-pooled over `pool` positions as the window scorer pools it (so a fact kept whole is scored
whole); every generated token then adds its attention, as in H2O, and the most recent half of the
share stays protected. Per-head layers seed and evict each KV head on its own.
"""

from __future__ import annotations

import torch

from kvtool.runtime.eviction.heavy_hitter import HeavyHitter
from kvtool.runtime.importance import PromptScores, ScoreRequest, WindowScorer


class HeavyHitterWindow(HeavyHitter):
    name = "heavy-hitter-window"

    def seed_request(self, per_head: bool, *, window: int) -> ScoreRequest:
        return ScoreRequest(window=window)

    def seed(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool, *, window: int, pool: int) -> torch.Tensor:
        return WindowScorer(window=window, pool=pool).score(scores, token_valid, per_head)
