"""The prompt pass: attention received per prompt token (Elastic Cache / PrefixKV importance),
computed next to the attention output the layer needs anyway.

Never materialises the whole n x n map of every layer: the CPU path runs one sequence at a time in
blocks of query rows (cpu_path), everything else the portable path in row chunks (chunked). Both
modules' sizes are read when a call starts, so a test can shrink them to force many blocks.
"""

from __future__ import annotations

import torch

from kvtool.runtime.importance import chunked, cpu_path
from kvtool.runtime.importance.scores import NO_EXTRAS, PromptScores, ScoreRequest


def attention_importance(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Column sums of the causal attention probabilities over all query rows, averaged over query heads.

    query: [B, Hq, n, D] (after rotary), keys: [B, Hkv, n, D] (the prompt's keys, after rotary),
    mask: boolean [B, 1, n, n] (True = attend) or None for an unpadded causal prompt.
    Returns [B, n]: I[b, j] = (1/Hq) * sum_heads sum_rows A[row, j]. Padded query rows (all-False
    mask rows) and padded key columns contribute nothing.
    """
    return prompt_scores(query, keys, mask, scaling).importance


def prompt_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    request: ScoreRequest = NO_EXTRAS,
) -> PromptScores:
    """`attention_importance` plus what `request` asks for, without the attention output."""
    if cpu_path.applies(query):
        # No values: the output GEMM has zero width.
        fused = cpu_path.blocked_attention(query, keys, keys[..., :0], mask, scaling, request)
        if fused is not None:
            return fused[1]
    return chunked.chunked_scores(query, keys, None, mask, scaling, chunked.CHUNK_ELEMENTS, request)[1]


def attention_with_importance(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output ([B, n, Hq, D], sdpa_attention_forward's layout) and the importance.

    One pass over the scores serves both, so scoring the prompt costs little beyond the attention
    the layer computes anyway. Padded query rows get a zero output.
    """
    out, scores = attention_with_scores(query, keys, values, mask, scaling)
    return out, scores.importance


def attention_with_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    request: ScoreRequest = NO_EXTRAS,
) -> tuple[torch.Tensor, PromptScores]:
    """`attention_with_importance` with the extra scores `request` asks for, from the same pass.

    The window rows are the last rows of the pass, so the window score adds one reduction over the
    last block(s) only; per-head column sums replace the block's full reduction by a per-head one.
    """
    if cpu_path.applies(query):
        fused = cpu_path.blocked_attention(query, keys, values, mask, scaling, request)
        if fused is not None:
            return fused
    return chunked.chunked_scores(query, keys, values, mask, scaling, chunked.CHUNK_ELEMENTS, request)
