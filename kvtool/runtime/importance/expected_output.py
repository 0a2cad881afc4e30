"""`expected-output`: Expected Attention weighted by what each entry writes through the output
projection, ‖W_h v‖ per query head h (CriticalKV's weighting), instead of ‖v‖.

An entry moves head h's output by its attention times W_h v, where W_h is the slice of the output
projection that head writes through. Two values of equal norm can move the residual stream very
differently once W_h has turned them; ‖W_h v‖ measures that. Per query head its expected attention
(`expected.expected_probs`) times ‖W_h v‖ relative to the row's mean, averaged over the KV head's
query heads. The Gram matrices W_hᵀW_h come from the model's weights when the profile is applied;
the profile stores only the query statistics.
"""

from __future__ import annotations

import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.importance.base import Scorer
from kvtool.runtime.importance.scores import PromptScores, ScoreRequest


class ExpectedOutput(Scorer):
    name = "expected-output"

    def request(self, per_head: bool) -> ScoreRequest:
        return ScoreRequest(expected=True)

    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor:
        if scores.expected_output is None:
            raise KvtoolError("internal: the expected-output scorer was handed no expected-output scores")
        return scores.expected_output if per_head else scores.expected_output.mean(dim=1)
