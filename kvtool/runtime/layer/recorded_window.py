"""A sliding-window layer of transformers that also keeps the prompt it was handed (calibration).

Calibration's full pass records the prompt once and builds every candidate's cache from that record
(`calibrate.truncation.compress_recorded_prompt`). transformers' sliding layer keeps only the last
window - 1 columns, but a window-shaped layer keeps its first tokens (sinks) too, so the record
keeps the whole prompt's keys and values: any window and sink count can then be cut from it, as the
prompt forward through that window's cache would have stored it (the prompt's attention itself is
the model's own window in both).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer


class RecordedWindowLayer(DynamicSlidingWindowLayer):
    """transformers' own sliding layer, entry for entry, plus `prompt`: the (keys, values) of the
    first forward it served, [B, H, n, D] each."""

    prompt: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def replacing(cls, layer: DynamicSlidingWindowLayer) -> "RecordedWindowLayer":
        if layer.is_initialized:
            raise ValueError("a sliding layer is recorded from its first forward on")
        recorded = cls.__new__(cls)
        recorded.__dict__.update(layer.__dict__)
        return recorded

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.prompt = (key_states, value_states)
        return super().update(key_states, value_states, *args, **kwargs)

    def native(self) -> DynamicSlidingWindowLayer:
        """A copy as transformers' own layer, without the prompt record."""
        plain = DynamicSlidingWindowLayer.__new__(DynamicSlidingWindowLayer)
        plain.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "prompt"}))
        return plain
