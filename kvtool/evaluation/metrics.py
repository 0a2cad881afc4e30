"""Quality metrics: ROUGE-L F1 (via the `rouge-score` package), answer accuracy, the standard error of a mean."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from functools import lru_cache


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l_f1(prediction: str, target: str) -> float:
    """ROUGE-L F1 of `prediction` against `target` (two empty outputs agree perfectly)."""
    if not prediction.strip() and not target.strip():
        return 1.0
    return float(_scorer().score(target, prediction)["rougeL"].fmeasure)


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)); NaN below two values."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def answer_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """Share of the expected answers found in `prediction` (RULER's string-match-all: each answer
    counts when it occurs anywhere in the output, case-insensitively)."""
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)
