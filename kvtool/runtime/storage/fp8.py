"""float8 e4m3 with one scale per token and head: vLLM's `fp8_per_token_head`.

Per vector: scale = max|x| / 448 (448 is e4m3's largest finite value), payload = x / scale
rounded to e4m3 (nearest, ties to even) after clamping to [-448, 448], value = payload * scale.
The scale is float32, so an entry costs D + 4 bytes. e4m3 keeps 3 mantissa bits: the error is at
most 2**-4 of |x| for scaled values at or above 2**-6 and 2**-10 * scale below (subnormals).

vLLM does the same per (token, head) with a float32 scale floored at 1e-6 (the kernel shared with
`int8_per_token_head`, QUANT_MAX 448 for float8_e4m3fn; 240 on ROCm's e4m3fnuz, which this format
does not model). Here an all-zero vector keeps scale 0 and decodes to zeros. The clamp matters:
converting a value past 448 to e4m3fn gives NaN on some devices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtool.runtime.storage.base import StorageFormat, Stored, divide

E4M3_MAX = 448.0


class Fp8Format(StorageFormat):
    name = "fp8"
    bits = 8
    folds = True

    def encode(self, x: Tensor) -> Stored:
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / E4M3_MAX
        payload = divide(xf, scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return Stored(payload, scale)

    def decode(self, stored: Stored, dtype: torch.dtype) -> Tensor:
        return (stored.payload.float() * stored.scale).to(dtype)
