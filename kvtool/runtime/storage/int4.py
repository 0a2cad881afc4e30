"""4-bit integers, asymmetric, one scale and zero point per token and head: vLLM's `int4_per_token_head`.

Per vector: lo = min(min x, 0), hi = max(max x, 0), scale = (hi - lo) / 15, zero point zp =
round(-lo / scale) in [0, 15], code = round(x / scale + zp) clamped to [0, 15], value = (code - zp)
* scale; the error is at most scale / 2. Codes pack two per byte, even index in the low nibble,
so the payload is D / 2 bytes. As in vLLM the zero point rides in the low 4 mantissa bits of the
float32 scale, so the entry costs D / 2 + 4 bytes and `Stored.zero` stays empty. The scale is
rounded up to a multiple of 16 units in its last place before the zero point goes in, which keeps
the range covered (vLLM truncates those bits instead; either way the scale moves by under 2**-19).

vLLM (v1 Triton backend, `vllm/v1/attention/ops/int4_per_token_head.py`, docs.vllm.ai) uses
min and max of the vector itself, with no widening to include 0, and floors the scale at 1e-6.
Its zero point is clamped to [0, 15], so a vector of one sign (min > 0 or max < 0) loses its
offset there; widening the range to include 0 gives the same codes (up to the scale's last bits)
whenever the vector has both signs and keeps one-signed vectors within scale / 2. vLLM also rotates K, V and Q by a randomized
Hadamard transform before quantizing (and the attention output back), which spreads outliers over
the vector; that rotation belongs to the attention path, not to storage, and is not done here, so
on keys with outlier channels this format likely errs more than vLLM's (not measured here). Ties
round half up, as vLLM's kernel does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtool.runtime.storage.base import StorageFormat, Stored, divide, pack, unpack


class Int4Format(StorageFormat):
    name = "int4"
    bits = 4

    def check(self, head_dim: int) -> None:
        if head_dim % 2:
            raise ValueError(f"int4 packs two values per byte, so it needs an even head dim; got D={head_dim}")

    def encode(self, x: Tensor) -> Stored:
        self.check(x.shape[-1])
        xf = x.float()
        lo = xf.amin(-1, keepdim=True).clamp(max=0)
        hi = xf.amax(-1, keepdim=True).clamp(min=0)
        bits = ((hi - lo) / 15).view(torch.int32)
        bits = (bits + 15) & -16  # round up, clearing the 4 bits the zero point will use
        scale = bits.view(torch.float32)
        zp = (divide(-lo, scale) + 0.5).floor().clamp(0, 15)
        codes = (divide(xf, scale) + zp + 0.5).floor().clamp(0, 15)
        return Stored(pack(codes, 4), (bits | zp.to(torch.int32)).view(torch.float32))

    @staticmethod
    def scale_and_zero(stored: Stored) -> tuple[Tensor, Tensor]:
        """The float32 scale and the zero point that share the stored scale's bits."""
        bits = stored.scale.view(torch.int32)
        return (bits & -16).view(torch.float32), (bits & 15).float()

    def decode(self, stored: Stored, dtype: torch.dtype) -> Tensor:
        scale, zp = self.scale_and_zero(stored)
        return ((unpack(stored.payload, 4).float() - zp) * scale).to(dtype)
