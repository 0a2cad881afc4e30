"""Encoded prompts in left-padded batches, grouped by length.

Positions follow `generate`: each row counts its own real tokens (cumsum of the attention mask), so
a padded row sees the same positions as it would alone, and the per-token steps that follow
continue from there.

Prompts with images (vision-language models) carry the processor's other outputs: per-token ones
([1, n], e.g. Gemma 3's `token_type_ids`) are left-padded with zeros like the ids; the pixel inputs
(`pixel_values`, `image_sizes`, `image_grid_thw`, ...) are concatenated in row order, the order in
which the model fills the image tokens of the flattened batch.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtool.data import Record
from kvtool.profiles import MethodSettings
from kvtool.runtime.steps import Prompt
from kvtool.scoring.encoding import Encoded, encode_answers, encode_samples


@dataclass(frozen=True)
class Batch(Prompt):
    """Left-padded prompts (`runtime.steps.Prompt`); `rows` are the positions of these prompts in the sample list."""

    rows: tuple[int, ...] = field(kw_only=True)

    def repeated(self, times: int) -> "Batch":
        """The same prompts `times` times over, block after block, for decoding several caches of
        them side by side (`runtime.grouped`): the prompt-only inputs (`extras`) are left out."""
        return Batch(
            rows=self.rows * times,
            input_ids=self.input_ids.repeat(times, 1),
            attention_mask=self.attention_mask.repeat(times, 1),
            # Multimodal rotary positions are [3, B, W]: the batch is the second-last dimension.
            position_ids=torch.cat([self.position_ids] * times, dim=-2),
            position_offset=None if self.position_offset is None else self.position_offset.repeat(times, 1),
        )


def make_batches(encoded: Sequence[list[int] | Encoded], batch_size: int, pad_id: int, model: Any = None) -> list[Batch]:
    """Group prompts by length (less padding) into left-padded batches of at most `batch_size`.

    With `model`, batches with images get the positions that model gives them (`model_positions`).
    """
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    batches = []
    for start in range(0, len(order), batch_size):
        rows = tuple(order[start : start + batch_size])
        batch = left_pad([encoded[i] for i in rows], rows, pad_id)
        batches.append(batch if model is None else model_positions(model, batch))
    return batches


def model_positions(model: Any, batch: Batch) -> Batch:
    """The batch with the positions a multimodal-rope model (Qwen2-VL) gives image prompts.

    Such a model numbers an image block by its patch grid (3 position axes), so text after an image
    sits at fewer positions than tokens; its own `get_rope_index` computes them (padding ignored),
    with the per-row delta that new tokens add. Other models and text batches are returned as given.
    """
    rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
    if rope_index is None or not any(key in batch.extras for key in ("image_grid_thw", "video_grid_thw")):
        return batch
    accepted = inspect.signature(rope_index).parameters
    kwargs = {key: value for key, value in batch.extras.items() if key in accepted and key != "input_ids"}
    positions, deltas = rope_index(batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
    return dataclasses.replace(batch, position_ids=positions, position_offset=deltas.reshape(-1, 1).to(torch.long))


def left_pad(sequences: Sequence[list[int] | Encoded], rows: tuple[int, ...], pad_id: int) -> Batch:
    items = [s if isinstance(s, Encoded) else Encoded(list(s)) for s in sequences]
    width = max(len(s) for s in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, item in enumerate(items):
        ids[i, width - len(item) :] = torch.tensor(item.ids, dtype=torch.long)
        mask[i, width - len(item) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(rows=rows, input_ids=ids, attention_mask=mask, position_ids=positions, extras=_batch_extras(items, width))


def _per_token(value: Any, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1 and value.shape[1] == length


def _batch_extras(items: Sequence[Encoded], width: int) -> dict[str, torch.Tensor]:
    keys = list(dict.fromkeys(key for item in items for key in item.extras))
    extras: dict[str, torch.Tensor] = {}
    for key in keys:
        per_token = [item.extras[key] for item in items if key in item.extras and _per_token(item.extras[key], len(item))]
        if per_token:
            padded = torch.zeros(len(items), width, dtype=per_token[0].dtype)
            for i, item in enumerate(items):
                if key in item.extras:
                    padded[i, width - len(item) :] = item.extras[key][0]
            extras[key] = padded
        else:
            extras[key] = torch.cat([item.extras[key] for item in items if key in item.extras])
    return extras


def encode_batches(
    loaded: Any, records: Sequence[Record], *, max_tokens: int, method: MethodSettings, batch_size: int
) -> tuple[list[Batch], list[list[list[int] | None]]]:
    """`records` as the model sees them (`encode_samples`) in left-padded batches, and per batch
    each row's answer as token ids (None where it has none).

    `loaded` is a LoadedModel (a vision-language one with its processor encodes image prompts)."""
    tokenizer = loaded.tokenizer
    encoded = encode_samples(
        tokenizer, records, max_tokens, method,
        processor=getattr(loaded, "processor", None), model=loaded.model, name=loaded.name,
    )
    batches = make_batches(encoded, batch_size, tokenizer.pad_token_id, model=loaded.model)
    return batches, [encode_answers(tokenizer, records, batch.rows) for batch in batches]
