"""A fixed-slot decode step of one per-head `heavy-hitter` layer in four Triton kernels.

On a GPU a kvtool decode step is a CUDA graph (runtime.graphed), and what it costs is its kernels:
on an H100 at Llama-3.1-8B's shape a step ran 2,484 of them, about 40 per layer of kvtool's own
(place the token, attend with scores, accumulate them, pick and move the victim, the counters), each
a few microseconds of work plus the gap between graph nodes (docs/results.md, "The draft's rows in
GPU-sized chunks"). The shipped recipe's layers (per-head `heavy-hitter`, packed, fixed slots) do
all of that here in four launches:

1. `_partials`, one program per (batch row x KV head, split of the slots): the new token's g query
   rows against the row's entries in that split (slots 0..kept-1; packed layers hold their entries
   there), FlashAttention-style partial max, sum and output, and the scaled scores themselves into
   a scratch buffer (flash-decoding: a 1,600-slot row split over several programs keeps the GPU busy);
2. `_finish`, one program per (batch row, KV head): the new token's own score and the partials
   combined into the output, the final max and sum kept for the next kernel;
3. `_gains`, one program per (batch row x KV head, split): the probabilities (from the scratch scores
   and the final max and sum) added to each entry's score in the split, and the split's victim
   candidate (the lowest score among entries older than the newest half of the share, first slot
   on ties, as `HeavyHitter.victim`). On one program per row this loop was a fifth of a 32k-token
   decode step's device time (an H200's profile, docs/results.md);
4. `_place`, one program per batch row, after every head has read the counters: per KV head the
   victim among the splits' candidates and the new entry written where it stays (over the victim
   when the row is over its share: the eager step places it last and then moves the last entry onto
   the victim, the same state; else in the next free slot), then slot validity and the counters
   (`kept`, `tokens`, `seen`).

It computes what the eager fixed-slot step computes (`FixedSlots._place_fixed`, the kvtool attention,
`add_scores`, `_evict_fixed`) up to float rounding: the tests check it against that step in float64
and the victims for equality. `RuntimeSettings.fused_decode_step` (kvtool.runtime.settings; on: exact
and faster on an H100) switches it, `RuntimeSettings.split_victim_search` how `_gains` splits its
walk; without a GPU, Triton's interpreter runs it on CPU tensors (TRITON_INTERPRET=1), as for
`triton_scores`.

A soft-capping or sink layer (`scaling` a LogitScale, kvtool.runtime.importance.logits) caps every
score before its mask in `_partials` and `_finish`, and `_finish` counts its head's sink logit in
the combined max and sum (a column with no value), so the output and the probabilities `_gains`
adds are the model's (`triton_scores.logit_terms`).

A quantized layer's slots hold int8 or fp8 byte rows (layer/stored.py; `formats` says which, keys
and values apart). The new token comes in as the row `storage.write` gives, so `_place` copies
stored rows whatever they hold, bit for bit the eager step's; `_partials` and `_finish` read codes
and scales through kernels/stored_loads.py, so scores and output come from the entries attention
reads. Other formats are refused (`available`) and take the eager fixed step. `step_compile`
compiles the kernels for a GPU without one.

Over 400 lines because the four kernels and the launcher that passes each one its strides, splits,
block sizes and storage formats must be read together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.runtime.kernels import stored_loads, triton_scores
from kvtool.runtime.settings import current_settings

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

# `RuntimeSettings.fused_decode_step` chooses whether fixed-slot layers that qualify step through these
# kernels. On an H100 at Llama-3.1-8B's shape a three-kernel form of this step, its victim search in
# one program per row, decoded 1.35x / 1.21x faster than the eager step at 8192 x 4 / 32768 x 2 and
# passed cuda_check's comparison (docs/results.md, "The fused decode step").
# `RuntimeSettings.split_victim_search` chooses whether `_gains` walks each row's slots in the
# partials' splits (on) or in one program per row (off): split, as an H200's profile of that loop
# suggests (docs/results.md); gpu_bench's "victim search in one program" cell times both.
BLOCK_S = 64  # slots per block of the attention's inner loop (`_partials`)
FINISH_BLOCK_S = 256  # slots per block of the scores' and the victim's loop (`_gains`: no dot products)
INTERPRETER_BLOCK_S, INTERPRETER_FINISH_BLOCK_S = 16, 32  # several blocks even for the tests' few slots
# Programs the first kernel aims for (a few per SM of an H100's 132): slots are split until
# batch x KV heads x splits reaches it, in whole blocks.
TARGET_PROGRAMS = 264
MAX_HEAD_DIM = 256
NATIVE = ("native", "native")


@dataclass(frozen=True)
class StepScratch:
    """Buffers of one step's kernels, made once for a fixed-slot layer (the step is a CUDA graph: its
    buffers never change). `scores` [B * Hkv, g, S] float32: the new token's scaled scores (base 2);
    `maxes`, `sums` [B * Hkv, splits, g] and `outs` [B * Hkv, splits, g, D] float32: the partials;
    `final` [B * Hkv, 2, g] float32: their combined max and sum; `own` [B * Hkv] float32: the new
    entry's score; `best` [B * Hkv, splits] float32 and `first` [B * Hkv, splits] int64: each split's
    victim candidate (score, slot); `seen` [1] int64: the step's `seen` before it moves."""

    scores: torch.Tensor
    maxes: torch.Tensor
    sums: torch.Tensor
    outs: torch.Tensor
    final: torch.Tensor
    own: torch.Tensor
    best: torch.Tensor
    first: torch.Tensor
    seen: torch.Tensor
    split: int  # slots per split, a multiple of the block

    @classmethod
    def for_layer(cls, keys: torch.Tensor, n_heads: int, head_dim: int | None = None) -> "StepScratch":
        """For `keys` [B, Hkv, S, W] (stored rows: W bytes of a `head_dim` entry; native: W = D)."""
        bsz, n_kv_heads, slots, width = keys.shape
        head_dim = width if head_dim is None else head_dim
        block = _blocks()[0]
        groups = n_heads // n_kv_heads
        blocks = -(-slots // block)
        splits = max(1, min(blocks, -(-TARGET_PROGRAMS // (bsz * n_kv_heads))))
        split = -(-blocks // splits) * block
        splits = -(-slots // split)
        rows = bsz * n_kv_heads
        device = keys.device
        return cls(
            scores=torch.empty(rows, groups, slots, dtype=torch.float32, device=device),
            maxes=torch.empty(rows, splits, groups, dtype=torch.float32, device=device),
            sums=torch.empty(rows, splits, groups, dtype=torch.float32, device=device),
            outs=torch.empty(rows, splits, groups, head_dim, dtype=torch.float32, device=device),
            final=torch.empty(rows, 2, groups, dtype=torch.float32, device=device),
            own=torch.empty(rows, dtype=torch.float32, device=device),
            best=torch.empty(rows, splits, dtype=torch.float32, device=device),
            first=torch.empty(rows, splits, dtype=torch.int64, device=device),
            seen=torch.empty(1, dtype=torch.int64, device=device),
            split=split,
        )


def available(keys: torch.Tensor, formats: tuple[str, str] = NATIVE, dtype: torch.dtype | None = None,
              head_dim: int | None = None) -> bool:
    """Whether the kernels run on `keys`' device over entries stored as `formats` (`stored_loads`),
    of `head_dim` values in `dtype` (native: as `keys`; see `triton_scores.available`)."""
    if triton is None or stored_loads.format_codes(formats) is None:
        return False
    probe = keys if tuple(formats) == NATIVE else torch.empty(0, dtype=dtype or keys.dtype, device=keys.device)
    return (head_dim or keys.shape[-1]) <= MAX_HEAD_DIM and triton_scores.available(probe)


def decode_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: dict[str, torch.Tensor | None],
    scaling: float,
    scratch: StepScratch,
    formats: tuple[str, str] = NATIVE,
) -> torch.Tensor:
    """One decode step of a packed per-head heavy-hitter layer with fixed slots, in place.

    query [B, Hq, 1, D]; key, value [B, Hkv, 1, W] (the new token's, stored as the layer stores
    it); `state`: the layer's `keys`, `values` [B, Hkv, S, W], `valid` [B, S] bool, `order`
    [B, Hkv, S] long, `score` [B, Hkv, S] float32, `frozen` [B, Hkv, S] bool or None, and the fixed
    counters `kept`, `tokens` [B] long, `seen` [] long, `share` [counts, B] long (`FixedCounters`).
    `formats`: the keys' and values' storage (native: W = D; int8, fp8: W = D + 4 bytes, read by
    `stored_loads`). Returns the attention output [B, 1, Hq, D] (sdpa_attention_forward's layout)
    in the query's dtype."""
    keys, values, key, value = stored_loads.kernel_rows((state["keys"], state["values"], key, value), formats, query.dtype)
    bsz, n_kv_heads, slots = keys.shape[:3]
    n_heads, head_dim = query.shape[1], query.shape[3]
    key_format, value_format = stored_loads.format_codes(formats)
    groups = n_heads // n_kv_heads
    block_g = max(16, triton.next_power_of_2(groups))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block, finish_block = _blocks()
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    qk_scale = float(scaling) * triton_scores.LOG2E
    cap2, cap_k, sinks = triton_scores.logit_terms(scaling, n_heads, query.device)
    order, score, frozen = state["order"], state["score"], state["frozen"]
    valid = state["valid"].view(torch.uint8)
    frozen = frozen.view(torch.uint8) if frozen is not None else valid  # a dummy pointer when absent
    kept, tokens, seen, share = state["kept"], state["tokens"], state["seen"], state["share"]
    out = torch.empty(bsz, 1, n_heads, head_dim, dtype=query.dtype, device=query.device)
    partials, finish, gains, place = _kernels()
    splits = scratch.maxes.shape[1]
    rows = bsz * n_kv_heads
    partials[(rows, splits)](
        query, keys, values, kept, scratch.scores, scratch.maxes, scratch.sums, scratch.outs,
        *query.stride()[:2], query.stride(3), *keys.stride(), *values.stride(),
        n_kv_heads, slots, qk_scale, scratch.split, splits, cap2, cap_k,
        G=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block, PRECISION=precision,
        HAS_SOFTCAP=cap2 != 0.0, KEY_FORMAT=key_format, VALUE_FORMAT=value_format,
    )
    finish[(rows,)](
        query, key, value, out, scratch.maxes, scratch.sums, scratch.outs, scratch.final, scratch.own, seen, scratch.seen,
        scratch.own if sinks is None else sinks,  # a dummy pointer when unused
        *query.stride()[:2], query.stride(3), *key.stride()[:2], key.stride(3), *value.stride()[:2], value.stride(3),
        out.stride(0), out.stride(2), out.stride(3),
        n_kv_heads, qk_scale, splits, cap2, cap_k,
        G=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, HAS_SOFTCAP=cap2 != 0.0, HAS_SINKS=sinks is not None,
        KEY_FORMAT=key_format, VALUE_FORMAT=value_format,
    )
    gain_splits, gain_split = (splits, scratch.split) if current_settings().split_victim_search else (1, slots)
    gains[(rows, gain_splits)](
        scratch.scores, scratch.final, order, score, kept, tokens, seen, share, scratch.best, scratch.first,
        *order.stride(), *score.stride(), *share.stride(),
        n_kv_heads, slots, gain_split, gain_splits,
        G=groups, BLOCK_G=block_g, BLOCK_S=finish_block,
    )
    place[(bsz,)](
        key, value, keys, values, order, score, frozen, valid, kept, tokens, seen, scratch.seen, share, scratch.own,
        scratch.best, scratch.first,
        *key.stride()[:2], key.stride(3), *value.stride()[:2], value.stride(3),
        *keys.stride(), *values.stride(),
        *order.stride(), *score.stride(), *(frozen.stride() if state["frozen"] is not None else (0, 0, 0)),
        *valid.stride(), *share.stride(),
        n_kv_heads, gain_splits,
        K_WIDTH=keys.shape[3], BLOCK_KW=_block(keys.shape[3]), V_WIDTH=values.shape[3], BLOCK_VW=_block(values.shape[3]),
        HAS_FROZEN=state["frozen"] is not None,
    )
    return out


def _block(width: int) -> int:
    """The power-of-two block that covers a row of `width` values or bytes."""
    return max(16, triton.next_power_of_2(width))


def _blocks() -> tuple[int, int]:
    """The slot blocks of `_partials` and `_gains`."""
    if triton_scores.interpreting():
        return INTERPRETER_BLOCK_S, INTERPRETER_FINISH_BLOCK_S
    return BLOCK_S, FINISH_BLOCK_S


def _kernels() -> tuple:
    """The four kernels (`triton_scores.wrapped`)."""
    return triton_scores.wrapped(_partials, _finish, _gains, _place)


if triton is not None:
    # tl.sum / tl.max / tl.min are spelled as tl.reduce with tl.standard's combine functions, as in
    # triton_scores (the interpreter recognises those even where triton was imported without it).

    def _partials(
        Q, K, V, Kept, Scores, Maxes, Sums, Outs,
        sqb, sqh, sqd,
        skb, skh, sks, skd,
        svb, svh, svs, svd,
        HKV, S, qk_scale, SPLIT, SPLITS, cap2, cap_k,
        G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        KEY_FORMAT: tl.constexpr, VALUE_FORMAT: tl.constexpr,
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
        b = row // HKV
        h = row % HKV
        n = tl.load(Kept + b)  # the entries before the new token: slots 0..n-1 (packed)
        groups = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        g_ok = groups < G
        d_ok = dims < HEAD_DIM
        q_ptr = Q + b.to(tl.int64) * sqb + (h * G + groups).to(tl.int64)[:, None] * sqh + dims[None, :] * sqd
        q = tl.load(q_ptr, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        k_ptr = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
        v_ptr = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
        s_ptr = Scores + row.to(tl.int64) * G * S
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_G], 0.0, tl.float32)
        acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
        lo = part * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
        offs = tl.arange(0, BLOCK_S)
        for s0 in range(lo, hi, BLOCK_S):
            cols = s0 + offs
            c_ok = cols < hi
            kv_mask = c_ok[:, None] & d_ok[None, :]
            k_rows = k_ptr + cols.to(tl.int64) * sks
            v_rows = v_ptr + cols.to(tl.int64) * svs
            # Stored rows: their codes, exact in the model's dtype, and one scale per slot, applied to
            # the scores and the probabilities (q . codes x scale = q . (codes x scale)).
            k = stored_loads.codes(k_rows[:, None] + dims[None, :] * skd, kv_mask, KEY_FORMAT).to(Q.dtype.element_ty)
            v = stored_loads.codes(v_rows[:, None] + dims[None, :] * svd, kv_mask, VALUE_FORMAT).to(Q.dtype.element_ty)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = s * stored_loads.scale(k_rows + HEAD_DIM * skd, skd, c_ok, KEY_FORMAT)[None, :]  # native: 1
            if HAS_SOFTCAP:  # cap·tanh(s / cap) through exp2, before the mask (triton_scores)
                e = tl.exp2(tl.abs(s) * cap_k)
                s = tl.where(s < 0, -cap2, cap2) * ((1.0 - e) / (1.0 + e))
            s = tl.where(c_ok[None, :], s, float("-inf"))
            tl.store(s_ptr + groups[:, None] * S + cols[None, :], s, mask=g_ok[:, None] & c_ok[None, :])
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            p_v = p * stored_loads.scale(v_rows + HEAD_DIM * svd, svd, c_ok, VALUE_FORMAT)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p_v.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        at = (row * SPLITS + part) * G + groups
        tl.store(Maxes + at, m_i, mask=g_ok)
        tl.store(Sums + at, l_i, mask=g_ok)
        tl.store(Outs + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    def _finish(
        Q, Knew, Vnew, Out, Maxes, Sums, Outs, Final, Own, Seen, SeenNow, Sinks,
        sqb, sqh, sqd,
        snkb, snkh, snkd,
        snvb, snvh, snvd,
        sob, soh, sod,
        HKV, qk_scale, SPLITS, cap2, cap_k,
        G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KEY_FORMAT: tl.constexpr, VALUE_FORMAT: tl.constexpr,
    ):
        row = tl.program_id(0)
        b = row // HKV
        h = row % HKV
        groups = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        g_ok = groups < G
        d_ok = dims < HEAD_DIM
        q_ptr = Q + b.to(tl.int64) * sqb + (h * G + groups).to(tl.int64)[:, None] * sqh + dims[None, :] * sqd
        q = tl.load(q_ptr, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        # The new token as attention reads it: codes x scale (native: its values x 1, unchanged).
        k_row = Knew + b.to(tl.int64) * snkb + h.to(tl.int64) * snkh
        v_row = Vnew + b.to(tl.int64) * snvb + h.to(tl.int64) * snvh
        one = tl.full([], 1, tl.int1)
        k_new = (stored_loads.codes(k_row + dims * snkd, d_ok, KEY_FORMAT).to(tl.float32)
                 * stored_loads.scale(k_row + HEAD_DIM * snkd, snkd, one, KEY_FORMAT)).to(Q.dtype.element_ty)
        v_new = (stored_loads.codes(v_row + dims * snvd, d_ok, VALUE_FORMAT).to(tl.float32)
                 * stored_loads.scale(v_row + HEAD_DIM * snvd, snvd, one, VALUE_FORMAT)).to(Q.dtype.element_ty)
        s_new = tl.reduce(q * k_new.to(tl.float32)[None, :], 1, tl.standard._sum_combine) * qk_scale
        if HAS_SOFTCAP:
            e = tl.exp2(tl.abs(s_new) * cap_k)
            s_new = tl.where(s_new < 0, -cap2, cap2) * ((1.0 - e) / (1.0 + e))

        # Combine the splits' partials with the new token's own column (and the head's sink).
        m = s_new
        if HAS_SINKS:
            sink = tl.load(Sinks + h * G + groups, mask=g_ok, other=float("-inf"))
            m = tl.maximum(m, sink)
        for part in range(0, SPLITS):
            m = tl.maximum(m, tl.load(Maxes + (row * SPLITS + part) * G + groups, mask=g_ok, other=float("-inf")))
        p_new = tl.exp2(s_new - m)
        l_i = p_new
        if HAS_SINKS:
            l_i = l_i + tl.exp2(sink - m)
        acc = p_new.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        for part in range(0, SPLITS):
            at = (row * SPLITS + part) * G + groups
            m_part = tl.load(Maxes + at, mask=g_ok, other=float("-inf"))
            scale = tl.where(m_part == float("-inf"), 0.0, tl.exp2(m_part - m))
            l_i += tl.load(Sums + at, mask=g_ok, other=0.0) * scale
            acc += tl.load(Outs + at[:, None] * HEAD_DIM + dims[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0) * scale[:, None]
        out = acc / l_i[:, None]
        o_ptr = Out + b.to(tl.int64) * sob + (h * G + groups).to(tl.int64)[:, None] * soh + dims[None, :] * sod
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        tl.store(Final + row * 2 * G + groups, m, mask=g_ok)
        tl.store(Final + (row * 2 + 1) * G + groups, l_i, mask=g_ok)
        # The new entry's score: the probability the new token gave itself, averaged over its g rows.
        tl.store(Own + row, tl.reduce(tl.where(g_ok, p_new / l_i, 0.0), 0, tl.standard._sum_combine) / G)
        if row == 0:  # `_place` reads this copy: its first program moves `Seen` while others run
            tl.store(SeenNow, tl.load(Seen))

    def _gains(
        Scores, Final, Order, Score, Kept, Tokens, Seen, Share, Best, First,
        srb, srh, srs,
        scb, sch, scs,
        sht, shb,
        HKV, S, SPLIT, SPLITS,
        G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
        b = row // HKV
        h = row % HKV
        n = tl.load(Kept + b)
        # The share after this token (the counters move in `_place`): entries from `newest` on are
        # the protected newest half.
        share = tl.load(Share + (tl.load(Tokens + b) + 1) * sht + b * shb)
        newest = tl.load(Seen) + 1 - share // 2
        groups = tl.arange(0, BLOCK_G)
        g_ok = groups < G
        m = tl.load(Final + row * 2 * G + groups, mask=g_ok, other=0.0)
        l_i = tl.load(Final + (row * 2 + 1) * G + groups, mask=g_ok, other=1.0)
        # Each entry's score gains the probability the new token gave it (averaged over the g query
        # rows); the split's candidate is the lowest among its entries older than `newest`.
        s_ptr = Scores + row.to(tl.int64) * G * S
        o_row = Order + b.to(tl.int64) * srb + h.to(tl.int64) * srh
        c_row = Score + b.to(tl.int64) * scb + h.to(tl.int64) * sch
        best = tl.full([], float("inf"), tl.float32)
        victim = tl.full([], 0, tl.int64)
        lo = part * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
        offs = tl.arange(0, BLOCK_S)
        for s0 in range(lo, hi, BLOCK_S):
            cols = s0 + offs
            c_ok = cols < hi
            s = tl.load(s_ptr + groups[:, None] * S + cols[None, :], mask=g_ok[:, None] & c_ok[None, :], other=float("-inf"))
            p = tl.exp2(s - m[:, None]) / l_i[:, None]
            gained = tl.reduce(p, 0, tl.standard._sum_combine) / G
            total = tl.load(c_row + cols * scs, mask=c_ok, other=0.0) + gained
            tl.store(c_row + cols * scs, total, mask=c_ok)
            old = c_ok & (tl.load(o_row + cols * srs, mask=c_ok, other=0) < newest)
            candidate = tl.where(old, total, float("inf"))
            low = tl.reduce(candidate, 0, tl.standard._elementwise_min)
            first = tl.reduce(tl.where(candidate == low, cols, 2**30), 0, tl.standard._elementwise_min)
            better = low < best
            victim = tl.where(better, first.to(tl.int64), victim)
            best = tl.where(better, low, best)
        tl.store(Best + row * SPLITS + part, best)
        tl.store(First + row * SPLITS + part, victim)

    def _place(
        Knew, Vnew, K, V, Order, Score, Frozen, Valid, Kept, Tokens, Seen, SeenNow, Share, Own, Best, First,
        snkb, snkh, snkd,
        snvb, snvh, snvd,
        skb, skh, sks, skd,
        svb, svh, svs, svd,
        srb, srh, srs,
        scb, sch, scs,
        sfb, sfh, sfs,
        svab, svas,
        sht, shb,
        HKV, SPLITS,
        K_WIDTH: tl.constexpr, BLOCK_KW: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_VW: tl.constexpr,
        HAS_FROZEN: tl.constexpr,
    ):
        b = tl.program_id(0)
        n = tl.load(Kept + b)
        seen = tl.load(SeenNow)
        tokens = tl.load(Tokens + b) + 1
        share = tl.load(Share + tokens * sht + b * shb)
        newest = seen + 1 - share // 2
        over = n + 1 > share  # rows over their share drop a victim
        # The new entry's rows are copied whole: native values, or the stored bytes (codes and scale).
        k_cols = tl.arange(0, BLOCK_KW)
        k_ok = k_cols < K_WIDTH
        v_cols = tl.arange(0, BLOCK_VW)
        v_ok = v_cols < V_WIDTH
        for h in range(0, HKV):
            row = b * HKV + h
            # The splits in slot order, a strictly lower candidate winning: the first slot on ties.
            best = tl.full([], float("inf"), tl.float32)
            victim = tl.full([], 0, tl.int64)
            for part in range(0, SPLITS):
                low = tl.load(Best + row * SPLITS + part)
                better = low < best
                victim = tl.where(better, tl.load(First + row * SPLITS + part), victim)
                best = tl.where(better, low, best)
            own = tl.load(Own + row)
            # The new entry is a candidate too when the protected half is empty; it is the last slot,
            # so it wins only when strictly lower.
            victim = tl.where((seen < newest) & (own < best), n, victim)
            target = tl.where(over, victim, n)
            k_new = tl.load(Knew + b.to(tl.int64) * snkb + h * snkh + k_cols * snkd, mask=k_ok, other=0)
            v_new = tl.load(Vnew + b.to(tl.int64) * snvb + h * snvh + v_cols * snvd, mask=v_ok, other=0)
            tl.store(K + b.to(tl.int64) * skb + h * skh + target * sks + k_cols * skd, k_new, mask=k_ok)
            tl.store(V + b.to(tl.int64) * svb + h * svh + target * svs + v_cols * svd, v_new, mask=v_ok)
            tl.store(Order + b.to(tl.int64) * srb + h * srh + target * srs, seen)
            tl.store(Score + b.to(tl.int64) * scb + h * sch + target * scs, own)
            if HAS_FROZEN:
                tl.store(Frozen + b.to(tl.int64) * sfb + h * sfh + target * sfs, 0)
        # The new token's slot holds an entry unless the row dropped one (its victim took the token).
        tl.store(Valid + b.to(tl.int64) * svab + n * svas, tl.where(over, 0, 1).to(tl.uint8))
        tl.store(Kept + b, tl.where(over, n, n + 1))
        tl.store(Tokens + b, tokens)
        if b == 0:
            tl.store(Seen, seen + 1)
