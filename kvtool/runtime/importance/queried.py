"""The scores a compressing layer adds to its prompt's PromptScores from calibrated query statistics
(no pass computes them: they need the layer's keys and values, which the layer holds)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import torch

from kvtool.runtime.importance.expected import LayerQueries, expected_probs, output_weighted, value_weighted
from kvtool.runtime.importance.scores import PromptScores
from kvtool.runtime.importance.triattention import triattention_probs

# The PromptScores fields filled from query statistics (each query scorer's `field`).
QUERY_FIELDS = ("expected", "expected_output", "triattention")


def with_expected(
    scores: PromptScores, keys: torch.Tensor, values: torch.Tensor, token_valid: torch.Tensor, queries: LayerQueries,
    fields: Collection[str],
) -> PromptScores:
    """`scores` with the query-statistics scores named in `fields` (of QUERY_FIELDS); the expected
    softmax runs once for `expected` and `expected_output` together, and only if one is named."""
    valid = token_valid.bool()
    probs = expected_probs(keys, token_valid, queries) if {"expected", "expected_output"} & set(fields) else None
    return replace(
        scores,
        expected=value_weighted(probs, values, valid) if "expected" in fields else None,
        expected_output=output_weighted(probs, values, valid, queries) if "expected_output" in fields else None,
        triattention=triattention_probs(keys, token_valid, queries) if "triattention" in fields else None,
    )


def added(scores: PromptScores) -> bool:
    """Whether `scores` already carry any query-statistics scores."""
    return any(getattr(scores, name) is not None for name in QUERY_FIELDS)
