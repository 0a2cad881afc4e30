"""The prompt pass: attention received per prompt token (Elastic Cache / PrefixKV importance),
computed next to the attention output the layer needs anyway.

Never materialises the whole n x n map of every layer: on a GPU torch's fused attention (or a Triton
flash-attention forward, for padded prompts) gives the output and each row's log-sum-exp, and a
Triton kernel the column sums in one more q.k pass per column block (kernels/); the CPU path runs
one sequence at a time in blocks of query rows (cpu_path); anything else (other masks, no Triton,
a draft's rows over a held prompt on a GPU) the portable path in row chunks (chunked). The CPU and
portable paths' sizes are read when a call starts, so a test can shrink them to force many blocks.
"""

from __future__ import annotations

import torch

from kvtool.runtime.importance import chunked, cpu_path
from kvtool.runtime.importance.scores import NO_EXTRAS, PromptScores, ScoreRequest
from kvtool.runtime.kernels import triton_scores


def _kernel(query, keys, values, mask, scaling, request) -> tuple[torch.Tensor, PromptScores] | None:
    """The Triton kernels' output and scores, where they apply: CUDA tensors (or Triton's CPU
    interpreter, TRITON_INTERPRET=1, which the tests use) and a causal, left-padded mask."""
    if not triton_scores.available(query) or query.shape[2] != keys.shape[2]:
        return None
    starts = cpu_path.left_padded_causal(mask, query.shape[0], query.shape[2], query.device)
    if starts is None:
        return None
    out, scores = triton_scores.attention_with_scores_triton(
        query, keys, values, starts, scaling, heads=request.heads, window=request.window
    )
    return out, PromptScores(scores.importance, scores.heads, scores.window)


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
    fused = _kernel(query, keys, keys, mask, scaling, request)  # the output is a by-product there
    if fused is not None:
        return fused[1]
    if cpu_path.applies(query):
        # No values: the output GEMM has zero width.
        fused = cpu_path.blocked_attention(query, keys, keys[..., :0], mask, scaling, request)
        if fused is not None:
            return fused[1]
    return chunked.chunked_scores(query, keys, None, mask, scaling, chunked.chunk_elements(query.device), request)[1]


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
    fused = _kernel(query, keys, values, mask, scaling, request)
    if fused is not None:
        return fused
    if cpu_path.applies(query):
        fused = cpu_path.blocked_attention(query, keys, values, mask, scaling, request)
        if fused is not None:
            return fused
    return chunked.chunked_scores(query, keys, values, mask, scaling, chunked.chunk_elements(query.device), request)
