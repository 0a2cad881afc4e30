"""Entries as the fused decode step's kernels read them: native, or from stored int8 / fp8 byte rows.

A quantized layer keeps each (token, head) entry as one uint8 row (layer/stored.py): for `int8` and
`fp8` the D codes, then the float32 scale's 4 bytes (little-endian, as torch lays them out). The
kernels of kernels/triton_step.py read such rows with `codes` and `scale`, whose product is the
entry `Int8Format.decode` / `Fp8Format.decode` give, bit for bit in float32 (the tests check every
code). The scale is four byte loads put together and bitcast, which asks no alignment of the row's
width or strides. The codes come out exact in any float dtype the kernels run in (int8's are
integers below 128; fp8's, moved bit by bit into a float16, are 2**-8 of their value, which `scale`
puts back), so `_partials` takes the dot products over the codes and multiplies each slot's score
and probability by its scale: q . (codes x scale) = (q . codes) x scale. Decoding the whole tile in
float32 before the dot products instead spilled registers on sm_90 (`step_compile`); the new
token's single row is decoded in full (`_finish`). Other formats are not read here (`format_codes`
answers None, and their layers take the eager fixed step).

The loads are device functions of two kernels. A kernel calls them as `JITFunction`s when compiled;
in Triton's interpreter (TRITON_INTERPRET=1, chosen per call by `triton_scores.wrapped`) the same
objects run their Python through the interpreter (`_DeviceFunction`).
"""

from __future__ import annotations

import torch

try:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - exercised only where triton is missing
    tl = None

# What the kernels' KEY_FORMAT / VALUE_FORMAT constexprs mean.
FORMATS = {"native": 0, "int8": 1, "fp8": 2}


def format_codes(names: tuple[str, str]) -> tuple[int, int] | None:
    """The kernels' format codes of a layer's (keys, values) storage, None where they read neither."""
    if names[0] not in FORMATS or names[1] not in FORMATS:
        return None
    return FORMATS[names[0]], FORMATS[names[1]]


def kernel_rows(tensors, formats: tuple[str, str], dtype: torch.dtype) -> list[torch.Tensor]:
    """A layer's (keys, values, key, value) as the kernels take them: stored rows as they are, but a
    quantized layer's native half, which it stores as its floats' bytes, as those floats."""
    return [t.view(dtype) if name == "native" and t.dtype == torch.uint8 else t for t, name in zip(tensors, tuple(formats) * 2)]


def row_width(fmt: int, head_dim: int) -> int:
    """Bytes (native: values) of one stored entry: D codes and a float32 scale for int8 and fp8."""
    return head_dim if fmt == 0 else head_dim + 4


if tl is not None:

    class _DeviceFunction(JITFunction):
        """A device function the compiler inlines as any `triton.jit` one, and that the interpreter,
        which calls it as Python, runs interpreted (`triton.jit` picks one of the two at import)."""

        def __call__(self, *args, **kwargs):
            interpreted = self.__dict__.get("_interpreted")
            if interpreted is None:
                interpreted = self.__dict__["_interpreted"] = InterpretedFunction(self.fn)
            return interpreted(*args, **kwargs)

    def _scale(at, sd, ok, FORMAT: tl.constexpr):
        """The float32 scale at byte pointers `at` (4 bytes `sd` apart, little-endian), times what
        `codes` leaves out of the code (fp8: 2**8); 0 where not `ok`. Native entries: 1."""
        if FORMAT == 0:
            scale = tl.full(at.shape, 1.0, tl.float32)
        else:
            b0 = tl.load(at, mask=ok, other=0).to(tl.uint32)
            b1 = tl.load(at + sd, mask=ok, other=0).to(tl.uint32)
            b2 = tl.load(at + 2 * sd, mask=ok, other=0).to(tl.uint32)
            b3 = tl.load(at + 3 * sd, mask=ok, other=0).to(tl.uint32)
            scale = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
            if FORMAT == 2:
                scale = scale * 256.0
        return scale

    def _codes(at, mask, FORMAT: tl.constexpr):
        """The entries' values at pointers `at` (masked ones read 0): native ones as stored; int8
        codes as int8; fp8 (e4m3fn) codes as float16 2**-8 of their value, exactly: the sign, exponent
        and mantissa bits moved into a float16's (5 exponent bits of bias 15 against 4 of bias 7: the
        same bits, subnormals included, mean 2**-8 as much; the format never stores its NaN)."""
        if FORMAT == 0:
            x = tl.load(at, mask=mask, other=0.0)
        else:
            stored = tl.load(at, mask=mask, other=0)
            if FORMAT == 1:
                x = stored.to(tl.int8, bitcast=True)
            else:
                b = stored.to(tl.uint16)
                x = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
        return x

    scale = _DeviceFunction(_scale)
    codes = _DeviceFunction(_codes)
