"""How many bytes a KV cache holds, and how many an uncompressed cache would hold for the same tokens.

Compressing layers report both numbers themselves (`physical_bytes()`, `full_bytes()`); any other
layer (plain DynamicLayer, sliding-window layers) stores the same tensors in either cache, so its
physical size counts for both.
"""

from __future__ import annotations

from typing import Any


def _tensor_bytes(tensor: Any) -> int:
    if tensor is None:
        return 0
    return tensor.numel() * tensor.element_size()


def layer_bytes(layer: Any) -> int:
    physical = getattr(layer, "physical_bytes", None)
    if callable(physical):
        return int(physical())
    return _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))


def layer_full_bytes(layer: Any) -> int:
    full = getattr(layer, "full_bytes", None)
    if callable(full):
        return int(full())
    return layer_bytes(layer)


def kv_bytes(cache: Any) -> int:
    """Bytes of key/value storage the cache holds now."""
    return sum(layer_bytes(layer) for layer in cache.layers)


def kv_bytes_full(cache: Any) -> int:
    """Bytes a plain transformers cache would hold for the same tokens."""
    return sum(layer_full_bytes(layer) for layer in cache.layers)
