"""The scores a compressing layer adds to its prompt's PromptScores from calibrated query statistics
(no pass computes them: they need the layer's keys and values, which the layer holds)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtool.runtime.importance.expected import LayerQueries, expected_probs, output_weighted, value_weighted
from kvtool.runtime.importance.scores import PromptScores
from kvtool.runtime.importance.triattention import triattention_probs


def with_expected(
    scores: PromptScores, keys: torch.Tensor, values: torch.Tensor, token_valid: torch.Tensor, queries: LayerQueries,
    *, output: bool, triattention: bool,
) -> PromptScores:
    """`scores` with the expected-attention scores; with `output` the expected-output ones too (one
    softmax for both), with `triattention` TriAttention's."""
    probs, valid = expected_probs(keys, token_valid, queries), token_valid.bool()
    return replace(
        scores,
        expected=value_weighted(probs, values, valid),
        expected_output=output_weighted(probs, values, valid, queries) if output else None,
        triattention=triattention_probs(keys, token_valid, queries) if triattention else None,
    )
