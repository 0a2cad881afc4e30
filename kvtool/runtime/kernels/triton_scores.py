"""Causal prompt attention and its column sums (kvtool's importance) in two Triton kernels.

The portable path (`kvtool.runtime.importance`) walks row chunks through eager ops and is 18-101x a
plain prefill on a GPU. Here the prompt pass is two kernels and a few [B, Hkv, n] reductions
(for an unpadded 16-bit prompt, torch's fused attention replaces the first: `FORWARD`):

1. `_attn_fwd`, FlashAttention-style: one program per (block of query rows, batch row, query head)
   streams the key blocks at or left of its diagonal, keeps the online-softmax running max and sum in
   registers and writes the output (transformers' sdpa layout [B, n, Hq, D]) and each row's
   log-sum-exp (base 2, of the scaled scores) to a [B, Hq, n] float32 buffer.
2. `_col_sums`: one program per (block of key columns, batch row, KV head) loads its keys once and
   walks the KV head's g query heads and every query block at or below the diagonal, recomputing
   p = 2^(q.k * scale * log2(e) - lse_row) and summing it over the rows into a [BLOCK_M, BLOCK_N]
   float32 accumulator, reduced over the rows once at the end. Each column block's sums are owned by
   one program, so there are no atomics and no n x n tensor; the rows in the last `window` rows are
   summed again into a second accumulator for the window score.

Masking: row b's real tokens are columns starts[b]..n-1 (left padding); a real row attends to real
columns at or before it. Padded keys and values are loaded as zeros (earlier layers may leave NaN
there), padded query rows get a zero output and a +inf LSE (so they add nothing), padded columns
score 0. GQA: query head h reads KV head h // g (transformers' repeat_kv order) and keys are never
repeated in memory. Accumulation is float32 whatever the input dtype; float32 inputs use IEEE float32
products (no TF32), so the scores match the eager path to float32 rounding.

Soft-capping and sink layers (`scaling` a LogitScale, kvtool.runtime.importance.logits): both
kernels cap each score before its mask, cap·tanh(score / cap) (tanh spelled through exp2: the
base-2 scores' cap is cap·log2(e)), and a sink layer's forward starts each row's running max and
sum at its head's sink logit with no value, so the log-sum-exp, the output and the column sums
all count the sink; the fused forward (`FORWARD = "sdpa"`) computes neither and is left for plain
layers.

Without a GPU, Triton's interpreter runs the kernels on CPU tensors (how the tests check them): set
TRITON_INTERPRET=1 while calling. That works even where `triton` was imported without it (torch's
dynamo imports it, and transformers imports dynamo): the kernels are wrapped for the interpreter or
the compiler on each call, and they call no helper that Triton wrapped at its own import (tl.sum,
tl.max and tl.zeros are spelled as tl.reduce with tl.standard's combine functions, which the
interpreter recognises, and tl.full).

Over 400 lines because the two kernels, their launcher, their compile check (`compile_report`) and
the float64 reference they are checked against spell the same arguments and masking and must be read
together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvtool.runtime.kernels import fused_forward

try:  # Triton ships with CUDA builds of torch; a CPU install gets it from the `dev` extra.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

LOG2E = 1.4426950408889634
# Which kernel gives the output and the log-sum-exp: "sdpa", torch's fused kernel where it applies
# (kernels/fused_forward.py; unpadded prompts; on an H100 the no-draft prompt phase at 32768 x 2 took
# 3.82 s against 4.20 s with "triton", docs/results.md), else "triton" (`_attn_fwd`).
FORWARD = "sdpa"
FORWARDS = ("triton", "sdpa")
# Input dtypes the kernels take (float64 has no tensor-core dot; callers keep the eager path for it).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def available(*tensors: torch.Tensor) -> bool:
    """True when Triton imports and the kernels can run on `tensors`: CUDA tensors of a supported
    dtype, or (TRITON_INTERPRET=1) CPU tensors in the interpreter."""
    if triton is None:
        return False
    for tensor in tensors:
        if tensor.dtype not in DTYPES:
            return False
        if tensor.device.type == "cuda":
            if interpreting() or _imported_for_interpreter():
                return False
        elif not (tensor.device.type == "cpu" and interpreting()):
            return False
    return True


def _imported_for_interpreter() -> bool:
    """True when `triton` itself was imported with TRITON_INTERPRET set: its combine functions are
    then interpreter objects, which the compiler cannot take."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard._sum_combine, InterpretedFunction)


