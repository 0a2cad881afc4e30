"""The cache a draft's rows read in one forward: one `HeldLayer` per layer over its held prompt
(the layer and how it works: runtime/layer/held.py)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import DynamicCache

from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.layer.held_prompt import HeldPrompt
from kvtool.runtime.layer.held import HeldLayer


class HeldCache(DynamicCache):
    """One `HeldLayer` per layer (a draft needs every layer to be a kvtool layer); with `fill` (a fresh
    cache's `layers_to_fill`), the forward compresses each of them from its held prompt and the rows'
    attention."""

    def __init__(self, config, held: Sequence[HeldPrompt], fill: Sequence[CompressingLayer] | None = None):
        super().__init__(config=config)
        if len(self.layers) != len(held):
            raise ValueError(f"cache has {len(self.layers)} layers but {len(held)} held prompts were given")
        fill = [None] * len(held) if fill is None else fill
        self.layers = [HeldLayer(h, f) for h, f in zip(held, fill, strict=True)]
        for layer, following in zip(self.layers, self.layers[1:]):
            layer.following = following
        if self.layers:
            self.layers[0].fetch()
