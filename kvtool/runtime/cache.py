"""The cache container: transformers' DynamicCache with full-attention layers swapped for kvtool's."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtool.runtime.layer import CompressingLayer, LayerPlan


class KvtoolCache(DynamicCache):
    """One CompressingLayer per planned layer; layers planned as None keep transformers' own class
    (sliding-window layers of hybrid models such as Gemma 3 are left alone)."""

    def __init__(self, config, plans: Sequence[LayerPlan | None]):
        super().__init__(config=config)
        if len(self.layers) != len(plans):
            raise ValueError(f"cache has {len(self.layers)} layers but {len(plans)} layer plans were given")
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            if type(self.layers[i]) is not DynamicLayer:
                raise ValueError(f"layer {i} is a {type(self.layers[i]).__name__}; only full-attention layers compress")
            self.layers[i] = CompressingLayer(plan)

    def compressing_layers(self) -> dict[int, CompressingLayer]:
        return {i: layer for i, layer in enumerate(self.layers) if isinstance(layer, CompressingLayer)}

    def set_truncation_distance(self, distance: int) -> None:
        """Use another D for the generation that follows (only between the prompt and the first new token)."""
        for layer in self.compressing_layers().values():
            layer.set_truncation_distance(distance)
