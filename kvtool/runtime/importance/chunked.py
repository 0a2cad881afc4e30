"""The prompt pass's portable path (any device, any dtype, any mask): all sequences at once, in
chunks of query rows, each chunk's scores at most `chunk_elements(device)`.

On a GPU it is what a draft's rows over a held prompt take (k rows against n + k keys, which the
Triton kernels, square by design, do not serve). There chunks sized for a CPU cost more than the
arithmetic: 64 rows over 8192 x 4 keys took 5 chunks a layer, and the draft's rows' forward 0.65 s a
round on an H100 (`benchmarks/gpu_bench.py --shapes 8192x4 --parts`), so a GPU's chunks are wider
(GPU_CHUNK_ELEMENTS)."""

from __future__ import annotations

import torch

from kvtool.runtime.importance.logits import cap_, sink_view, softmax_
from kvtool.runtime.importance.scores import NO_EXTRAS, PromptScores, ScoreRequest, accumulation_dtype

# Elements of one chunk's score tensor on the portable path; 2**24 floats = 64 MiB in float32, and on
# a GPU 2**28 (a draft's 64 rows over 32768 x 2 keys of Llama-3.1-8B's 32 heads in one chunk: 0.5 GiB,
# below the prompt forward's own MLP activations). Read when a call starts (not bound as a default),
# so a test can shrink them to force many chunks.
CHUNK_ELEMENTS = 2**24
GPU_CHUNK_ELEMENTS = 2**28


def chunk_elements(device: torch.device) -> int:
    """The score elements of one chunk on `device`."""
    return GPU_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS


def chunked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | None,
    scaling: float,
    chunk_elements: int,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The portable path's output and [B, n] importance."""
    out, scores = chunked_scores(query, keys, values, mask, scaling, chunk_elements)
    return out, scores.importance


def chunked_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | None,
    scaling: float,
    chunk_elements: int,
    request: ScoreRequest = NO_EXTRAS,
) -> tuple[torch.Tensor | None, PromptScores]:
    bsz, n_heads, n_q, head_dim = query.shape
    n_kv_heads, n_k = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv_heads
    acc = accumulation_dtype(query.dtype)
    device = query.device
    # GQA: a chunk's rows of every query head of a group are one matrix against their KV head's keys,
    # so keys and values are never repeated in memory (a broadcast matmul would copy them per head).
    # The scale is folded into the query once instead of into every chunk of scores.
    q = (query.to(acc) * scaling).reshape(bsz, n_kv_heads, groups, n_q, head_dim)
    k_t = keys.to(acc).transpose(-1, -2)  # [B, Hkv, D, n_k]
    v = None
    out = None
    if values is not None:
        v = values.to(acc)
        if mask is not None:
            # Padded positions may hold NaN from earlier layers; 0 * NaN would leak into real rows.
            key_real = mask[:, 0].any(dim=1)  # [B, n_k]: some row may attend to it
            v = v.masked_fill(~key_real[:, None, :, None], 0.0)
        out = torch.empty(bsz, n_kv_heads, groups, n_q, values.shape[-1], dtype=acc, device=device)
    offset = n_k - n_q  # queries are the last n_q positions
    total = torch.zeros(bsz, n_k, dtype=acc, device=device)
    heads = torch.zeros(bsz, n_kv_heads, n_k, dtype=acc, device=device) if request.heads else None
    window = None
    if request.window:
        window = torch.zeros(bsz, n_kv_heads, n_k, dtype=acc, device=device)
        in_window, first_window_row = _window_rows(mask, bsz, n_q, request.window, device)
    rows = chunk_rows(chunk_elements, bsz * n_heads * n_k)
    # A soft-capping or sink layer's logits (`scaling` a LogitScale, logits.py): capped before the
    # mask, sinks in every row's denominator.
    sink = sink_view(scaling, (1, n_kv_heads, groups, 1, 1), acc, device)
    for r0 in range(0, n_q, rows):
        r1 = min(n_q, r0 + rows)
        end = offset + r1  # causal: no row of this chunk sees a key at or past `end`
        if mask is not None and end < n_k and bool(mask[:, :, r0:r1, end:].any()):
            # Not causal: Gemma 3's image tokens attend to the whole image block, later ones included.
            end = n_k
        c = r1 - r0
        rows_q = q[:, :, :, r0:r1].reshape(bsz, n_kv_heads, groups * c, head_dim)
        scores = cap_(torch.matmul(rows_q, k_t[..., :end]).view(bsz, n_kv_heads, groups, c, end), scaling)
        if mask is not None:
            allowed = mask[:, :, r0:r1, :end]  # [B, 1, c, end]
            scores.masked_fill_(~allowed.unsqueeze(1), float("-inf"))
            row_real = allowed[:, 0].any(dim=-1)  # [B, c]; padded rows see nothing
        else:
            # Only the chunk's own diagonal block holds future positions.
            future = torch.ones(r1 - r0, r1 - r0, dtype=torch.bool, device=device).triu(1)
            scores[..., offset + r0 : end].masked_fill_(future, float("-inf"))
            row_real = None
        probs = softmax_(scores, sink)
        if row_real is not None:
            # Fully masked (padded) query rows give NaN: they contribute nothing and output zero.
            probs.masked_fill_(~row_real[:, None, None, :, None], 0.0)
        if heads is None:
            total[:, :end] += probs.sum(dim=(1, 2, 3))
        else:
            per_head = probs.sum(dim=(2, 3))  # [B, Hkv, end]
            heads[:, :, :end] += per_head
            total[:, :end] += per_head.sum(dim=1)
        if window is not None and r1 > first_window_row:
            rows_in = in_window[:, None, None, r0:r1, None].to(acc)  # [B, 1, 1, c, 1]
            window[:, :, :end] += (probs * rows_in).sum(dim=(2, 3))
        if out is not None:
            flat = probs.reshape(bsz, n_kv_heads, groups * c, end)
            out[:, :, :, r0:r1] = torch.matmul(flat, v[:, :, :end]).view(bsz, n_kv_heads, groups, c, -1)
    if out is not None:
        out = out.reshape(bsz, n_heads, n_q, -1).transpose(1, 2).contiguous().to(query.dtype)
    heads = None if heads is None else heads / groups
    window = None if window is None else window / groups
    return out, PromptScores(total / n_heads, heads, window)


def _window_rows(mask: torch.Tensor | None, bsz: int, n_q: int, window: int, device) -> tuple[torch.Tensor, int]:
    """[B, n_q] bool: the last `window` real query rows of each sequence; and the first row any
    sequence's window starts at (one host sync per call, so chunks before it skip the window sum)."""
    if mask is None:
        rows = torch.arange(n_q, device=device) >= n_q - window
        return rows.expand(bsz, n_q), max(0, n_q - window)
    real = mask[:, 0].any(dim=-1)  # [B, n_q]
    rank = torch.cumsum(real.long(), dim=1)  # 1-based rank of real rows
    in_window = real & (rank > real.sum(dim=1, keepdim=True) - window)
    hit = in_window.any(dim=0).nonzero()
    return in_window, int(hit[0, 0]) if hit.numel() else n_q


def chunk_rows(chunk_elements: int, row_elements: int) -> int:
    """Query rows per chunk of the portable path, for score rows of `row_elements` each."""
    return max(1, chunk_elements // max(1, row_elements))
