"""A cache over held prompts: one forward of a draft's rows reads every layer's whole prompt.

`KvtoolCache.hold_prompt` makes each layer keep its prompt's keys and values aside when it compresses
(`HeldPrompt`). A `HeldCache` built from them serves one forward of new rows (a draft's tokens): each
layer hands attention the held prompt with the rows' own keys and values appended (one layer at a
time, never stored), so the rows attend with full attention to the whole prompt and causally to each
other, exactly as they would have at the end of the prompt's own forward. The attention function
(attention.py) also sums the probabilities the rows give each column (`HeldLayer.read`), and with
them the layer is compressed again into a fresh cache's layer (`fill`) while its whole prompt is at
hand: held in host memory (on a GPU), a layer's prompt comes back once per round.
Nothing the prompt forward computed is computed again: that is the draft's whole cost saving.

A latent-attention layer (layer/latent.py) holds latents, which its attention module expands into
per-head keys and values after `update` and before the attention function: the function sees the
expansion, so the fill layer is compressed from the latents `update` handed out instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import DynamicLayer

from kvtool.runtime.importance import PromptScores, with_rows
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.layer.held_prompt import HeldPrompt
from kvtool.runtime.layer.latent import LatentLayer


class HeldLayer(DynamicLayer):
    """One layer's held prompt, read by one forward of rows that follow it; with a `fill` layer, that
    layer is compressed from the held prompt once the rows' attention has joined its scores."""

    def __init__(self, held: HeldPrompt, fill: CompressingLayer | None = None):
        super().__init__()
        self.held, self.fill = held, fill
        self.following: HeldLayer | None = None  # the next layer, whose prompt comes back while this one computes
        self._fetched = None
        self._latents = None  # what `update` handed a latent-attention module (the prompt's latents first)
        self.lazy_initialization(held.keys, held.values)
        self.device = held.device  # the layer's: on a GPU the keys may be in host memory
        self.keys, self.values = held.keys, held.values  # their lengths are what transformers reads

    def fetch(self) -> None:
        """Start bringing this layer's prompt back from host memory (held_prompt.HeldPrompt.fetch)."""
        if self._fetched is None:
            self._fetched = self.held.fetch()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # Not stored: the forward that reads the held prompt is its only one.
        self.fetch()
        fetched, self._fetched = self._fetched, None
        if self.following is not None:
            self.following.fetch()  # queued behind this layer's copy back, run while this layer computes
        out = self.held.followed_by(key_states, value_states, fetched)
        if isinstance(self.fill, LatentLayer):
            self._latents = out
        return out

    def read(self, scores: PromptScores, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The attention function's column sums of the rows over `keys` / `values` (the held prompt
        and the rows, on the device, as `update` gave them): they compress the `fill` layer."""
        if self.fill is not None:
            n = self.held.length
            if self._latents is not None:  # attention read their expansion; the layer stores the latents
                (keys, values), self._latents = self._latents, None
            here = replace(self.held, keys=keys[:, :, :n], values=values[:, :, :n], copied=None)
            self.fill.compress_held(here, with_rows(self.held.scores, scores))
