"""What one kept (token, head) vector costs in each storage format: the one byte count of the project.

A profile's budget is a share of the full cache's bytes; a layer that keeps `ratio` of its entries
in a format spends `ratio x share` of its full bytes, where `share` is the format's bytes per vector
over the model's own. The runtime's formats (`runtime/storage`) hold exactly these bytes (their
`bytes_per_entry` reads this table, and tests/test_storage_formats.py checks the tensors' real
size against it), so what calibration budgets is what the cache holds.

Per vector of D values at `native` bytes each (4 for float32, 2 for 16-bit models):
- native: D x native;
- int8, fp8: D codes and one float32 scale (vLLM's `int8_per_token_head`, `fp8_per_token_head`);
- int4: D / 2 packed codes and 4 bytes: a float32 scale with the zero point in its low bits;
- int4-g32, int2-g32: D x bits / 8 packed codes and, per group of 32, a scale and a zero point in
  the model's dtype (at most float32), as KIVI and quanto keep them.
"""

from __future__ import annotations

from kvtool.profiles.schema import KV_FORMATS, LayerProfile

GROUP = 32


def entry_bytes(name: str, head_dim: int, native: int) -> int:
    """Stored bytes of one key or value vector of `head_dim` values in format `name`."""
    if name == "native":
        return head_dim * native
    if name in ("int8", "fp8"):
        return head_dim + 4
    if name == "int4":
        return head_dim // 2 + 4
    if name in ("int4-g32", "int2-g32"):
        bits = 4 if name == "int4-g32" else 2
        return head_dim * bits // 8 + 2 * (head_dim // GROUP) * min(native, 4)
    raise ValueError(f"unknown storage format {name!r}; known: {', '.join(KV_FORMATS)}")


def entry_share(keys: str, values: str, head_dim: int, native: int) -> float:
    """A stored entry's bytes, key and value with their scales, over a native entry's."""
    return (entry_bytes(keys, head_dim, native) + entry_bytes(values, head_dim, native)) / (2 * head_dim * native)


def layer_share(layer: LayerProfile, head_dim: int, native: int) -> float:
    """The share of its full bytes a compressing layer spends: its kept ratio at its formats' cost."""
    return layer.ratio * entry_share(layer.keys_format, layer.values_format, head_dim, native)


def quantized(layer: LayerProfile) -> bool:
    return (layer.keys_format, layer.values_format) != ("native", "native")
