"""How many bytes a KV cache holds, and how many an uncompressed cache would hold for the same tokens.

Compressing layers report both numbers themselves (`physical_bytes()`, `full_bytes()`); any other
layer (plain DynamicLayer, sliding-window layers, Llama 4's chunked layers) stores the same tensors in
either cache, so its physical size counts for both.

What is counted is what grows with the prompt: the keys and values, at the widths the model caches
them (a multi-head latent attention layer's latent and rotary key, layer/latent.py). The conv and
recurrent state of linear-attention and Mamba layers (transformers' LinearAttentionLayer: Qwen3-Next,
Jamba, Bamba, Granite 4, Nemotron-H) has the same fixed size at any length and is the same in either
cache: it is in neither number, so a budget is a share of the bytes that grow (`fixed_state_bytes`
reports it apart).
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


def fixed_state_bytes(cache: Any) -> int:
    """Bytes of fixed-size conv and recurrent state (linear-attention and Mamba layers) the cache
    holds: outside `kv_bytes` and `kv_bytes_full`, the same in a compressed and a full cache."""
    total = 0
    for layer in cache.layers:
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            if isinstance(states, dict):
                total += sum(_tensor_bytes(t) for t in states.values())
    return total


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


# Layer types that keep no per-token keys and values (a fixed-size state, or no attention at all).
_NO_TOKEN_ENTRIES = ("linear_attention", "moe", "mlp")


def kv_bytes_per_token(model: Any) -> int:
    """Key and value bytes one token takes in every layer of `model`'s language model that keeps
    entries per token: a latent-attention layer's latent and rotary key (`kv_lora_rank` +
    `qk_rope_head_dim`, one head), any other attention layer's keys and values per KV head."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_layer = 2 * kv_heads * head_dim
    if getattr(config, "kv_lora_rank", None):
        per_layer = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    types = getattr(config, "layer_types", None) or ()
    layers = config.num_hidden_layers - sum(1 for kind in types if kind in _NO_TOKEN_ENTRIES)
    return max(1, layers) * per_layer * model.dtype.itemsize


def too_short_to_compress(model: Any, attention_mask: Any) -> bool:
    """True when even the longest row's full KV cache is under SHORT_PROMPT_SHARE of the weights' bytes."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    longest = int(attention_mask.sum(dim=1).max())
    return longest * kv_bytes_per_token(model) < SHORT_PROMPT_SHARE * weights
