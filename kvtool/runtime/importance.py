"""Attention received per prompt token (Elastic Cache / PrefixKV importance), computed in row chunks.

Never materialises the whole n x n map of every layer: one chunk of query rows at a time, next to the
normal sdpa kernel that produced the layer's output.
"""

from __future__ import annotations

import torch

# Elements of one chunk's score tensor; 2**24 floats = 64 MiB in float32.
CHUNK_ELEMENTS = 2**24


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision softmax column sums over thousands of rows lose too much; float64 stays float64.
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_importance(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Column sums of the causal attention probabilities over all query rows, averaged over query heads.

    query: [B, Hq, n, D] (after rotary), keys: [B, Hkv, n, D] (the prompt's keys, after rotary),
    mask: boolean [B, 1, n, n] (True = attend) or None for an unpadded causal prompt.
    Returns [B, n]: I[b, j] = (1/Hq) * sum_heads sum_rows A[row, j]. Padded query rows (all-False
    mask rows) and padded key columns contribute nothing.
    """
    if _flash_applies(query):
        # Values are not needed; the keys stand in for them so the flash kernel can run.
        fused = _flash_attention_with_importance(query, keys, keys, mask, scaling)
        if fused is not None:
            return fused[1]
    _, importance = _chunked_attention(query, keys, None, mask, scaling, chunk_elements)
    return importance


def attention_with_importance(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output ([B, n, Hq, D], sdpa_attention_forward's layout) and the importance.

    One pass over the scores serves both, so scoring the prompt costs little beyond the attention
    the layer computes anyway. Padded query rows get a zero output.
    """
    if _flash_applies(query):
        fused = _flash_attention_with_importance(query, keys, values, mask, scaling)
        if fused is not None:
            return fused
    out, importance = _chunked_attention(query, keys, values, mask, scaling, chunk_elements)
    return out, importance


def _flash_applies(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)


def _left_padded_causal(mask: torch.Tensor | None, bsz: int, n: int, device) -> torch.Tensor | None:
    """First real column per sequence if `mask` is exactly causal with left padding, else None."""
    if mask is None:
        return torch.zeros(bsz, dtype=torch.long, device=device)
    if mask.shape != (bsz, 1, n, n):
        return None
    real = mask[:, 0].diagonal(dim1=-2, dim2=-1)
    starts = n - real.sum(dim=1)
    columns = torch.arange(n, device=device)
    expected = (columns[None, :] >= starts[:, None])[:, None, None, :] & torch.ones(
        n, n, dtype=torch.bool, device=device
    ).tril()
    return starts if torch.equal(mask, expected) else None


def _flash_attention_with_importance(query, keys, values, mask, scaling):
    """CPU fast path: two flash-attention passes per sequence, nothing n x n in memory.

    Pass 1 is the layer's attention and yields each row's log-sum-exp `lse_r`. The column sum
    sum_r exp(q_r.k_j * scale - lse_r) is a log-sum-exp again, with keys and queries swapped:
    augment q_r with -lse_r and k_j with 1, and reverse the sequence so the swapped problem is
    causal in the usual direction. Pass 2's log-sum-exp is then log(importance). Padding is cut
    off per sequence (left padding only; anything else takes the chunked path).
    """
    bsz, n_heads, n, _ = query.shape
    starts = _left_padded_causal(mask, bsz, n, query.device)
    if starts is None:
        return None
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    groups = n_heads // keys.shape[1]
    out = query.new_zeros(bsz, n_heads, n, values.shape[-1])
    importance = torch.zeros(bsz, n, dtype=accumulation_dtype(query.dtype), device=query.device)
    for b, start in enumerate(starts.tolist()):
        q = query[b : b + 1, :, start:]
        k = keys[b : b + 1, :, start:].repeat_interleave(groups, dim=1)
        v = values[b : b + 1, :, start:].repeat_interleave(groups, dim=1)
        seq_out, lse = flash(q, k, v, 0.0, True, scale=scaling)
        out[b : b + 1, :, start:] = seq_out
        swapped_keys = torch.cat([q * scaling, -lse.unsqueeze(-1).to(q.dtype)], dim=-1).flip(2)
        swapped_queries = torch.cat([k, k.new_ones(*k.shape[:-1], 1)], dim=-1).flip(2)
        _, col_lse = flash(swapped_queries, swapped_keys, swapped_keys, 0.0, True, scale=1.0)
        importance[b, start:] = col_lse.flip(-1).exp().sum(dim=1)[0] / n_heads
    return out.transpose(1, 2).contiguous(), importance


def _chunked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | None,
    scaling: float,
    chunk_elements: int,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    bsz, n_heads, n_q, head_dim = query.shape
    n_kv_heads, n_k = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv_heads
    acc = accumulation_dtype(query.dtype)
    device = query.device
    # GQA: group query heads under their KV head, so keys are never repeated in memory.
    # The scale is folded into the query once instead of into every chunk of scores.
    q = (query.to(acc) * scaling).reshape(bsz, n_kv_heads, groups, n_q, head_dim)
    k_t = keys.to(acc).unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, D, n_k]
    v = None
    out = None
    if values is not None:
        v = values.to(acc)
        if mask is not None:
            # Padded positions may hold NaN from earlier layers; 0 * NaN would leak into real rows.
            key_real = mask[:, 0].any(dim=1)  # [B, n_k]: some row may attend to it
            v = v.masked_fill(~key_real[:, None, :, None], 0.0)
        v = v.unsqueeze(2)  # [B, Hkv, 1, n_k, D]
        out = torch.empty(bsz, n_kv_heads, groups, n_q, values.shape[-1], dtype=acc, device=device)
    offset = n_k - n_q  # queries are the last n_q positions
    total = torch.zeros(bsz, n_k, dtype=acc, device=device)
    rows = max(1, chunk_elements // max(1, bsz * n_heads * n_k))
    for r0 in range(0, n_q, rows):
        r1 = min(n_q, r0 + rows)
        end = offset + r1  # causal: no row of this chunk sees a key at or past `end`
        scores = torch.matmul(q[:, :, :, r0:r1], k_t[..., :end])  # [B, Hkv, g, c, end]
        if mask is not None:
            allowed = mask[:, :, r0:r1, :end]  # [B, 1, c, end]
            scores.masked_fill_(~allowed.unsqueeze(1), float("-inf"))
            row_real = allowed[:, 0].any(dim=-1)  # [B, c]; padded rows see nothing
        else:
            # Only the chunk's own diagonal block holds future positions.
            future = torch.ones(r1 - r0, r1 - r0, dtype=torch.bool, device=device).triu(1)
            scores[..., offset + r0 : end].masked_fill_(future, float("-inf"))
            row_real = None
        probs = torch.softmax(scores, dim=-1)
        if row_real is not None:
            # Fully masked (padded) query rows give NaN: they contribute nothing and output zero.
            probs = probs.masked_fill(~row_real[:, None, None, :, None], 0.0)
        total[:, :end] += probs.sum(dim=(1, 2, 3))
        if out is not None:
            out[:, :, :, r0:r1] = torch.matmul(probs, v[:, :, :, :end])
    if out is not None:
        out = out.reshape(bsz, n_heads, n_q, -1).transpose(1, 2).contiguous().to(query.dtype)
    return out, total / n_heads
