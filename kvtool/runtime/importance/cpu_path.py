"""The prompt pass's CPU path: a left-padded causal batch, one sequence at a time with its padding
cut off, in blocks of query rows (causal_blocks) whose size block_size measures."""

from __future__ import annotations

import torch

from kvtool.runtime.importance import block_size
from kvtool.runtime.importance.causal_blocks import causal_blocks
from kvtool.runtime.importance.scores import PromptScores, accumulation_dtype


def applies(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)


def left_padded_causal(mask: torch.Tensor | None, bsz: int, n: int, device) -> torch.Tensor | None:
    """First real column per sequence if `mask` is exactly causal with left padding, else None.

    Checked in blocks of rows, so no second n x n mask is built (at 32k tokens one is a gigabyte)."""
    if mask is None:
        return torch.zeros(bsz, dtype=torch.long, device=device)
    if mask.shape != (bsz, 1, n, n):
        return None
    starts = n - mask[:, 0, -1].sum(dim=1)  # the last row sees every real column
    columns = torch.arange(n, device=device)
    real = columns[None, :] >= starts[:, None]  # [B, n]
    rows = max(1, 2**24 // max(1, bsz * n))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        causal = columns[None, :] <= torch.arange(r0, r1, device=device)[:, None]  # [c, n]
        expected = real[:, None, :] & causal[None] & real[:, r0:r1, None]
        if not torch.equal(mask[:, 0, r0:r1], expected):
            return None
    return starts


def blocked_attention(query, keys, values, mask, scaling, request):
    """CPU path, one sequence at a time with its left padding cut off (anything else takes the
    chunked path).

    Per block of query rows: one GEMM for the scores (query heads grouped under their KV head, so keys
    are never repeated), softmax, one GEMM for the output, and the block's probabilities summed into
    the column totals while they are still in cache. That is the attention the layer needs anyway plus
    one reduction; computing the output with the flash kernel and the column sums in a second,
    swapped flash pass was slower on the CPU.
    """
    bsz, n_heads, n, head_dim = query.shape
    starts = left_padded_causal(mask, bsz, n, query.device)
    if starts is None:
        return None
    n_kv_heads = keys.shape[1]
    acc = accumulation_dtype(query.dtype)
    out = query.new_zeros(bsz, n_heads, n, values.shape[-1])
    importance = torch.zeros(bsz, n, dtype=acc, device=query.device)
    heads = torch.zeros(bsz, n_kv_heads, n, dtype=acc, device=query.device) if request.heads else None
    window = torch.zeros(bsz, n_kv_heads, n, dtype=acc, device=query.device) if request.window else None
    for b, start in enumerate(starts.tolist()):
        sequence = (query[b, :, start:], keys[b, :, start:], values[b, :, start:])
        rows = block_size.block_rows(n_heads, n - start, sequence)
        seq_out, seq_importance, seq_heads, seq_window = causal_blocks(*sequence, scaling, request, rows=rows)
        out[b, :, start:] = seq_out
        importance[b, start:] = seq_importance
        if heads is not None:
            heads[b, :, start:] = seq_heads
        if window is not None:
            window[b, :, start:] = seq_window
    return out.transpose(1, 2).contiguous(), PromptScores(importance, heads, window)
