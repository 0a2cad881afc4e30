"""A cache over held prompts: one forward of a draft's rows reads every layer's whole prompt.

`KvtoolCache.hold_prompt` makes each layer keep its prompt's keys and values aside when it compresses
(`HeldPrompt`). A `HeldCache` built from them serves one forward of new rows (a draft's tokens): each
layer hands attention the held prompt with the rows' own keys and values appended (one layer at a
time, never stored), so the rows attend with full attention to the whole prompt and causally to each
other, exactly as they would have at the end of the prompt's own forward. The attention function
(attention.py) also sums the probabilities the rows give each column (`HeldLayer.scores`).
Nothing the prompt forward computed is computed again: that is the draft's whole cost saving.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtool.runtime.importance import PromptScores
from kvtool.runtime.layer.prompt import HeldPrompt


class HeldLayer(DynamicLayer):
    """One layer's held prompt, read by one forward of rows that follow it."""

    def __init__(self, held: HeldPrompt):
        super().__init__()
        self.lazy_initialization(held.keys, held.values)
        self.keys, self.values = held.keys, held.values
        self.scores: PromptScores | None = None  # the rows' column sums, set by the attention function

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # Not stored: the forward that reads the held prompt is its only one.
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class HeldCache(DynamicCache):
    """One `HeldLayer` per layer (a draft needs every layer to be a kvtool layer)."""

    def __init__(self, config, held: Sequence[HeldPrompt]):
        super().__init__(config=config)
        if len(self.layers) != len(held):
            raise ValueError(f"cache has {len(self.layers)} layers but {len(held)} held prompts were given")
        self.layers = [HeldLayer(h) for h in held]

    def row_scores(self) -> list[PromptScores]:
        """Per layer, the column sums the forward's rows gave (over the prompt's columns and theirs)."""
        return [layer.scores for layer in self.layers]
