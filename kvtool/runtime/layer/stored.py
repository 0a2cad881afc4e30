"""How a compressing layer keeps its entries: the model's own tensors, or each entry's stored bytes.

A layer moves entries along the slot axis all the time (placing, evicting, growing, reordering
rows), and all of that code treats keys and values as [B, Hkv, S, W] tensors. So a quantized
layer keeps each (token, head) entry as one row of W bytes: the format's codes followed by its
scales and zero points (`runtime/storage`), which moves exactly like a native entry of width W.
Attention, and the rules that read keys, see the entries decoded (`read`): the scores come from
what attention reads. Native storage passes the tensors through untouched, so a native layer is
bit for bit what it was.

The prompt's own forward attends at full precision (the entries are stored once it is compressed);
every later step reads the stored entries, its own new token's included, as a serving engine
that writes the new token into its quantized cache before attending does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.runtime.storage import StorageFormat, Stored, storage_format


@dataclass(frozen=True)
class _Layout:
    """Where each of a format's tensors sits in an entry's byte row: (dtype, values, bytes) per part."""

    parts: tuple[tuple[torch.dtype, int, int], ...]

    @property
    def width(self) -> int:
        return sum(nbytes for _, _, nbytes in self.parts)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class EntryStorage:
    """The formats of one layer's keys and values (names in `runtime.storage.FORMATS`)."""

    def __init__(self, keys: str = "native", values: str = "native") -> None:
        self.keys_format: StorageFormat = storage_format(keys)
        self.values_format: StorageFormat = storage_format(values)
        self.quantized = keys != "native" or values != "native"
        self._layouts: dict[tuple[str, int, torch.dtype], _Layout] = {}

    @property
    def names(self) -> tuple[str, str]:
        return self.keys_format.name, self.values_format.name

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [..., D] in the layer's stored form ([..., W] bytes; native: the tensors themselves)."""
        if not self.quantized:
            return keys, values
        return self._encode(self.keys_format, keys), self._encode(self.values_format, values)

    def read(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored entries back as [..., D] tensors in `dtype` (native: unchanged)."""
        if not self.quantized:
            return keys, values
        return self._decode(self.keys_format, keys, dtype, head_dim), self._decode(self.values_format, values, dtype, head_dim)

    @property
    def folds(self) -> bool:
        """Keys and values both stored as codes times one scale per vector (`StorageFormat.folds`)."""
        return self.keys_format.folds and self.values_format.folds

    def read_scaled(
        self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, head_dim: int, acc: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stored entries of a folding storage as (key codes, key scales, value codes, value scales):
        codes [..., D] in `acc`, scales [...] float32; codes x scale is the entry `read` gives in
        float32. Attention multiplies scores and probabilities by the scales (importance/decode.py)."""
        return (*self._scaled(self.keys_format, keys, dtype, head_dim, acc),
                *self._scaled(self.values_format, values, dtype, head_dim, acc))

    def read_keys(self, keys: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        return keys if not self.quantized else self._decode(self.keys_format, keys, dtype, head_dim)

    def entry_bytes(self, head_dim: int, native_bytes: int) -> tuple[int, int]:
        """Stored bytes of one (token, head) key and value, scales and zero points included."""
        return (self.keys_format.bytes_per_entry(head_dim, native_bytes),
                self.values_format.bytes_per_entry(head_dim, native_bytes))

    def check(self, head_dim: int) -> None:
        self.keys_format.check(head_dim)
        self.values_format.check(head_dim)

    # ----- byte rows -------------------------------------------------------------------------

    def _layout(self, fmt: StorageFormat, head_dim: int, dtype: torch.dtype) -> _Layout:
        key = (fmt.name, head_dim, dtype)
        if key not in self._layouts:
            probe = fmt.encode(torch.ones(1, head_dim, dtype=dtype))
            self._layouts[key] = _Layout(tuple((t.dtype, t.shape[-1], t.shape[-1] * t.element_size()) for t in probe.tensors()))
        return self._layouts[key]

    def _encode(self, fmt: StorageFormat, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([_as_bytes(t) for t in fmt.encode(x).tensors()], dim=-1)

    def _decode(self, fmt: StorageFormat, rows: torch.Tensor, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        layout = self._layout(fmt, head_dim, dtype)
        parts, start = [], 0
        for part_dtype, _, nbytes in layout.parts:
            parts.append(_part(rows, start, nbytes, part_dtype))
            start += nbytes
        return fmt.decode(Stored(*parts), dtype)


    def _scaled(self, fmt: StorageFormat, rows: torch.Tensor, dtype: torch.dtype, head_dim: int, acc: torch.dtype):
        (code_dtype, _, code_bytes), (scale_dtype, _, scale_bytes) = self._layout(fmt, head_dim, dtype).parts
        # The whole row converted, its scale's bytes too (read as codes and never used): one pass over
        # contiguous bytes, which a CPU converts about three times as fast as the codes' strided columns.
        codes = rows.view(code_dtype).to(acc)[..., :head_dim]
        return codes, _part(rows, code_bytes, scale_bytes, scale_dtype)[..., 0]


def _part(rows: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [start, start + nbytes) of every row, as `dtype`. Decoding runs every decode step over
    every kept entry, so it reads the rows in place: the whole row reinterpreted as `dtype`, then
    sliced, with no copy. Copying a narrow byte slice out of each row first (the general way, kept
    for rows whose width or strides do not divide by the part's element size) cost as much as the
    full cache's attention on the CPU (9 ms against 0.25 ms per layer for 4 x 3 x 870 int8 entries)."""
    size = torch.empty((), dtype=dtype).element_size()
    aligned = (
        start % size == 0 and nbytes % size == 0 and rows.stride(-1) == 1
        and rows.storage_offset() % size == 0 and all(s % size == 0 for s in rows.stride()[:-1])
        and rows.shape[-1] % size == 0
    )
    if not aligned:
        return rows[..., start:start + nbytes].contiguous().view(dtype)
    if size == 1:
        return rows[..., start:start + nbytes].view(dtype)
    return rows.view(dtype)[..., start // size:(start + nbytes) // size]
