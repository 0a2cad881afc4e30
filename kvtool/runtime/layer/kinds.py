"""The kinds of decoder layer kvtool stores, by the name a model's config gives them.

A model's `layer_types` (or its `sliding_window` on every layer) says what each decoder layer's
attention is; transformers' DynamicCache then holds one cache layer of a matching class for it.
kvtool swaps that layer for its own only where it knows what attention the model computes there.
A layer type missing here is refused by `attach` in one line, naming it.

Adding a layer kind: one file in this package with its layer class (transformers' cache-layer
interface: `update`, `get_seq_length`, `get_mask_sizes`, ...), one line in LAYER_KINDS, and the
tests every kind passes (docs/methods.md, "How to add a layer kind").
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from kvtool.profiles.fingerprint import FULL_ATTENTION, SLIDING_ATTENTION


@dataclass(frozen=True)
class LayerKind:
    """One layer type: the transformers cache layer that holds it, and what kvtool does with it."""

    layer_type: str
    transformers_layer: type
    stored_as: str  # what kvtool keeps of such a layer, in words (refusals and `inspect` name it)


LAYER_KINDS: dict[str, LayerKind] = {
    kind.layer_type: kind
    for kind in (
        LayerKind(FULL_ATTENTION, DynamicLayer, "its share of the entries, by the profile's rules (CompressingLayer)"),
        LayerKind(SLIDING_ATTENTION, DynamicSlidingWindowLayer,
                  "its own window, a shorter one, or the scored entries of its window (CompressingLayer)"),
        LayerKind("chunked_attention", DynamicSlidingWindowLayer,
                  "transformers' own layer: its chunk's entries, at most chunk - 1 (Llama 4)"),
        LayerKind("linear_attention", LinearAttentionLayer,
                  "transformers' own fixed-size conv and recurrent state, outside the budget (Qwen3-Next, Mamba hybrids)"),
        LayerKind("moe", DummyLayer, "nothing: a layer without attention (Nemotron-H)"),
        LayerKind("mlp", DummyLayer, "nothing: a layer without attention (Nemotron-H)"),
    )
}


def transformers_layer(layer_type: str) -> type:
    """The cache-layer class transformers holds for `layer_type` (a KeyError for an unknown one)."""
    return LAYER_KINDS[layer_type].transformers_layer
