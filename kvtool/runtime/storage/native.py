"""Entries kept in the model's own dtype: the baseline every other format is measured against.

`encode` keeps the tensor itself (no copy) and `decode` hands it back unchanged, bit for bit,
negative zeros and NaNs included; it converts only when asked for another dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtool.runtime.storage.base import StorageFormat, Stored


class NativeFormat(StorageFormat):
    name = "native"
    bits = 16  # nominal: the real width is the model's dtype, which `bytes_per_entry` is given

    def encode(self, x: Tensor) -> Stored:
        return Stored(x)

    def decode(self, stored: Stored, dtype: torch.dtype) -> Tensor:
        return stored.payload if stored.payload.dtype == dtype else stored.payload.to(dtype)
