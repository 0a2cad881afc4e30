"""What `kvtool eval` measures, and the `--json` document other tools read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtool.evaluate.metrics import standard_error


@dataclass(frozen=True)
class MethodResult:
    """One method at one budget, pooled over every evaluation prompt."""

    method: str
    budget: float
    ppl: float  # exp(mean NLL) of the references, teacher-forced through the compressed cache
    rouge_l: float  # mean ROUGE-L F1 of the compressed greedy output vs the full cache's
    kv_fraction: float  # physical KV bytes / a full cache's bytes, at the end of greedy generation
    tokens: int  # reference tokens scored
    # Per prompt, in data order, so two methods can be compared prompt by prompt (paired).
    rouge_l_per_prompt: tuple[float, ...] = ()

    @property
    def rouge_l_sem(self) -> float:
        """Standard error of the mean ROUGE-L over prompts: how far the prompt count lets us trust a gap."""
        return standard_error(self.rouge_l_per_prompt)


@dataclass(frozen=True)
class EvalReport:
    model: str
    data: str
    samples: int
    max_new_tokens: int
    references: str  # "answers", "full-cache greedy", or "mixed"
    full_ppl: float
    reference_tokens: int
    profile_source: str  # where the per-layer ratios came from (built-in, file, calibrated now)
    results: tuple[MethodResult, ...]
    seconds: float
    outputs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The `--json` contract: `full_ppl` and `results` keep these names; the rest is context."""
        return {
            "full_ppl": self.full_ppl,
            "results": [
                {
                    "method": r.method, "budget": r.budget, "ppl": r.ppl, "rouge_l": r.rouge_l,
                    "kv_fraction": r.kv_fraction, "rouge_l_sem": _finite(r.rouge_l_sem),
                    "rouge_l_per_prompt": list(r.rouge_l_per_prompt),
                }
                for r in self.results
            ],
            "model": self.model,
            "data": self.data,
            "samples": self.samples,
            "max_new_tokens": self.max_new_tokens,
            "references": self.references,
            "reference_tokens": self.reference_tokens,
            "profile_source": self.profile_source,
            "seconds": self.seconds,
        }


def _finite(x: float) -> float | None:
    # JSON has no NaN; one prompt has no standard error.
    return None if math.isnan(x) else x
