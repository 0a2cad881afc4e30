"""Per-head query statistics for Expected Attention, recorded over the calibration prompts.

One plain forward per batch (no cache, the last position's logits only) with a forward hook on
every compressing layer's pre-RoPE query (`models.queries.query_taps`): the real (unpadded) rows
add to a float64 sum and sum of outer products per head, from which the mean and the population
covariance follow. These are the prompt's queries: what the answer asks of the prompt is modelled
by what the prompt's own rows asked of it, as kvpress does from the prompt itself, here averaged
over every calibration prompt and stored once (`profiles.queries`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

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


def record_query_stats(
    model: Any, batches: Sequence[Batch], on_batch: Callable[[int], None] | None = None, future: int = FUTURE_POSITIONS
) -> QueryStats:
    """Mean and covariance of every compressing layer's pre-RoPE queries over `batches`' real rows."""
    layers = compressing_layers(model)
    taps = query_taps(model)
    sums: dict[int, torch.Tensor] = {}
    outer: dict[int, torch.Tensor] = {}
    count = 0
    current: dict[str, Any] = {}

    def hook(index: int):
        def record(module, args, output) -> None:
            valid = current["valid"]
            rows = taps[index].shape(output, valid.shape[1])[valid].double()  # [m, Hq, D]
            sums[index] = sums.get(index, 0) + rows.sum(dim=0)
            outer[index] = outer.get(index, 0) + torch.einsum("mhd,mhe->hde", rows, rows)

        return record

    handles = [taps[i].module.register_forward_hook(hook(i)) for i in layers]
    device = model.device
    try:
        with torch.inference_mode():
            for batch in batches:
                current["valid"] = batch.attention_mask.to(device).bool()
                extras = prompt_extras(model, batch)  # a vision-language prompt's pixels, as its prompt forward
                model(
                    input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                    position_ids=batch.position_ids.to(device), use_cache=False, logits_to_keep=1, **extras,
                )
                count += int(current["valid"].sum())
                if on_batch is not None:
                    on_batch(len(batch.rows))
    finally:
        for handle in handles:
            handle.remove()
    mean = torch.stack([sums[i] / count for i in layers])
    cov = torch.stack([outer[i] / count for i in layers]) - mean[..., :, None] * mean[..., None, :]
    return QueryStats(layers, mean.float(), cov.float(), count, future)
