"""The kernels alone, for benchmarks/gpu_bench.py: the prompt kernels (f) and the decode attention with scores (h).

`kernel_check` times one layer's prompt kernels (kvtool.runtime.kernels.triton_scores) against torch's
SDPA and checks them against a float64 brute force (on a CPU through Triton's interpreter);
`block_sweep` times tile choices; `decode_attention_check` times one layer's decode attention with
scores in the model's dtype against float32 copies (`RuntimeSettings.mixed_precision_decode`).
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # the gpu_* modules beside this one (not a package)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import device_time, is_oom, log, release  # noqa: E402

from kvtool.runtime import use_settings  # noqa: E402


def kernel_check(
    model, shapes: list[tuple[int, int]], device: torch.device, check_tokens: int = 1024, repeats: int = 10,
    sweep: bool = False,
) -> dict[str, Any]:
    """One layer's prompt kernels at the model's head shape: exactness at `check_tokens` tokens (one
    row, 100 of them padding) against the float64 brute force, then the time of each cell against
    torch's causal SDPA on the same q/k/v. On a CPU (TRITON_INTERPRET=1) it only tries the code."""
    from kvtool.runtime.kernels import triton_scores as ts

    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // n_heads
    dtype = next(model.parameters()).dtype
    report: dict[str, Any] = {"available": ts.available(torch.zeros(1, device=device, dtype=dtype))}
    if not report["available"]:
        return report
    import triton

    report["triton"] = triton.__version__
    g = torch.Generator(device=device).manual_seed(3)

    def qkv(bsz, n):
        make = lambda h: torch.randn(bsz, h, n, head_dim, generator=g, device=device, dtype=dtype)  # noqa: E731
        return make(n_heads), make(n_kv), make(n_kv)

    q, k, v = qkv(1, check_tokens)
    starts = torch.tensor([min(100, check_tokens // 4)], device=device)
    out, scores = ts.attention_with_scores_triton(q, k, v, starts, head_dim**-0.5, heads=True, window=32, forward="triton")
    ref_out, ref = ts.reference_scores(q, k, v, starts, head_dim**-0.5, heads=True, window=32)
    report["exactness"] = {
        "tokens": check_tokens,
        "output_max_abs": (out.double() - ref_out).abs().max().item(),
        **{f"{name}_max_rel": ((getattr(scores, name).double() - getattr(ref, name)).abs().max() / getattr(ref, name).abs().max()).item()
           for name in ("importance", "heads", "window")},
    }
    # The fused forward (kernels/fused_forward.py) takes no padding: checked on an unpadded row.
    out, scores = ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, forward="sdpa")
    ref_out, ref = ts.reference_scores(q, k, v, None, head_dim**-0.5, heads=True, window=32)
    report["exactness_sdpa_forward"] = {
        "tokens": check_tokens,
        "output_max_abs": (out.double() - ref_out).abs().max().item(),
        **{f"{name}_max_rel": ((getattr(scores, name).double() - getattr(ref, name)).abs().max() / getattr(ref, name).abs().max()).item()
           for name in ("importance", "heads", "window")},
    }
    del q, k, v, out, scores, ref_out, ref
    from kvtool.runtime.kernels import fused_forward

    timings = {}
    for tokens, batch in shapes:
        try:
            q, k, v = qkv(batch, tokens)
            # What transformers' sdpa_attention_forward runs: K/V repeated per query head (outside the timing).
            k_rep, v_rep = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))
            runs = {
                "sdpa causal (K/V repeated)": lambda: torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True),
                "triton fwd + column sums (heads, window 32)": lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, forward="triton"),
                "triton fwd + column sums (importance only)": lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, forward="triton"),
                SDPA_FWD_SUMS: lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, forward="sdpa"),
                SDPA_FWD_ALONE: lambda: fused_forward.forward_with_lse(q, k, v, head_dim**-0.5),
            }
            cell = {name: device_time(fn, device, repeats) for name, fn in runs.items()}
            base = cell["sdpa causal (K/V repeated)"]
            cell["ratio_to_sdpa"] = {name: s / base for name, s in cell.items() if isinstance(s, float) and name != "sdpa causal (K/V repeated)"}
            fwd_flops, sum_flops = ts.prefill_flops(batch, n_heads, tokens, head_dim)
            cell["sdpa_tflops"] = fwd_flops / base / 1e12
            timings[f"{tokens}x{batch}"] = cell
            del q, k, v, k_rep, v_rep
        except Exception as error:  # noqa: BLE001
            timings[f"{tokens}x{batch}"] = {"error": "out of memory" if is_oom(error) else traceback.format_exc(limit=4)}
        release(device)
    report["one_layer_s"] = timings
    if sweep:
        report["sweep"] = block_sweep(qkv, shapes[0], head_dim, device)
    return report


