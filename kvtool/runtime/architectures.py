"""Architectures whose attention kvtool cannot take over, whatever their layer types say.

kvtool's attention reaches a layer's cache through transformers' AttentionInterface and the keyword
arguments a model's forward passes down to it (attention.py). A model whose attention modules never
call the interface, an encoder-decoder model, or one whose layers drop those keyword arguments would
leave kvtool's cache uncompressed and fail at its first new token; a few compute an attention that is
not one softmax over the cached keys. `refusal` names the reason in one line, so `attach` refuses
before generation (tests/test_auto_families.py walks every auto-mapped architecture against it).
"""

from __future__ import annotations

import sys

import torch

DROPS_KWARGS = "its decoder layers do not pass the forward's keyword arguments on to the attention, through which kvtool's attention finds its cache"

# By model type: architectures that route through the interface but compute something else there,
# or lose the arguments on the way (each found by the walk of tests/test_auto_families.py).
UNSUPPORTED: dict[str, str] = {
    "diffllama": "differential attention (the difference of two softmax maps) is not kvtool's attention",
    "doge": "its dynamic float attention mask is not read by kvtool's cache layers",
    "jetmoe": "mixture-of-attention heads (experts choose each token's query heads) are not supported",
    "stablelm": DROPS_KWARGS,
    "git": DROPS_KWARGS,
    "kosmos-2": DROPS_KWARGS,
    "evolla": DROPS_KWARGS,
}


def refusal(model) -> str | None:
    """Why kvtool cannot attach to `model` (one line, naming its type), or None."""
    config = model.config
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type}: encoder-decoder models are not supported (kvtool compresses a decoder-only model's self-attention cache)"
    for name in (model_type, config.get_text_config(decoder=True).model_type):
        if name in UNSUPPORTED:
            return f"{name}: {UNSUPPORTED[name]}"
    attention = [module for module in model.modules() if isinstance(getattr(module, "layer_idx", None), int)]
    inline = sorted({type(module).__name__ for module in attention if not _calls_the_interface(module)})
    if not attention or inline:
        named = f" ({', '.join(inline[:3])})" if inline else ""
        return (f"{model_type}: its attention{named} does not go through transformers' AttentionInterface, "
                "so kvtool cannot compute it")
    return None


def _calls_the_interface(module: torch.nn.Module) -> bool:
    """Whether the module's class is defined where transformers' attention functions are dispatched
    from (its modeling file imports ALL_ATTENTION_FUNCTIONS): attention written inline is not."""
    defined_in = sys.modules.get(type(module).__module__)
    return defined_in is not None and "ALL_ATTENTION_FUNCTIONS" in vars(defined_in)
