"""Per-head query statistics for Expected Attention and TriAttention, over the calibration prompts.

A forward hook on every compressing layer's pre-RoPE query (`models.queries.query_taps`) during
the prompt forwards: the real (unpadded) rows add to a float64 sum, sum of outer products and sum of
RoPE-pair norms per head, from which the mean, the population covariance and E|q_f| follow. A
calibration with a recipe search records them in its full pass's own prompt forwards and scores the
recorded prompts once they are known (`passes.full_pass`); otherwise one plain forward per batch
records them first. These are the prompt's queries: what the answer asks of the prompt is modelled
by what the prompt's own rows asked of it, as kvpress does from the prompt itself, here averaged
over every calibration prompt and stored once (`profiles.queries`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvtool.errors import KvtoolError
from kvtool.models.queries import query_taps
from kvtool.profiles.fingerprint import SLIDING_ATTENTION
from kvtool.profiles.queries import FUTURE_POSITIONS, QueryStats
from kvtool.runtime.steps import prompt_extras
from kvtool.scoring import Batch


def compressing_layers(model: Any) -> tuple[int, ...]:
    """The decoder layers a profile may compress by score (sliding-window layers never are)."""
    text = model.config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return tuple(i for i, kind in enumerate(types) if kind != SLIDING_ATTENTION)


class QueryRecorder:
    """Float64 sums of every compressing layer's pre-RoPE query rows over the prompt forwards it is
    told of (`prompt`), through forward hooks while `installed`; the rows of other forwards (a
    reference's decode steps) are not counted."""

    def __init__(self, model: Any):
        self.model = model
        self.layers = compressing_layers(model)
        self.taps = query_taps(model)
        self.sums: dict[int, torch.Tensor] = {}
        self.outer: dict[int, torch.Tensor] = {}
        self.pairs: dict[int, torch.Tensor] = {}
        self.count = 0
        self._valid: torch.Tensor | None = None

    def _hook(self, index: int):
        def record(module, args, output) -> None:
            if self._valid is None:
                return
            rows = self.taps[index].shape(output, self._valid.shape[1])[self._valid].double()  # [m, Hq, D]
            self.sums[index] = self.sums.get(index, 0) + rows.sum(dim=0)
            self.outer[index] = self.outer.get(index, 0) + torch.einsum("mhd,mhe->hde", rows, rows)
            half = rows.shape[-1] // 2
            pair = torch.hypot(rows[..., :half], rows[..., half:])  # [m, Hq, D/2]: RoPE turns i with i + D/2
            self.pairs[index] = self.pairs.get(index, 0) + pair.sum(dim=0)

        return record

    @contextmanager
    def installed(self) -> Iterator["QueryRecorder"]:
        handles = [self.taps[i].module.register_forward_hook(self._hook(i)) for i in self.layers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def prompt(self, attention_mask: torch.Tensor) -> Iterator[None]:
        """The forward inside is a prompt forward of rows `attention_mask` [B, n] (1: real token)."""
        self._valid = attention_mask.to(self.model.device).bool()
        try:
            yield
        finally:
            self.count += int(self._valid.sum())
            self._valid = None

    def stats(self, future: int = FUTURE_POSITIONS) -> QueryStats:
        """Each layer's mean, population covariance and mean pair norms over every real row recorded."""
        if not self.count:
            raise KvtoolError("internal: no prompt rows were recorded for the query statistics")
        mean = torch.stack([self.sums[i] / self.count for i in self.layers])
        cov = torch.stack([self.outer[i] / self.count for i in self.layers]) - mean[..., :, None] * mean[..., None, :]
        pairs = torch.stack([self.pairs[i] / self.count for i in self.layers])
        return QueryStats(self.layers, mean.float(), cov.float(), self.count, future, pairs.float())


def record_query_stats(
    model: Any, batches: Sequence[Batch], on_batch: Callable[[int], None] | None = None, future: int = FUTURE_POSITIONS
) -> QueryStats:
    """Mean and covariance of every compressing layer's pre-RoPE queries over `batches`' real rows,
    from plain forwards of their own (calibration's full pass records them in its prompt forwards
    instead, where it keeps the prompt states to score afterwards)."""
    recorder = QueryRecorder(model)
    device = model.device
    with recorder.installed(), torch.inference_mode():
        for batch in batches:
            extras = prompt_extras(model, batch)  # a vision-language prompt's pixels, as its prompt forward
            with recorder.prompt(batch.attention_mask):
                model(
                    input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                    position_ids=batch.position_ids.to(device), use_cache=False, logits_to_keep=1, **extras,
                )
            if on_batch is not None:
                on_batch(len(batch.rows))
    return recorder.stats(future)
