"""How a cache stores the key or value vectors of its entries: one small interface for every format.

A format turns a float tensor `[..., D]` (D = head dim, one vector per token and head) into a
`Stored` and back. `Stored` keeps every tensor with the same leading axes as the input, so a cache
can index, gather, scatter and grow entries along any leading axis without decoding them. Sizes
come from the tensors themselves (`Stored.nbytes`), because scales and zero points are stored bytes
too and an honest comparison at equal memory has to count them.

Axis numbers given to `Stored` count over the leading axes only: for entries `[batch, heads,
tokens, D]`, `dim=2` and `dim=-1` both mean the token axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvtool.profiles.entry_bytes import entry_bytes


@dataclass
class Stored:
    """The stored form of `[..., D]` vectors: a payload and optional per-vector or per-group parameters."""

    payload: Tensor              # [..., P]: codes (int8, packed uint8, float8) or the tensor itself
    scale: Tensor | None = None  # [..., S]: one scale per vector (S = 1) or per group
    zero: Tensor | None = None   # [..., S]: zero points of asymmetric formats

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.payload, self.scale, self.zero) if t is not None]

    def nbytes(self) -> int:
        """Every byte the tensors hold: payload, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def shape(self) -> torch.Size:
        """The leading axes (one vector each)."""
        return self.payload.shape[:-1]

    def _dim(self, dim: int) -> int:
        return dim + len(self.shape) if dim < 0 else dim

    def _map(self, fn: Any) -> Stored:
        return Stored(*(None if t is None else fn(t) for t in (self.payload, self.scale, self.zero)))

    def __getitem__(self, key: Any) -> Stored:
        # The trailing full slice keeps each tensor's last axis whole, whatever the key holds.
        key = (key if isinstance(key, tuple) else (key,)) + (slice(None),)
        return self._map(lambda t: t[key])

    def index_select(self, dim: int, index: Tensor) -> Stored:
        dim = self._dim(dim)
        return self._map(lambda t: t.index_select(dim, index))

    def put(self, dim: int, index: Tensor, other: Stored) -> Stored:
        """Overwrite, in place, the entries at `index` along `dim` with `other`'s (same format)."""
        dim = self._dim(dim)
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            _bytes(mine).index_copy_(dim, index, _bytes(theirs))
        return self

    def __setitem__(self, key: Any, other: Stored) -> None:
        key = (key if isinstance(key, tuple) else (key,)) + (slice(None),)
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            _bytes(mine)[key] = _bytes(theirs)

    @staticmethod
    def cat(items: list[Stored], dim: int) -> Stored:
        dim = items[0]._dim(dim)
        fields = [[getattr(s, name) for s in items] for name in ("payload", "scale", "zero")]
        return Stored(*(None if parts[0] is None else torch.cat(parts, dim) for parts in fields))

    def to(self, device: torch.device | str) -> Stored:
        return self._map(lambda t: t.to(device))


def _bytes(t: Tensor) -> Tensor:
    """float8 tensors as raw bytes: CPU torch lacks some in-place indexing kernels for float8."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


class StorageFormat:
    """One way of storing entries. Subclasses set `name` and `bits` and implement the three methods."""

    name: str = ""
    bits: int = 0  # bits per stored value, before scales and zero points
    # Whether an entry is exactly its codes (read as floats) times one float32 scale per vector, the
    # codes first in the row and the scale after them: then attention multiplies each slot's score by
    # its key's scale and its probability by its value's instead of decoding every entry
    # (`EntryStorage.read_scaled`, importance/decode.py).
    folds: bool = False

    def check(self, head_dim: int) -> None:
        """Refuse a head dim the format cannot store (a cache calls this when it builds a layer)."""

    def encode(self, x: Tensor) -> Stored:
        raise NotImplementedError

    def decode(self, stored: Stored, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def bytes_per_entry(self, head_dim: int, native_bytes: int) -> int:
        """Stored bytes per (token, head) vector, scales and zero points included: the project's one
        byte count (`profiles.entry_bytes`), which the encoded tensors' real size is tested against."""
        self.check(head_dim)
        return entry_bytes(self.name, head_dim, native_bytes)

    def __repr__(self) -> str:
        return f"<storage {self.name}>"


def divide(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale, with 0 where the scale is 0 (an all-zero vector or group), so no NaN reaches the codes."""
    return torch.where(scale > 0, x / scale, torch.zeros((), dtype=x.dtype, device=x.device))


def pack(codes: Tensor, bits: int) -> Tensor:
    """Unsigned codes `[..., D]` below 2**bits into bytes `[..., D * bits / 8]`; element i of each
    byte's run sits at bit i * bits (lowest first, as vLLM packs int4: even index in the low nibble)."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    runs = codes.to(torch.uint8).unflatten(-1, (codes.shape[-1] // per, per))
    return (runs << shifts).sum(-1, dtype=torch.uint8)  # the bit fields do not overlap: sum == or


def unpack(packed: Tensor, bits: int) -> Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)