@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch options of the two kernels (powers of two, at least 16).

    fwd_m x fwd_n: query rows x key columns per step of the forward kernel (fwd_m a multiple of fwd_n);
    sum_m x sum_n: query rows per step x key columns owned by one program of the column-sum kernel.
    """

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 8
    sum_m: int = 64
    sum_n: int = 64
    sum_warps: int = 8
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("fwd_m", "fwd_n", "sum_m", "sum_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.fwd_m % self.fwd_n:
            raise ValueError(f"fwd_m ({self.fwd_m}) must be a multiple of fwd_n ({self.fwd_n})")


# 16-bit inputs at head dim 128: the tiles `benchmarks/gpu_bench.py --kernel-sweep` timed fastest on an
# H100 (Triton 3.6; docs/results/bench-gpu-h100-llama3-8b-sweep.json): 64 x 64 over 4 warps for both
# kernels, 0.80x the time of the Triton tutorial's 128 x 64 / 8 forward with 64 x 64 / 8 column sums.
# Compiled for sm_90 without a GPU under Triton 3.9 (`compile_report`): the forward uses 255 registers
# and spills 104 bytes of stack, the column sums 219 registers without spilling; timed fastest anyway.
# float32 (IEEE products, no tensor cores) gets smaller tiles: it is for exactness, not speed. Small
# tiles in the interpreter keep the CPU tests fast and cover several blocks per row.
GPU_BLOCKS = Blocks(fwd_m=64, fwd_n=64, fwd_warps=4, sum_m=64, sum_n=64, sum_warps=4)
FP32_BLOCKS = Blocks(fwd_m=64, fwd_n=32, fwd_warps=4, sum_m=32, sum_n=64, sum_warps=4, stages=2)
INTERPRETER_BLOCKS = Blocks(fwd_m=32, fwd_n=16, fwd_warps=4, sum_m=16, sum_n=32, sum_warps=4, stages=1)


@dataclass(frozen=True)
class TritonScores:
    """What `attention_with_scores_triton` scores (kvtool.runtime.importance.PromptScores' fields).

    importance: [B, n] float32, column sums over every real query row averaged over all query heads.
    heads: [B, Hkv, n] float32 (or None), the same averaged over each KV head's query heads.
    window: [B, Hkv, n] float32 (or None), per KV head the sums over the last `window` real rows only,
        averaged over the KV head's query heads.
    """

    importance: torch.Tensor
    heads: torch.Tensor | None = None
    window: torch.Tensor | None = None


def attention_with_scores_triton(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor | None,
    scaling: float,
    heads: bool = False,
    window: int = 0,
    *,
    blocks: Blocks | None = None,
    forward: str | None = None,
) -> tuple[torch.Tensor, TritonScores]:
    """Causal attention of a left-padded prompt and the column sums of its probabilities.

    query: [B, Hq, n, D] (after rotary); keys, values: [B, Hkv, n, D] with Hq = g * Hkv; any strides.
    starts: [B] integer, the first real column of each row (None: no padding). `scaling` multiplies
    q.k before the softmax; a LogitScale (kvtool.runtime.importance.logits) also soft-caps or adds its
    sink logits. Returns the output [B, n, Hq, D] (sdpa_attention_forward's layout, the
    query's dtype, padded rows zero) and the scores (`TritonScores`; float32, padded columns 0).
    `forward` (default `FORWARD`) picks the kernel of the output and the log-sum-exp.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    bsz, n_heads, n, head_dim = query.shape
    n_kv_heads = keys.shape[1]
    if keys.shape != (bsz, n_kv_heads, n, head_dim) or values.shape[:3] != (bsz, n_kv_heads, n):
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if values.shape[-1] != head_dim:
        raise ValueError("value head dim must equal the query/key head dim")
    if keys.dtype != query.dtype or values.dtype != query.dtype:
        raise ValueError(f"query, keys and values must share a dtype: {query.dtype}, {keys.dtype}, {values.dtype}")
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    groups = n_heads // n_kv_heads
    device = query.device
    if blocks is None:
        blocks = INTERPRETER_BLOCKS if interpreting() else FP32_BLOCKS if query.dtype == torch.float32 else GPU_BLOCKS
    if starts is None:
        starts = torch.zeros(bsz, dtype=torch.int32, device=device)
    starts = starts.to(device=device, dtype=torch.int32).contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    qk_scale = float(scaling) * LOG2E
    softcap, cap_k, sinks = logit_terms(scaling, n_heads, device)
    fwd, col_sums = _kernels()
    forward = FORWARD if forward is None else forward
    if forward not in FORWARDS:
        raise ValueError(f"unknown forward {forward!r} (known: {', '.join(FORWARDS)})")

    if forward == "sdpa" and fused_forward.applies(query, starts) and softcap == 0.0 and sinks is None:
        out, lse = fused_forward.forward_with_lse(query, keys, values, scaling)
    else:
        out = torch.empty(bsz, n, n_heads, head_dim, dtype=query.dtype, device=device)
        lse = torch.empty(bsz, n_heads, n, dtype=torch.float32, device=device)
        launch = {} if interpreting() else {"num_warps": blocks.fwd_warps, "num_stages": blocks.stages}
        fwd[(triton.cdiv(n, blocks.fwd_m), bsz * n_heads)](
            query, keys, values, out, lse, starts, lse if sinks is None else sinks,
            *query.stride(), *keys.stride(), *values.stride(), *out.stride(),
            n, n_heads, groups, qk_scale, softcap, cap_k,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=blocks.fwd_m, BLOCK_N=blocks.fwd_n, PRECISION=precision,
            HAS_SOFTCAP=softcap != 0.0, HAS_SINKS=sinks is not None,
            **launch,
        )

    sums = torch.empty(bsz, n_kv_heads, n, dtype=torch.float32, device=device)
    window_sums = torch.empty_like(sums) if window > 0 else sums  # a dummy pointer when unused
    launch = {} if interpreting() else {"num_warps": blocks.sum_warps, "num_stages": blocks.stages}
    col_sums[(triton.cdiv(n, blocks.sum_n), bsz * n_kv_heads)](
        query, keys, lse, starts, sums, window_sums,
        *query.stride(), *keys.stride(),
        n, n_kv_heads, groups, qk_scale, n - window, softcap, cap_k,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=blocks.sum_m, BLOCK_N=blocks.sum_n,
        HAS_WINDOW=window > 0, PRECISION=precision, HAS_SOFTCAP=softcap != 0.0,
        **launch,
    )
    importance = sums.sum(dim=1) / n_heads
    return out, TritonScores(
        importance=importance,
        heads=sums / groups if heads else None,
        window=window_sums / groups if window > 0 else None,
    )


def logit_terms(scaling, n_heads: int, device) -> tuple[float, float, torch.Tensor | None]:
    """What the kernels take of a LogitScale: the cap of the base-2 scores (0.0: none), the factor
    k with e^(-2|x|) = 2^(k |s|) for x = s / that cap, and the sinks in base 2 ([Hq] float32, or None)."""
    cap = getattr(scaling, "softcap", None)
    sinks = getattr(scaling, "sinks", None)
    cap2 = 0.0 if cap is None else float(cap) * LOG2E
    cap_k = 0.0 if cap is None else -2.0 * LOG2E / cap2
    if sinks is not None:
        if sinks.numel() != n_heads:
            raise ValueError(f"{sinks.numel()} sink logits do not fit {n_heads} query heads")
        sinks = (sinks.detach().to(device=device, dtype=torch.float32).reshape(n_heads) * LOG2E).contiguous()
    return cap2, cap_k, sinks


def _kernels() -> tuple:
    """The two kernels (`wrapped`)."""
    return wrapped(_attn_fwd, _col_sums)


_WRAPPED: dict[tuple, tuple] = {}


def wrapped(*functions) -> tuple:
    """Kernel functions for the interpreter when TRITON_INTERPRET is set now, else compiled (each
    wrapped once per process and mode): this module's and kernels/triton_step.py's."""
    key = (interpreting(), *functions)
    if key not in _WRAPPED:
        if key[0]:
            from triton.runtime.interpreter import InterpretedFunction

            _WRAPPED[key] = tuple(InterpretedFunction(fn) for fn in functions)
        else:
            _WRAPPED[key] = tuple(triton.jit(fn) for fn in functions)
    return _WRAPPED[key]


if triton is not None:

    def _attn_fwd(
        Q, K, V, Out, Lse, Starts, Sinks,
        sqb, sqh, sqm, sqd,
        skb, skh, skn, skd,
        svb, svh, svn, svd,
        sob, som, soh, sod,
        n, H, G, qk_scale, cap2, cap_k,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        # The last query blocks see the most keys: launch them first.
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        kvh = h // G
        start = tl.load(Starts + b)
        m0 = pid_m * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        row_real = (rows >= start) & (rows < n)

        q_ptr = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        k_ptr = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        v_ptr = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        q = tl.load(q_ptr + rows[:, None] * sqm + dims[None, :] * sqd, mask=row_real[:, None] & dim_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        if HAS_SINKS:
            # The sink is the row's first column, of weight 2^0 at its own max, with no value.
            m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(Sinks + h)
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        offs = tl.arange(0, BLOCK_N)
        lo = (start // BLOCK_N) * BLOCK_N

        # Key blocks wholly left of this query block: every real row sees every real column.
        for s0 in range(lo, m0, BLOCK_N):
            cols = s0 + offs
            col_real = cols >= start  # cols < m0 < n
            kv_mask = col_real[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + cols[:, None] * skn + dims[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + cols[:, None] * svn + dims[None, :] * svd, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if HAS_SOFTCAP:  # cap·tanh(s / cap), before the mask
                e = tl.exp2(tl.abs(s) * cap_k)
                s = tl.where(s < 0, -cap2, cap2) * ((1.0 - e) / (1.0 + e))
            s = tl.where(col_real[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        # The diagonal blocks: causal, padding and bounds masks.
        hi = tl.minimum(m0 + BLOCK_M, n)
        for s0 in range(tl.maximum(lo, m0), hi, BLOCK_N):
            cols = s0 + offs
            col_real = (cols >= start) & (cols < n)
            kv_mask = col_real[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + cols[:, None] * skn + dims[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + cols[:, None] * svn + dims[None, :] * svd, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if HAS_SOFTCAP:
                e = tl.exp2(tl.abs(s) * cap_k)
                s = tl.where(s < 0, -cap2, cap2) * ((1.0 - e) / (1.0 + e))
            visible = col_real[None, :] & (cols[None, :] <= rows[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        seen = row_real & (l_i > 0.0)
        l_safe = tl.where(seen, l_i, 1.0)
        out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
        # Padded rows: +inf, so the column-sum kernel's 2^(s - lse) is 0 for them.
        lse = tl.where(seen, m_i + tl.log2(l_safe), float("inf"))
        o_ptr = Out + b.to(tl.int64) * sob + h.to(tl.int64) * soh
        in_bounds = rows < n
        tl.store(o_ptr + rows[:, None] * som + dims[None, :] * sod, out.to(Out.dtype.element_ty), mask=in_bounds[:, None] & dim_ok[None, :])
        tl.store(Lse + pid_bh.to(tl.int64) * n + rows, lse, mask=in_bounds)

    def _col_sums(
        Q, K, Lse, Starts, Sums, WindowSums,
        sqb, sqh, sqm, sqd,
        skb, skh, skn, skd,
        n, HKV, G, qk_scale, window_first, cap2, cap_k,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ):
        # Column block 0 is summed over every row: the heaviest programs come first.
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // HKV
        kvh = pid_bh % HKV
        start = tl.load(Starts + b)
        n0 = pid_n * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        col_real = (cols >= start) & (cols < n)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM

        k_ptr = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        k = tl.load(k_ptr + cols[:, None] * skn + dims[None, :] * skd, mask=col_real[:, None] & dim_ok[None, :], other=0.0)
        k_t = tl.trans(k)

        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        win = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        offs = tl.arange(0, BLOCK_M)
        # Rows that can see a column of this block: from the block's first real column on.
        m_lo = (tl.maximum(n0, start) // BLOCK_M) * BLOCK_M
        # A wholly padded block sums nothing.
        m_end = tl.where(n0 + BLOCK_N <= start, m_lo, n)
        # Query blocks from m_mid on lie wholly below this block's diagonal.
        m_mid = tl.minimum(tl.maximum(((n0 + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, m_lo), m_end)

        for hh in range(0, G):
            h = kvh * G + hh
            q_ptr = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            lse_ptr = Lse + (b.to(tl.int64) * HKV * G + h) * n
            for m0 in range(m_lo, m_mid, BLOCK_M):
                rows = m0 + offs
                in_bounds = rows < n
                q = tl.load(q_ptr + rows[:, None] * sqm + dims[None, :] * sqd, mask=in_bounds[:, None] & dim_ok[None, :], other=0.0)
                lse = tl.load(lse_ptr + rows, mask=in_bounds, other=float("inf"))
                s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
                if HAS_SOFTCAP:
                    e = tl.exp2(tl.abs(s) * cap_k)
                    s = tl.where(s < 0, -cap2, cap2) * ((1.0 - e) / (1.0 + e))
                p = tl.exp2(s - lse[:, None])
                visible = col_real[None, :] & (cols[None, :] <= rows[:, None]) & in_bounds[:, None]
                p = tl.where(visible, p, 0.0)
                acc += p
                if HAS_WINDOW:
                    win += tl.where(rows[:, None] >= window_first, p, 0.0)
            # Below the diagonal every row is real; rows past n have lse = +inf (p = 0) and padded
            # columns are dropped after the reduction.
            for m0 in range(m_mid, m_end, BLOCK_M):
                rows = m0 + offs
                in_bounds = rows < n
                q = tl.load(q_ptr + rows[:, None] * sqm + dims[None, :] * sqd, mask=in_bounds[:, None] & dim_ok[None, :], other=0.0)
                lse = tl.load(lse_ptr + rows, mask=in_bounds, other=float("inf"))
                s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
                if HAS_SOFTCAP:
                    e = tl.exp2(tl.abs(s) * cap_k)
                    s = tl.where(s < 0, -cap2, cap2) * ((1.0 - e) / (1.0 + e))
                p = tl.exp2(s - lse[:, None])
                acc += p
                if HAS_WINDOW:
                    if m0 + BLOCK_M > window_first:
                        win += tl.where(rows[:, None] >= window_first, p, 0.0)

        out_ptr = pid_bh.to(tl.int64) * n + cols
        in_cols = cols < n
        tl.store(Sums + out_ptr, tl.where(col_real, tl.reduce(acc, 0, tl.standard._sum_combine), 0.0), mask=in_cols)
        if HAS_WINDOW:
            tl.store(WindowSums + out_ptr, tl.where(col_real, tl.reduce(win, 0, tl.standard._sum_combine), 0.0), mask=in_cols)


def compile_report(
    dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, blocks: Blocks = GPU_BLOCKS, window: bool = True,
    arch: int = 90,
) -> dict[str, dict[str, int]]:
    """Compile both kernels for an NVIDIA GPU of compute capability `arch` without one (Triton ships
    ptxas) and read each one's registers, stack (spilled bytes) and shared memory from the binary:
    catches what the interpreter lets through (it is far more permissive) and shows register pressure."""
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    precision = "ieee" if dtype == torch.float32 else "tf32"
    block_d = max(16, triton.next_power_of_2(head_dim))
    kernels = {
        "forward": (
            _attn_fwd, [f"*{ty}"] * 4 + ["*fp32", "*i32", "*fp32"] + ["i64"] * 16 + ["i32", "i32", "i32", "fp32", "fp32", "fp32"],
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=blocks.fwd_m, BLOCK_N=blocks.fwd_n, PRECISION=precision,
                 HAS_SOFTCAP=False, HAS_SINKS=False),
            blocks.fwd_warps,
        ),
        "column_sums": (
            _col_sums, [f"*{ty}"] * 2 + ["*fp32", "*i32", "*fp32", "*fp32"] + ["i64"] * 8 + ["i32", "i32", "i32", "fp32", "i32", "fp32", "fp32"],
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=blocks.sum_m, BLOCK_N=blocks.sum_n, HAS_WINDOW=window, PRECISION=precision,
                 HAS_SOFTCAP=False),
            blocks.sum_warps,
        ),
    }
    return {
        name: resource_usage(fn, types, constexprs, warps, blocks.stages, arch)
        for name, (fn, types, constexprs, warps) in kernels.items()
    }


def resource_usage(fn, types: list[str], constexprs: dict, warps: int, stages: int, arch: int = 90) -> dict[str, int]:
    """Compile the kernel function `fn` (argument types as Triton spells them, then its constexprs)
    for an NVIDIA GPU of compute capability `arch` without one, and read its registers, stack and
    shared memory from the binary."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", arch, 32)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    jitted = JITFunction(fn)  # not triton.jit: that gives an interpreter object under TRITON_INTERPRET
    signature = dict(zip(jitted.arg_names, types + ["constexpr"] * len(constexprs)))
    source = ASTSource(jitted, signature, constexprs={(jitted.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=target, options=dict(num_warps=warps, num_stages=stages))
    entry = {"shared_bytes": int(compiled.metadata.shared)}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found:
        entry.update(registers=int(found.group(1)), stack_bytes=int(found.group(2)))
    return entry


def reference_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor | None,
    scaling: float,
    heads: bool = False,
    window: int = 0,
) -> tuple[torch.Tensor, TritonScores]:
    """The same quantities by brute force in float64 (the full n x n map): for tests and checks on a GPU.
    A LogitScale `scaling` soft-caps the scores and appends its sink logits as a last column of each
    row's softmax, dropped after it (the models' own formulation)."""
    bsz, n_heads, n, head_dim = query.shape
    n_kv_heads = keys.shape[1]
    groups = n_heads // n_kv_heads
    starts = torch.zeros(bsz, dtype=torch.long) if starts is None else starts.cpu().long()
    q = query.double()
    k = keys.double().repeat_interleave(groups, dim=1)
    v = values.double().repeat_interleave(groups, dim=1)
    device = q.device
    starts = starts.to(device)
    idx = torch.arange(n, device=device)
    real = idx[None, :] >= starts[:, None]  # [B, n]
    allowed = real[:, None, :, None] & real[:, None, None, :] & (idx[None, :] <= idx[:, None])[None, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * float(scaling)
    cap = getattr(scaling, "softcap", None)
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sinks = getattr(scaling, "sinks", None)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded rows: all -inf -> NaN -> 0
    else:
        column = sinks.double().to(device).reshape(1, n_heads, 1, 1).expand(bsz, n_heads, n, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        probs = probs.masked_fill(~real[:, None, :, None], 0.0)  # padded rows see nothing
    out = torch.matmul(probs, v.masked_fill(~real[:, None, :, None], 0.0)).transpose(1, 2).contiguous()
    per_head = probs.sum(dim=2).view(bsz, n_kv_heads, groups, n)  # [B, Hkv, g, n]
    importance = per_head.sum(dim=(1, 2)) / n_heads
    head_sums = per_head.sum(dim=2) / groups if heads else None
    window_sums = None
    if window > 0:
        in_window = real & (idx[None, :] >= n - window)  # the last `window` rows (real rows end at n - 1)
        windowed = (probs * in_window[:, None, :, None]).sum(dim=2).view(bsz, n_kv_heads, groups, n)
        window_sums = windowed.sum(dim=2) / groups
    return out, TritonScores(importance, head_sums, window_sums)


def prefill_flops(bsz: int, n_heads: int, n: int, head_dim: int) -> tuple[float, float]:
    """Matmul FLOPs of the two kernels for an unpadded causal prompt (forward: q.k and p.v over half
    the map; column sums: q.k again), for turning a kernel's time into a throughput."""
    pairs = n * (n + 1) / 2
    forward = 4.0 * bsz * n_heads * pairs * head_dim
    return forward, forward / 2


__all__ = [
    "Blocks",
    "FP32_BLOCKS",
    "GPU_BLOCKS",
    "INTERPRETER_BLOCKS",
    "TritonScores",
    "attention_with_scores_triton",
    "available",
    "compile_report",
    "interpreting",
    "logit_terms",
    "prefill_flops",
    "reference_scores",
    "resource_usage",
    "wrapped",
]

