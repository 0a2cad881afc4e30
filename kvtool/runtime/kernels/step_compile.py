"""kernels/triton_step.py's four kernels compiled for an NVIDIA GPU without one (Triton ships ptxas).

The interpreter the tests run the kernels in lets through what the compiler may refuse or spill:
`compile_report` compiles each kernel at a model's shape, over native entries or stored int8 / fp8
rows, and reads its registers, stack and shared memory from the binary (`triton_scores.resource_usage`).
"""

from __future__ import annotations

import torch

from kvtool.runtime.kernels import stored_loads, triton_scores, triton_step

try:
    import triton
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def compile_report(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, groups: int = 4, arch: int = 90,
                   formats: tuple[str, str] = triton_step.NATIVE) -> dict[str, dict[str, int]]:
    """The four kernels compiled for an NVIDIA GPU of compute capability `arch` without one, with
    their registers, stack and shared memory (`triton_scores.resource_usage`): what the interpreter
    lets through and the compiler does not shows up here. `formats`: the entries' storage."""
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    codes = stored_loads.format_codes(formats)
    kty, vty = (ty if code == 0 else "u8" for code in codes)
    widths = [stored_loads.row_width(code, head_dim) for code in codes]
    shape = dict(G=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)), HEAD_DIM=head_dim,
                 BLOCK_D=triton_step._block(head_dim), BLOCK_S=triton_step.BLOCK_S)
    stored = dict(KEY_FORMAT=codes[0], VALUE_FORMAT=codes[1])
    precision = "ieee" if dtype == torch.float32 else "tf32"
    kernels = {
        "partials": (triton_step._partials, [f"*{t}" for t in (ty, kty, vty)] + ["*i64"] + ["*fp32"] * 4 + ["i64"] * 11
                     + ["i32", "i32", "fp32", "i32", "i32", "fp32", "fp32"], dict(shape, PRECISION=precision, HAS_SOFTCAP=False, **stored)),
        "finish": (triton_step._finish, [f"*{t}" for t in (ty, kty, vty, ty)] + ["*fp32"] * 5 + ["*i64"] * 2 + ["*fp32"] + ["i64"] * 12
                   + ["i32", "fp32", "i32", "fp32", "fp32"],
                   {**{k: v for k, v in shape.items() if k != "BLOCK_S"}, "HAS_SOFTCAP": False, "HAS_SINKS": False, **stored}),
        "gains": (triton_step._gains, ["*fp32", "*fp32", "*i64", "*fp32"] + ["*i64"] * 4 + ["*fp32", "*i64"] + ["i64"] * 8 + ["i32"] * 4,
                  dict(G=shape["G"], BLOCK_G=shape["BLOCK_G"], BLOCK_S=triton_step.FINISH_BLOCK_S)),
        "place": (triton_step._place, [f"*{t}" for t in (kty, vty, kty, vty)] + ["*i64", "*fp32", "*u8", "*u8"] + ["*i64"] * 5
                  + ["*fp32", "*fp32", "*i64"] + ["i64"] * 27 + ["i32"] * 2,
                  dict(K_WIDTH=widths[0], BLOCK_KW=triton_step._block(widths[0]), V_WIDTH=widths[1], BLOCK_VW=triton_step._block(widths[1]), HAS_FROZEN=True)),
    }
    return {
        name: triton_scores.resource_usage(fn, types, constexprs, warps=4, stages=2, arch=arch)
        for name, (fn, types, constexprs) in kernels.items()
    }
