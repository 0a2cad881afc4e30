"""`attention-sum`: Elastic Cache / PrefixKV importance, the attention every prompt row gives a token."""

from __future__ import annotations

import torch

from kvtool.runtime.importance.base import Scorer
from kvtool.runtime.importance.scores import PromptScores, ScoreRequest


class AttentionSum(Scorer):
    name = "attention-sum"

    def request(self, per_head: bool) -> ScoreRequest:
        return ScoreRequest(heads=per_head)

    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor:
        return scores.heads if per_head else scores.importance
