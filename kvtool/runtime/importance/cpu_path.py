"""The prompt pass's CPU path: a left-padded causal batch, one sequence at a time with its padding
cut off, in blocks of query rows (causal_blocks) whose size block_size measures."""

from __future__ import annotations

import torch

from kvtool.runtime.importance import block_size
from kvtool.runtime.importance.causal_blocks import causal_blocks
from kvtool.runtime.importance.scores import PromptScores, accumulation_dtype


def applies(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)


def left_padded_causal(mask: torch.Tensor | None, bsz: int, n: int, device, n_keys: int | None = None) -> torch.Tensor | None:
    """First real column per sequence if `mask` is exactly causal with left padding, else None.

    The `n` query rows are the last of the `n_keys` (default `n`) positions: a draft's rows over a
    held prompt have n < n_keys. Checked in blocks of rows, so no second n x n mask is built (at 32k
    tokens one is a gigabyte)."""
    n_keys = n if n_keys is None else n_keys
    if mask is None:
        return torch.zeros(bsz, dtype=torch.long, device=device)
    if mask.shape != (bsz, 1, n, n_keys):
        return None
    offset = n_keys - n
    starts = n_keys - mask[:, 0, -1].sum(dim=1)  # the last row sees every real column
    columns = torch.arange(n_keys, device=device)
    real = columns[None, :] >= starts[:, None]  # [B, n_keys]
    rows = max(1, 2**24 // max(1, bsz * n_keys))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        positions = torch.arange(offset + r0, offset + r1, device=device)
        causal = columns[None, :] <= positions[:, None]  # [c, n_keys]
        expected = real[:, None, :] & causal[None] & real[:, offset + r0 : offset + r1, None]
        if not torch.equal(mask[:, 0, r0:r1], expected):
            return None
    return starts


def blocked_attention(query, keys, values, mask, scaling, request):
    """CPU path, one sequence at a time with its left padding cut off (anything else takes the
    chunked path). The queries are the last rows of the keys' positions: all of them in a prompt
    pass, a draft's rows in a forward over a held prompt (whose column sums cover those rows alone).

    Per block of query rows: one GEMM for the scores (query heads grouped under their KV head, so keys
    are never repeated), softmax, one GEMM for the output, and the block's probabilities summed into
    the column totals while they are still in cache. That is the attention the layer needs anyway plus
    one reduction; computing the output with the flash kernel and the column sums in a second,
    swapped flash pass was slower on the CPU.
    """
    bsz, n_heads, n_q, head_dim = query.shape
    n = keys.shape[2]
    offset = n - n_q  # the queries are the last n_q positions (a draft's rows over a held prompt: offset > 0)
    starts = left_padded_causal(mask, bsz, n_q, query.device, n)
    if starts is None:
        return None
    n_kv_heads = keys.shape[1]
    acc = accumulation_dtype(query.dtype)
    out = query.new_zeros(bsz, n_heads, n_q, values.shape[-1])
    importance = torch.zeros(bsz, n, dtype=acc, device=query.device)
    heads = torch.zeros(bsz, n_kv_heads, n, dtype=acc, device=query.device) if request.heads else None
    window = torch.zeros(bsz, n_kv_heads, n, dtype=acc, device=query.device) if request.window else None
    for b, start in enumerate(starts.tolist()):
        first_query = max(0, start - offset)
        sequence = (query[b, :, first_query:], keys[b, :, start:], values[b, :, start:])
        # The block size is tuned on prompt passes; a few rows over a held prompt take the default.
        rows = block_size.block_rows(n_heads, n - start, sequence if offset == 0 else None)
        seq_out, seq_importance, seq_heads, seq_window = causal_blocks(*sequence, scaling, request, rows=rows)
        out[b, :, first_query:] = seq_out
        importance[b, start:] = seq_importance
        if heads is not None:
            heads[b, :, start:] = seq_heads
        if window is not None:
            window[b, :, start:] = seq_window
    return out.transpose(1, 2).contiguous(), PromptScores(importance, heads, window)
