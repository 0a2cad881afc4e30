"""A sliding-window layer of transformers that also keeps the prompt it was handed (calibration).

Calibration's full pass records the prompt once and builds every candidate's cache from that record
(`calibrate.truncation.compress_recorded_prompt`). transformers' sliding layer keeps only the last
window - 1 columns, but a window-shaped layer keeps its first tokens (sinks) too, so the record
keeps the whole prompt's keys and values: any window and sink count can then be cut from it, as the
prompt forward through that window's cache would have stored it (the prompt's attention itself is
the model's own window in both). It keeps the prompt's last query rows as well (`record_rows`), so
that a scored window's observation-window scores can be computed afterwards under the model's mask.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer



class RecordedWindowLayer(DynamicSlidingWindowLayer):
    """transformers' own sliding layer, entry for entry, plus `prompt`: the (keys, values) of the
    first forward it served, [B, H, n, D] each."""

    prompt: tuple[torch.Tensor, torch.Tensor] | None = None
    rows: torch.Tensor | None = None  # [B, Hq, R, D] the prompt forward's last R queries (after rotary)
    scaling: float | None = None
    ROWS = 32  # rows recorded: enough for any scored window's observation window (`plan.SCORED_WINDOW_ROWS`)

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

    def record_rows(self, query: torch.Tensor, scaling: float) -> None:
        """The prompt forward's last query rows (its attention calls this once, on the first forward)."""
        if self.rows is None:
            self.rows, self.scaling = query[:, :, -self.ROWS :].detach().clone(), scaling

    def native(self) -> DynamicSlidingWindowLayer:
        """A copy as transformers' own layer, without the prompt record."""
        plain = DynamicSlidingWindowLayer.__new__(DynamicSlidingWindowLayer)
        plain.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("prompt", "rows", "scaling")}))
        return plain
