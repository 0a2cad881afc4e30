"""Low-bit integers, asymmetric, one scale and zero per group of G values along the head dim.

The layout KIVI and quanto use for values (`int4-g32`, and `int2-g32` for entries eviction would
otherwise drop): per group, zero = min, scale = (max - zero) / (2**bits - 1), code = round((x -
zero) / scale) in [0, 2**bits - 1], value = code * scale + zero; the error is at most scale / 2.
Codes pack 8 / bits per byte (D * bits / 8 bytes). Scale and zero are kept in the model's dtype,
as KIVI and quanto keep them (float32 for a float32 model), so an entry costs D * bits / 8 +
2 * (D / G) * native_bytes bytes. The zero (the group's minimum) is exact in that dtype; the scale
is rounded up into it rather than to nearest, so the group's maximum stays inside the coded range
and the scale / 2 bound holds exactly (KIVI rounds the fp16 scale to nearest, so its top value can
land a fraction of a step past the last code).

KIVI quantizes keys per channel (along tokens) and values per token; this format groups along the
head dim only, the per-token layout, for keys and values alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtool.runtime.storage.base import StorageFormat, Stored, divide, pack, unpack


def _rounded_up(v: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 `v` in `dtype`, rounded toward +inf instead of to nearest."""
    r = v.to(dtype)
    return torch.where(r.float() < v, torch.nextafter(r, torch.full_like(r, float("inf"))), r)


class GroupedIntFormat(StorageFormat):
    def __init__(self, bits: int, group: int) -> None:
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"grouped formats pack whole bytes: bits must be 1, 2, 4 or 8; got {bits}")
        self.bits, self.group = bits, group
        self.name = f"int{bits}-g{group}"

    def check(self, head_dim: int) -> None:
        if head_dim % self.group:
            raise ValueError(f"{self.name} needs a head dim divisible by its group of {self.group}; got D={head_dim}")

    def encode(self, x: Tensor) -> Stored:
        self.check(x.shape[-1])
        keep = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        groups = x.float().unflatten(-1, (-1, self.group))
        levels = 2**self.bits - 1
        zero = groups.amin(-1).to(keep)  # exact: the minimum is one of the values, held in `keep` or finer
        scale = _rounded_up((groups.amax(-1) - zero.float()) / levels, keep)
        codes = divide(groups - zero.float()[..., None], scale.float()[..., None]).round().clamp(0, levels)
        return Stored(pack(codes.flatten(-2), self.bits), scale, zero)

    def decode(self, stored: Stored, dtype: torch.dtype) -> Tensor:
        codes = unpack(stored.payload, self.bits).float().unflatten(-1, (-1, self.group))
        values = codes * stored.scale.float()[..., None] + stored.zero.float()[..., None]
        return values.flatten(-2).to(dtype)
