"""8-bit integers, symmetric, one scale per token and head: vLLM's `int8_per_token_head`.

Per vector: scale = max|x| / 127, code = round(x / scale) clamped to [-127, 127], value = code *
scale. The scale is stored as float32 (4 bytes per vector), as vLLM stores it, so an entry costs
D + 4 bytes.

vLLM (v1 Triton backend, `triton_reshape_and_cache_flash_per_token_head_quant`, docs.vllm.ai
`vllm/v1/attention/ops/triton_reshape_and_cache_flash`) computes the same float32 scale per
(token, head) but floors it at 1e-6 and stores x / scale into int8 without an explicit round, so
the Triton float-to-int conversion truncates toward zero (its tests say so). Here codes round to
nearest, which halves the worst-case error (scale / 2 instead of scale) at the same bytes, and an
all-zero vector keeps scale 0 (it decodes to zeros either way). vLLM keeps the scales beside the
codes in the page; where they live does not change the count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtool.runtime.storage.base import StorageFormat, Stored, divide


class Int8Format(StorageFormat):
    name = "int8"
    bits = 8
    folds = True

    def encode(self, x: Tensor) -> Stored:
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / 127
        codes = divide(xf, scale).round().clamp(-127, 127).to(torch.int8)
        return Stored(codes, scale)

    def decode(self, stored: Stored, dtype: torch.dtype) -> Tensor:
        # One multiply that reads the codes as they lie (the int8 columns of a byte row, strided): type
        # promotion converts each code as it multiplies, the same float32 product as `.float()` then the
        # multiply, without `.float()`'s copy of a strided view, which on a CPU took 20x as long (13 ms
        # against 0.7 ms for 4 x 3 x 1630 entries of head dim 64).
        return (stored.payload * stored.scale).to(dtype)
