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

from kvtool.runtime.importance.expected import ExpectedAttention


class ExpectedOutput(ExpectedAttention):
    name = "expected-output"
    field = "expected_output"  # added to the prompt's scores by `queried.with_expected`
