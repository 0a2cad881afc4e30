"""The cache container: transformers' DynamicCache with full-attention layers swapped for kvtool's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtool.errors import KvtoolError
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
        self.image_mask: torch.Tensor | None = None  # [B, n] image-token positions of the prompt
        # A verified draft the rows are fed (`reuse_draft`): its tokens [B, top] while some row may
        # still follow it, else None.
        self._draft_tokens: np.ndarray | None = None
        self._draft_agreed = np.zeros(0, dtype=np.int64)  # [B] agreed draft tokens per row
        self._draft_following = np.zeros(0, dtype=bool)  # [B] rows fed their draft so far
        self._draft_step = 0  # forwards since `reuse_draft`

    @property
    def awaiting_prompt(self) -> bool:
        """True until the first forward has filled the cache."""
        return not any(layer.is_initialized for layer in self.layers)

    def set_image_mask(self, image_mask: torch.Tensor | None) -> None:
        """Which prompt positions are image tokens ([B, n] bool, False on padding); before the prompt.

        `attach` sets it from the input ids through a forward pre-hook on the model, so a plain
        `model.generate(**inputs, cache=cache)` (`past_key_values=cache`) needs nothing more. Every compressing layer
        hands it to its selection rule; the cache keeps it for inspection (`image_mask`).
        """
        self.image_mask = None if image_mask is None else image_mask.to(torch.bool)
        for layer in self.compressing_layers().values():
            layer.set_prompt_image(self.image_mask)

    def set_draft(self, tokens: int, keep: bool = False) -> None:
        """The next forward is the prompt followed by `tokens` draft rows, which score the prompt
        and are then dropped (`CompressingLayer.set_draft`; `keep`: their keys and values are held
        for `reuse_draft`); every layer must compress, since a plain layer would keep the draft."""
        plain = [i for i, layer in enumerate(self.layers) if not isinstance(layer, CompressingLayer)]
        if tokens and plain:
            raise KvtoolError(
                f"a draft needs every layer to be a kvtool layer; layers {plain[:3]} keep transformers' own "
                "(sliding-window layers of hybrid models cannot drop the draft)"
            )
        for layer in self.compressing_layers().values():
            layer.set_draft(tokens, keep)

    def reuse_draft(self, draft: torch.Tensor, agreed: np.ndarray) -> None:
        """Row b's first `agreed[b]` tokens of `draft` [B, k] are the full cache's own answer (a
        verified draft, right after the prompt forward that kept it: `set_draft(..., keep=True)`).
        While a row is fed exactly those tokens, each step stores the draft forward's keys and
        values for its token (computed with full attention over the whole prompt, as the full cache
        computes them) instead of the ones it computes through the compressed cache. Whoever feeds
        other tokens (a sampled answer, a teacher-forced reference) gets the usual ones from there on:
        `attach`'s hook hands every forward's tokens to `next_tokens`."""
        agreed = np.minimum(np.asarray(agreed, dtype=np.int64).reshape(-1), draft.shape[1])
        top = int(agreed.max(initial=0))
        self._draft_tokens = draft[:, :top].cpu().numpy() if top > 0 else None
        self._draft_agreed = agreed
        self._draft_following = np.ones(len(agreed), dtype=bool)
        self._draft_step = 0
        for layer in self.compressing_layers().values():
            layer.reuse_draft(agreed)

    @property
    def follows_draft(self) -> bool:
        """True while some row may still be fed its verified draft (`reuse_draft`)."""
        return self._draft_tokens is not None

    def next_tokens(self, input_ids: torch.Tensor | None) -> None:
        """The tokens the next forward feeds ([B, 1]): rows still on their verified draft take its
        keys and values this step; a row that leaves it never comes back."""
        t = self._draft_step
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 1:
            fed = input_ids[:, 0].cpu().numpy()
            take = self._draft_following & (t < self._draft_agreed) & (fed == self._draft_tokens[:, t])
        else:  # not one token per row: nothing here is the draft's
            take = np.zeros(len(self._draft_agreed), dtype=bool)
        self._draft_following = take
        self._draft_step = t + 1
        if not take.any() or t + 1 >= self._draft_tokens.shape[1]:
            self._draft_tokens = None
        for layer in self.compressing_layers().values():
            layer.take_draft(take)

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
        """The cache's own per-row state follows a reordered batch: the image mask is mapped, and a
        followed draft ends (the rows are no longer the ones it was verified for; the layers drop
        their held entries too)."""
        self._draft_tokens = None
        if self.image_mask is not None:
            self.image_mask = fn(self.image_mask)

    def compressing_layers(self) -> dict[int, CompressingLayer]:
        return {i: layer for i, layer in enumerate(self.layers) if isinstance(layer, CompressingLayer)}

    def set_truncation_distance(self, distance: int) -> None:
        """Use another D for the generation that follows (only between the prompt and the first new token)."""
        for layer in self.compressing_layers().values():
            layer.set_truncation_distance(distance)
