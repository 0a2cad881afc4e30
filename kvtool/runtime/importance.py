"""Attention received per prompt token (Elastic Cache / PrefixKV importance), computed in row chunks.

Never materialises the whole n x n map of every layer: one chunk of query rows at a time, next to the
normal sdpa kernel that produced the layer's output.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

# Elements of one chunk's score tensor on the portable path; 2**24 floats = 64 MiB in float32.
# Read when a call starts (not bound as a default), so a test can shrink it to force many chunks.
CHUNK_ELEMENTS = 2**24


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision softmax column sums over thousands of rows lose too much; float64 stays float64.
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ScoreRequest:
    """What a prompt pass scores beside the layer-averaged column sums (which it always gives).

    heads: also the column sums per KV head. window: also, per KV head, the attention the last
    `window` real prompt rows give each column (0: not needed).
    """

    heads: bool = False
    window: int = 0


@dataclass(frozen=True)
class PromptScores:
    """Attention received per prompt column, from one pass over the prompt's probabilities.

    importance: [B, n], column sums over every query row, averaged over all query heads (what
        calibration and the `attention-sum` scorer read).
    heads: [B, Hkv, n] or None, the same column sums averaged over each KV head's query heads
        (their mean over KV heads is `importance`).
    window: [B, Hkv, n] or None, per KV head the sum over the last `window` real query rows of
        A[row, column], averaged over the KV head's query heads (unpooled).
    Padded columns are 0 everywhere; padded query rows contribute nothing.
    """

    importance: torch.Tensor
    heads: torch.Tensor | None = None
    window: torch.Tensor | None = None


NO_EXTRAS = ScoreRequest()


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
    if _blocked_applies(query):
        # No values: the output GEMM has zero width.
        fused = _blocked_attention(query, keys, keys[..., :0], mask, scaling, request)
        if fused is not None:
            return fused[1]
    return _chunked_scores(query, keys, None, mask, scaling, CHUNK_ELEMENTS, request)[1]


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
    if _blocked_applies(query):
        fused = _blocked_attention(query, keys, values, mask, scaling, request)
        if fused is not None:
            return fused
    return _chunked_scores(query, keys, values, mask, scaling, CHUNK_ELEMENTS, request)


def _blocked_applies(query: torch.Tensor) -> bool:
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


def _blocked_attention(query, keys, values, mask, scaling, request):
    """CPU path, one sequence at a time with its left padding cut off (anything else takes the
    chunked path).

    Per block of query rows: one GEMM for the scores (query heads grouped under their KV head, so keys
    are never repeated), softmax, one GEMM for the output, and the block's probabilities summed into
    the column totals while they are still in cache. That is the attention the layer needs anyway plus
    one reduction; computing the output with the flash kernel and the column sums in a second,
    swapped flash pass cost 1.4x more (benchmarks/decode_speed.py, 4096-token prompts).
    """
    bsz, n_heads, n, head_dim = query.shape
    starts = _left_padded_causal(mask, bsz, n, query.device)
    if starts is None:
        return None
    n_kv_heads = keys.shape[1]
    acc = accumulation_dtype(query.dtype)
    out = query.new_zeros(bsz, n_heads, n, values.shape[-1])
    importance = torch.zeros(bsz, n, dtype=acc, device=query.device)
    heads = torch.zeros(bsz, n_kv_heads, n, dtype=acc, device=query.device) if request.heads else None
    window = torch.zeros(bsz, n_kv_heads, n, dtype=acc, device=query.device) if request.window else None
    for b, start in enumerate(starts.tolist()):
        seq_out, seq_importance, seq_heads, seq_window = _causal_blocks(
            query[b, :, start:], keys[b, :, start:], values[b, :, start:], scaling, request
        )
        out[b, :, start:] = seq_out
        importance[b, start:] = seq_importance
        if heads is not None:
            heads[b, :, start:] = seq_heads
        if window is not None:
            window[b, :, start:] = seq_window
    return out.transpose(1, 2).contiguous(), PromptScores(importance, heads, window)


# Score elements per row block. The best size depends on the CPU's caches and cores (2**22 float32,
# 16 MiB, was fastest on one 2-core machine at 4096 tokens and another machine of the same kind
# measured a 1.56x slower prompt phase), so it is measured: the first long prompt of each shape
# times every candidate on its own last rows and keeps the fastest (`block_tuning()` tells what
# was measured). An int here (or KVTOOL_BLOCK_ELEMENTS) fixes the size instead. Read when a call
# starts, like CHUNK_ELEMENTS. The block size changes only the order of the column sums' additions.
BLOCK_ELEMENTS: int | None = None
DEFAULT_BLOCK_ELEMENTS = 2**22
BLOCK_CANDIDATES = (2**20, 2**21, 2**22, 2**23, 2**24)
# Shorter prompts take the default: their whole attention is a few blocks and tuning would cost more
# than it saves. The probe times this many of the last (widest) rows per candidate, twice.
TUNE_MIN_KEYS = 1024
TUNE_PROBE_ROWS = 512


@dataclass(frozen=True)
class BlockTuning:
    """What tuning measured for one prompt shape: seconds per candidate and the choice."""

    n_heads: int
    keys: int  # the prompt length it was measured at
    seconds: dict[int, float]  # block elements -> best of two probe runs
    chosen: int

    @property
    def spread(self) -> float:
        """Slowest over fastest candidate: what a fixed size could cost on this machine."""
        return max(self.seconds.values()) / min(self.seconds.values())


_TUNED: dict[tuple, BlockTuning] = {}


def block_tuning() -> list[BlockTuning]:
    """Every block-size measurement this process made, in the order made."""
    return list(_TUNED.values())


def tune_blocks(n_heads: int, n_kv_heads: int, head_dim: int, m: int, dtype: torch.dtype = torch.float32) -> BlockTuning | None:
    """Measure the block size for prompts of `m` tokens now, on random tensors of that shape (the
    cost is data-independent), so a benchmark's timed runs do not pay for it. None when the size is
    fixed or the prompt too short to tune."""
    if _fixed_block_elements() is not None or m < TUNE_MIN_KEYS:
        return None
    generator = torch.Generator().manual_seed(0)
    probe = tuple(torch.randn(h, m, head_dim, generator=generator, dtype=dtype) for h in (n_heads, n_kv_heads, n_kv_heads))
    _block_rows(n_heads, m, probe)
    return block_tuning()[-1] if block_tuning() else None


def _fixed_block_elements() -> int | None:
    fixed = BLOCK_ELEMENTS if BLOCK_ELEMENTS is not None else os.environ.get("KVTOOL_BLOCK_ELEMENTS")
    return None if fixed is None else int(fixed)


def _tune(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, m: int) -> BlockTuning:
    n_heads = query.shape[0]
    first = max(0, m - TUNE_PROBE_ROWS)
    seconds = {}
    timed_rows = set()
    for elements in BLOCK_CANDIDATES:
        rows = _rows_for(elements, n_heads, m)
        if rows in timed_rows:  # the row clamp makes some candidates the same block
            continue
        timed_rows.add(rows)
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            _causal_blocks(query, keys, values, 1.0, NO_EXTRAS, rows=rows, first_row=first)
            best = min(best, time.perf_counter() - started)
        seconds[elements] = best
    chosen = min(seconds, key=seconds.get)
    return BlockTuning(n_heads=n_heads, keys=m, seconds=seconds, chosen=chosen)


def _rows_for(elements: int, n_heads: int, m: int) -> int:
    return max(16, min(256, elements // max(1, n_heads * m)))


def _block_rows(n_heads: int, m: int, probe: tuple | None = None) -> int:
    """Query rows per block of the CPU path for `n_heads` query heads over `m` keys: the fixed size,
    else the size tuned on `probe` (the sequence's query, keys, values) for long prompts, else the
    default."""
    fixed = _fixed_block_elements()
    if fixed is not None:
        return _rows_for(fixed, n_heads, m)
    if probe is None or m < TUNE_MIN_KEYS:
        return _rows_for(DEFAULT_BLOCK_ELEMENTS, n_heads, m)
    query, keys, _ = probe
    # One measurement per head count, width class (power of two) and thread count.
    key = (n_heads, keys.shape[0], query.shape[-1], query.dtype, 1 << (m - 1).bit_length(), torch.get_num_threads())
    tuned = _TUNED.get(key)
    if tuned is None:
        tuned = _TUNED[key] = _tune(*probe, m)
    return _rows_for(tuned.chosen, n_heads, m)


def _causal_blocks(query, keys, values, scaling, request=NO_EXTRAS, *, rows: int | None = None, first_row: int = 0):
    """Causal attention of one unpadded sequence: [Hq, m, Dv] output, [m] importance, and the
    [Hkv, m] per-head column sums and window sums when `request` asks for them (else None).

    `rows` per block (default: the tuned size); `first_row` skips the blocks before it, which only
    block-size tuning does (its timing of the widest rows; the results are then partial)."""
    n_heads, m, head_dim = query.shape
    n_kv_heads = keys.shape[0]
    groups = n_heads // n_kv_heads
    q = (query * scaling).view(n_kv_heads, groups, m, head_dim)
    k_t = keys.transpose(1, 2)  # [Hkv, D, m]
    out = query.new_empty(n_kv_heads, groups, m, values.shape[-1])
    total = torch.zeros(m, dtype=query.dtype, device=query.device)
    heads = torch.zeros(n_kv_heads, m, dtype=query.dtype, device=query.device) if request.heads else None
    window = torch.zeros(n_kv_heads, m, dtype=query.dtype, device=query.device) if request.window else None
    first_window_row = m - min(request.window, m)
    if rows is None:
        rows = _block_rows(n_heads, m, (query, keys, values))
    future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu(1)
    for r0 in range(first_row, m, rows):
        r1 = min(m, r0 + rows)
        c = r1 - r0
        q_block = q[:, :, r0:r1].reshape(n_kv_heads, groups * c, head_dim)
        scores = torch.bmm(q_block, k_t[:, :, :r1]).view(n_kv_heads, groups, c, r1)
        # Only the block's own diagonal square holds future positions.
        scores[..., r0:r1].masked_fill_(future[:c, :c], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(n_kv_heads, groups * c, r1)
        out[:, :, r0:r1] = torch.bmm(probs, values[:, :r1]).view(n_kv_heads, groups, c, -1)
        if heads is None:
            total[:r1] += probs.sum(dim=(0, 1))
        else:
            per_head = probs.sum(dim=1)  # [Hkv, r1]
            heads[:, :r1] += per_head
            total[:r1] += per_head.sum(dim=0)
        if window is not None and r1 > first_window_row:
            # The window is the sequence's last rows: only the last block(s) reach this.
            lo = max(first_window_row, r0) - r0
            window[:, :r1] += probs.view(n_kv_heads, groups, c, r1)[:, :, lo:].sum(dim=(1, 2))
    acc = accumulation_dtype(query.dtype)
    heads = None if heads is None else heads.to(acc) / groups
    window = None if window is None else window.to(acc) / groups
    return out.view(n_heads, m, -1), total.to(acc) / n_heads, heads, window


def _chunked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | None,
    scaling: float,
    chunk_elements: int,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The portable path's output and [B, n] importance."""
    out, scores = _chunked_scores(query, keys, values, mask, scaling, chunk_elements)
    return out, scores.importance


def _chunked_scores(
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
    heads = torch.zeros(bsz, n_kv_heads, n_k, dtype=acc, device=device) if request.heads else None
    window = None
    if request.window:
        window = torch.zeros(bsz, n_kv_heads, n_k, dtype=acc, device=device)
        in_window, first_window_row = _window_rows(mask, bsz, n_q, request.window, device)
    rows = _chunk_rows(chunk_elements, bsz * n_heads * n_k)
    for r0 in range(0, n_q, rows):
        r1 = min(n_q, r0 + rows)
        end = offset + r1  # causal: no row of this chunk sees a key at or past `end`
        if mask is not None and end < n_k and bool(mask[:, :, r0:r1, end:].any()):
            # Not causal: Gemma 3's image tokens attend to the whole image block, later ones included.
            end = n_k
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
            out[:, :, :, r0:r1] = torch.matmul(probs, v[:, :, :, :end])
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


def _chunk_rows(chunk_elements: int, row_elements: int) -> int:
    """Query rows per chunk of the portable path, for score rows of `row_elements` each."""
    return max(1, chunk_elements // max(1, row_elements))


def decode_attention_with_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    per_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token's attention over the cached slots, with the probabilities it gave them.

    query: [B, Hq, 1, D]; keys/values: [B, Hkv, S, D]; mask: boolean [B, 1, 1, S], or None when
    every slot holds an entry.
    Returns the output in sdpa_attention_forward's layout [B, 1, Hq, D] and the probabilities:
    [B, S] averaged over all query heads (what H2O accumulates and shared TOVA ranks), or with
    `per_head` [B, Hkv, S] averaged over each KV head's query heads (per-head layers, whose slots
    hold different entries in each KV head). Used only by rules that need the scores.
    """
    bsz, n_heads, _, head_dim = query.shape
    n_kv_heads = keys.shape[1]
    acc = accumulation_dtype(query.dtype)
    q = query.reshape(bsz, n_kv_heads, n_heads // n_kv_heads, head_dim).to(acc) * scaling
    scores = torch.matmul(q, keys.to(acc).transpose(-1, -2))  # [B, Hkv, g, S]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.to(acc))  # [B, Hkv, g, D]
    out = out.reshape(bsz, 1, n_heads, -1).to(query.dtype)
    if per_head:
        return out, probs.mean(dim=2)
    return out, probs.sum(dim=(1, 2)) / n_heads
