"""KV-cache storage formats: how the key or value vector of each (token, head) entry is kept.

    fmt = FORMATS["int4-g32"]
    fmt.check(head_dim)                        # refuses a head dim the format cannot store
    stored = fmt.encode(keys)                  # keys: [..., head_dim] float
    keys_hat = fmt.decode(stored, keys.dtype)  # [..., head_dim]
    stored.nbytes() == fmt.bytes_per_entry(head_dim, keys.element_size()) * keys[..., 0].numel()

Formats: `native` (the model's dtype, unchanged), `int8` and `fp8` (one float32 scale per token and
head, as vLLM's `int8_per_token_head` and `fp8_per_token_head`), `int4` (asymmetric, one scale per
token and head, as vLLM's `int4_per_token_head` without its rotation), `int4-g32` and `int2-g32`
(asymmetric groups of 32 along the head dim, as KIVI and quanto store values). Each module's
docstring says where it differs from the engine it follows. `fp8` needs torch.float8_e4m3fn.
"""

from __future__ import annotations

import torch

from kvtool.runtime.storage.base import StorageFormat, Stored
from kvtool.runtime.storage.grouped import GroupedIntFormat
from kvtool.runtime.storage.int4 import Int4Format
from kvtool.runtime.storage.int8 import Int8Format
from kvtool.runtime.storage.native import NativeFormat

_ALL: list[StorageFormat] = [
    NativeFormat(), Int8Format(), Int4Format(), GroupedIntFormat(4, 32), GroupedIntFormat(2, 32),
]
if hasattr(torch, "float8_e4m3fn"):
    from kvtool.runtime.storage.fp8 import Fp8Format

    _ALL.insert(2, Fp8Format())

FORMATS: dict[str, StorageFormat] = {fmt.name: fmt for fmt in _ALL}


def storage_format(name: str) -> StorageFormat:
    """The registered format called `name`; an unknown name is refused with the known ones listed."""
    if name not in FORMATS:
        raise ValueError(f"unknown storage format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


__all__ = ["FORMATS", "GroupedIntFormat", "StorageFormat", "Stored", "storage_format"]