# The fused-forward cells of (f): torch's fused forward (`triton_scores.FORWARD`'s default) against the Triton one.
SDPA_FWD_SUMS = "sdpa fwd with log-sum-exp + column sums (heads, window 32)"
SDPA_FWD_ALONE = "sdpa fwd with log-sum-exp alone"

# Tile choices `--kernel-sweep` times (fwd_m, fwd_n, warps) and (sum_m, sum_n, warps), 3 stages.
FWD_CHOICES = ((64, 64, 4), (128, 64, 8), (64, 32, 4), (64, 64, 8), (128, 64, 4))
SUM_CHOICES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (64, 128, 8), (64, 32, 4))


def block_sweep(qkv, shape: tuple[int, int], head_dim: int, device: torch.device) -> dict[str, Any]:
    """Both kernels' time (heads and a 32-row window requested) for each forward tile with the
    default column-sum tile, then each column-sum tile with the fastest forward tile: the numbers to
    set `triton_scores.GPU_BLOCKS` from."""
    from kvtool.runtime.kernels import triton_scores as ts

    tokens, batch = shape
    q, k, v = qkv(batch, tokens)
    default = ts.GPU_BLOCKS

    def timed(base: "ts.Blocks", **tiles: int) -> float | str:
        try:
            blocks = dataclasses.replace(base, **tiles)
            return device_time(lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, blocks=blocks, forward="triton"), device, 5)
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory for a tile
            return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"

    fwd = {f"{m}x{n}/{w}": timed(default, fwd_m=m, fwd_n=n, fwd_warps=w) for m, n, w in FWD_CHOICES}
    ok = {key: t for key, t in fwd.items() if isinstance(t, float)}
    best = FWD_CHOICES[list(fwd).index(min(ok, key=ok.get))] if ok else FWD_CHOICES[0]
    base = dataclasses.replace(default, fwd_m=best[0], fwd_n=best[1], fwd_warps=best[2])
    sums = {f"{m}x{n}/{w}": timed(base, sum_m=m, sum_n=n, sum_warps=w) for m, n, w in SUM_CHOICES}
    log(f"kernel sweep at {tokens}x{batch}: forward {fwd}; column sums {sums}")
    return {"shape": f"{tokens}x{batch}", "forward_tiles_s": fwd, "column_sum_tiles_s": sums, "default": dataclasses.asdict(default)}


def decode_attention_check(model, shapes: list[tuple[int, int]], budget: float, device: torch.device) -> dict[str, Any]:
    """One layer's decode attention with scores (`decode_attention_with_scores`) over a kvtool layer's
    slots at each shape (budget * prompt tokens, whole chunks): the path the model's dtype takes on
    this device against the float32 copies it replaced, timed, and both against float64."""
    from kvtool.runtime.importance import decode as decode_module

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    report: dict[str, Any] = {"mixed_bmm": decode_module.HAS_MIXED_BMM, "shapes": {}}
    generator = torch.Generator(device="cpu").manual_seed(3)
    for tokens, batch in shapes:
        slots = -(-int(budget * tokens) // decode_module.SLOT_CHUNK) * decode_module.SLOT_CHUNK
        q = torch.randn(batch, heads, 1, head_dim, generator=generator).to(device, dtype)
        k = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(device, dtype)
        v = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(device, dtype)
        mask = (torch.rand(batch, 1, 1, slots, generator=generator) > 0.05).to(device)
        scale = head_dim ** -0.5
        ref_out, ref_probs = decode_module.decode_attention_with_scores(q.double(), k.double(), v.double(), mask, scale, per_head=True)
        entry: dict[str, Any] = {"slots": slots}

        def run():
            return decode_module.decode_attention_with_scores(q, k, v, mask, scale, per_head=True)

        for name, mixed in (("model dtype (mixed products, chunked values)", True), ("float32 copies", False)):
            with use_settings(mixed_precision_decode=mixed):
                out, probs = run()
                entry[name] = {
                    "ms": device_time(run, device, repeats=20) * 1e3,
                    "output_max_abs": float((out.double() - ref_out).abs().max()),
                    "probs_max_abs": float((probs.double() - ref_probs).abs().max()),
                }
        report["shapes"][f"{tokens}x{batch}"] = entry
    return report
