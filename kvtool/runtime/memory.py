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


def kv_bytes_by_type(cache: Any, layer_types: Any) -> dict[str, tuple[int, int]]:
    """Per layer type ("full_attention", "sliding_attention", ...): (bytes held, bytes a plain cache
    would hold), so a hybrid model's report shows where the memory went."""
    out: dict[str, tuple[int, int]] = {}
    for kind, layer in zip(layer_types, cache.layers):
        held, full = out.get(kind, (0, 0))
        out[kind] = (held + layer_bytes(layer), full + layer_full_bytes(layer))
    return out


# A prompt whose whole KV cache is below this share of the model's weights is left uncompressed:
# compression could save at most that share of the memory, and scoring and a draft would cost more
# time than the answer itself (`kvtool generate smollm2 "Name three colours." --max-new-tokens 24
# --budget 0.2`: compressed, that prompt took 38.3 s against 4.2 s and kept 41.5% of the cache; left
# whole under this share, `model.generate` takes 1.033 s against 1.008 s).
SHORT_PROMPT_SHARE = 0.01


def kv_bytes_per_token(model: Any) -> int:
    """Key and value bytes one token takes in every layer of `model`'s language model."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


def too_short_to_compress(model: Any, attention_mask: Any) -> bool:
    """True when even the longest row's full KV cache is under SHORT_PROMPT_SHARE of the weights' bytes."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    longest = int(attention_mask.sum(dim=1).max())
    return longest * kv_bytes_per_token(model) < SHORT_PROMPT_SHARE * weights
