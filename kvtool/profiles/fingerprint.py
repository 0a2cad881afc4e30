"""The shape of a loaded model, recorded in a profile so it is never applied to another model."""

from __future__ import annotations

from typing import Any

from kvtool.errors import KvtoolError
from kvtool.profiles.schema import ModelFingerprint

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"


def fingerprint_of(model_or_config: Any, name: str | None = None) -> ModelFingerprint:
    """Fingerprint a transformers model or PretrainedConfig.

    Multimodal models are described by their text decoder, whose KV cache is what kvtool
    compresses. `name` defaults to the checkpoint path/id the config was loaded from.
    """
    config = _config_of(model_or_config)
    text = _text_config(config)
    num_layers = _required_int(text, "num_hidden_layers")
    num_heads = _required_int(text, "num_attention_heads")
    hidden_size = _required_int(text, "hidden_size")
    return ModelFingerprint(
        name=name or _checkpoint_name(config),
        model_type=str(getattr(config, "model_type", "") or getattr(text, "model_type", "") or "unknown"),
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=_optional_int(text, "num_key_value_heads") or num_heads,
        head_dim=_optional_int(text, "head_dim") or hidden_size // num_heads,
        hidden_size=hidden_size,
        vocab_size=_required_int(text, "vocab_size"),
        layer_types=_layer_types(text, num_layers),
        sliding_window=_optional_int(text, "sliding_window") if SLIDING_ATTENTION in _layer_types(text, num_layers) else None,
        attention_chunk_size=(
            _optional_int(text, "attention_chunk_size") if CHUNKED_ATTENTION in _layer_types(text, num_layers) else None
        ),
    )


def _config_of(model_or_config: Any) -> Any:
    # Imported lazily: `kvtool --help` and `kvtool inspect` should not pay for transformers.
    from transformers import PretrainedConfig

    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if isinstance(config, PretrainedConfig):
        return config
    raise KvtoolError(
        f"cannot fingerprint a {type(model_or_config).__name__}: expected a transformers model or config"
    )


def _text_config(config: Any) -> Any:
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if callable(get_text_config) else config


def _checkpoint_name(config: Any) -> str:
    for attr in ("name_or_path", "_name_or_path"):
        value = getattr(config, attr, None)
        if value:
            return str(value)
    return str(getattr(config, "model_type", "") or "unknown")


def _optional_int(config: Any, attr: str) -> int | None:
    value = getattr(config, attr, None)
    return None if value is None else int(value)


def _required_int(config: Any, attr: str) -> int:
    value = _optional_int(config, attr)
    if value is None:
        kind = getattr(config, "model_type", None) or type(config).__name__
        raise KvtoolError(
            f"model config ({kind}) has no {attr}; kvtool supports decoder-only transformer language models"
        )
    return value


def _layer_types(config: Any, num_layers: int) -> tuple[str, ...]:
    types = getattr(config, "layer_types", None)
    if types is None:
        # As transformers' cache infers them: a `sliding_window` (Mistral-style) or `attention_chunk_size`
        # on the config applies to every layer.
        if getattr(config, "sliding_window", None) is not None:
            return (SLIDING_ATTENTION,) * num_layers
        if getattr(config, "attention_chunk_size", None) is not None:
            return (CHUNKED_ATTENTION,) * num_layers
        return (FULL_ATTENTION,) * num_layers
    return tuple(str(t) for t in types)
