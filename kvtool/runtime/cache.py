"""The cache container: transformers' DynamicCache with full-attention layers swapped for kvtool's.

Layers kvtool leaves to transformers keep transformers' own class: sliding-window layers that keep
their own window, Llama 4's chunked layers, and the fixed-size conv and recurrent state of
linear-attention and Mamba layers (Qwen3-Next, Jamba, Bamba, Granite 4, Nemotron-H), which a
prompt's tokens update in place rather than append to. A multi-head latent attention layer
(DeepSeek-V2/V3) becomes a LatentLayer (layer/latent.py), which holds the latents the model caches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvtool.errors import KvtoolError
from kvtool.runtime.layer import CompressingLayer, LayerPlan
from kvtool.profiles.fingerprint import FULL_ATTENTION, SLIDING_ATTENTION
from kvtool.runtime.layer.held_prompt import HeldPrompt
from kvtool.runtime.layer.kinds import transformers_layer
from kvtool.runtime.layer.latent import Expand, LatentLayer
from kvtool.runtime.layer.recorded_window import RecordedWindowLayer


class KvtoolCache(DynamicCache):
    """One CompressingLayer per planned layer; layers planned as None keep transformers' own class
    (a hybrid model's sliding-window layers that keep their own window). `expanders`: per layer index,
    the `expand_kv` of a latent-attention model's module there (`layer.latent.latent_expanders`)."""

    def __init__(self, config, plans: Sequence[LayerPlan | None], expanders: Mapping[int, Expand] | None = None):
        super().__init__(config=config)
        if len(self.layers) != len(plans):
            raise ValueError(f"cache has {len(self.layers)} layers but {len(plans)} layer plans were given")
        for i, plan in enumerate(plans):
            if plan is None:
                continue
            expected = transformers_layer(SLIDING_ATTENTION if plan.native_window is not None else FULL_ATTENTION)
            if type(self.layers[i]) is not expected:
                raise ValueError(f"layer {i} is a {type(self.layers[i]).__name__}, not the {expected.__name__} its plan is for")
            expand = (expanders or {}).get(i)
            self.layers[i] = CompressingLayer(plan) if expand is None else LatentLayer(plan, expand)
        self.image_mask: torch.Tensor | None = None  # [B, n] image-token positions of the prompt

    def record_sliding_prompts(self) -> None:
        """transformers' sliding layers keep the whole prompt they are handed too (calibration's
        record: `layer.recorded_window`)."""
        for i, layer in enumerate(self.layers):
            if type(layer) is DynamicSlidingWindowLayer:
                self.layers[i] = RecordedWindowLayer.replacing(layer)

    @property
    def awaiting_prompt(self) -> bool:
        """True until the first forward has filled the cache (read from the layers that hold keys:
        transformers' layers without attention count as filled from the start)."""
        return not any(layer.is_initialized for layer in self.layers if isinstance(layer, DynamicLayer))

    def set_image_mask(self, image_mask: torch.Tensor | None) -> None:
        """Which prompt positions are image tokens ([B, n] bool, False on padding); before the prompt.

        `attach` sets it from the input ids through a forward pre-hook on the model, so a plain
        `model.generate(**inputs, cache=cache)` (`past_key_values=cache`) needs nothing more. Every compressing layer
        hands it to its selection rule; the cache keeps it for inspection (`image_mask`).
        """
        self.image_mask = None if image_mask is None else image_mask.to(torch.bool)
        for layer in self.compressing_layers().values():
            layer.set_prompt_image(self.image_mask)

    def set_draft(self, tokens: int) -> None:
        """The next forward is the prompt followed by `tokens` draft rows, which score the prompt
        and are then dropped (`CompressingLayer.set_draft`); every layer must compress, since a plain
        layer would keep the draft. The draft itself reads a held prompt instead (`hold_prompt`);
        this one-forward form is the reference the tests check it against."""
        if tokens:
            self._need_every_layer("a draft")
        for layer in self.compressing_layers().values():
            layer.set_draft(tokens)

    def hold_prompt(self) -> None:
        """Every layer keeps its whole prompt aside when it compresses it (`take_held`): a draft's rows
        then read it in one forward of their own (runtime.draft, runtime.held)."""
        self._need_every_layer("a draft")
        for layer in self.layers:
            layer.hold_prompt()

    def take_held(self) -> list[HeldPrompt]:
        """The prompt each layer held (`hold_prompt`), handed over: the layers let go of it, and
        those whose prompt stayed in place compress it now that the forward's activations are gone."""
        held = []
        for layer in self.layers:
            if layer.held is None:
                raise KvtoolError("internal: no held prompt: call hold_prompt() before the prompt forward")
            held.append(layer.held)
            layer.held = None
            layer.compress_pending()
        return held

    def layers_to_fill(self, held: int, image_mask: torch.Tensor | None = None) -> list:
        """This fresh cache's layers, for a forward over `held` held prompts to compress each from its
        prompt with more rows' column sums (a draft's) added to its scores (`HeldLayer.read`): what
        one forward of the prompt and those rows would leave here."""
        self._need_every_layer("a draft")
        if held != len(self.layers):
            raise KvtoolError(f"internal: {held} held prompts for a cache of {len(self.layers)} layers")
        self.image_mask = image_mask
        return list(self.layers)

    def fix_slots(self, steps: int) -> None:
        """Every layer makes room for `steps` more tokens and keeps its counters on the device: a
        decode step then has one static shape and reads nothing back to the host, so a CUDA graph
        can replay it (layer/fixed.py, runtime.graphed). Until `release_slots`, steps feed one real
        token per row (no padding) and the rows keep their order."""
        self._need_every_layer("fixed slots")
        if self.awaiting_prompt:
            raise KvtoolError("fixed slots need the prompt forward first")
        for layer in self.layers:
            layer.fix_slots(steps)

    def release_slots(self) -> None:
        """Back to eager steps: the layers read their counters back from the device."""
        for layer in self.compressing_layers().values():
            layer.release_slots()

    def _need_every_layer(self, what: str) -> None:
        plain = [i for i, layer in enumerate(self.layers) if not isinstance(layer, CompressingLayer)]
        if plain:
            raise KvtoolError(
                f"{what} needs every layer to be a kvtool layer; layers {plain[:3]} keep transformers' own "
                "(sliding-window layers of hybrid models)"
            )

    def kept_image(self) -> dict[int, np.ndarray]:
        """Per compressing layer, the kept entries of each sequence that came from image tokens ([B])."""
        return {i: layer.kept_image for i, layer in self.compressing_layers().items()}

    # The cache's per-row state follows the batch like the layers do (beam search, contrastive search).
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_rows(lambda t: t.index_select(0, indices.to(t.device)))

    def _map_rows(self, fn) -> None:
        """The cache's own per-row state (the image mask) follows a reordered batch."""
        if self.image_mask is not None:
            self.image_mask = fn(self.image_mask)

    def compressing_layers(self) -> dict[int, CompressingLayer]:
        return {i: layer for i, layer in enumerate(self.layers) if isinstance(layer, CompressingLayer)}

    def set_truncation_distance(self, distance: int) -> None:
        """Use another D for the generation that follows (only between the prompt and the first new token)."""
        for layer in self.compressing_layers().values():
            layer.set_truncation_distance(distance)
