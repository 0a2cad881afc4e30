"""The prompt phase a few rows at a time, joined into one cache: the batch's peak is one group's.

A prompt forward holds every row's activations and, until a kvtool layer compresses it (with a
draft, until the last round), its whole keys and values. At 32k tokens of an 8B model that is
about 8 GB a row, while a compressed row keeps under 1 GB; so run as one forward, the prompt phase
and not the cache bounds how many rows fit on a GPU (docs/results.md, capacity). `prepare_rows`
runs the prompt phase (`draft.prepare`) for `rows` rows at a time and joins the compressed caches
row-wise (`CompressingLayer.stacked`): the peak is one group's forward beside the compressed rows.

Each row's result is what the batch gives it: the rows of a left-padded batch never mix, and every
group keeps the batch's width, so positions and padding are the same (tests/test_row_groups.py).
A plain cache joins too (its keys and values concatenated), but holds both copies while it does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvtool.errors import KvtoolError
from kvtool.profiles import Draft
from kvtool.runtime.draft import Prepared, Verified, prepare
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.steps import Prompt


def prepare_rows(model: Any, prompt: Prompt, make_cache: Callable[[], Any], draft: Draft | None, rows: int | None) -> Prepared:
    """`prepare` of `prompt`, `rows` rows at a time (None or at least the batch: all at once)."""
    batch = prompt.input_ids.shape[0]
    if rows is None or rows >= batch:
        return prepare(model, prompt, make_cache, draft)
    if rows < 1:
        raise KvtoolError(f"rows at a time must be at least 1, got {rows}")
    if prompt.extras:
        raise KvtoolError("a prompt with image inputs runs its rows at once (its pixel inputs do not split by row)")
    parts = []
    for start in range(0, batch, rows):
        parts.append(prepare(model, prompt.rows(slice(start, start + rows)), make_cache, draft))
    cache = join_caches([part.cache for part in parts], make_cache)
    first = torch.cat([part.first_logits for part in parts])
    prefixes = [part.prefix for part in parts]
    prefix = None if prefixes[0] is None else Verified(
        torch.cat([p.tokens for p in prefixes]), torch.cat([p.lengths for p in prefixes])
    )
    return Prepared(cache, first, prefix)


def join_caches(caches: list[Any], make_cache: Callable[[], Any]) -> Any:
    """One cache (from `make_cache`) holding the rows of `caches` in order, after their prompt phase."""
    joined = make_cache()
    for index, layer in enumerate(joined.layers):
        parts = [cache.layers[index] for cache in caches]
        if all(isinstance(part, CompressingLayer) for part in parts):
            kinds = {part.decode_kind for part in parts}
            if None in kinds or len(kinds) > 1:
                raise KvtoolError(
                    f"layer {index}'s groups of rows cannot be joined (not every group compressed it alike); "
                    "run the rows at once"
                )
            joined.layers[index] = CompressingLayer.stacked(parts, parts[0].plan)
        elif type(layer) is DynamicLayer and all(type(part) is DynamicLayer for part in parts):
            layer.lazy_initialization(parts[0].keys, parts[0].values)
            layer.keys = torch.cat([part.keys for part in parts])
            layer.values = torch.cat([part.values for part in parts])
        else:
            raise KvtoolError(f"layer {index} is a {type(parts[0]).__name__}, which kvtool cannot join row-wise")
    masks = [getattr(cache, "image_mask", None) for cache in caches]
    if hasattr(joined, "image_mask"):
        joined.image_mask = None if masks[0] is None else torch.cat(masks)
    return joined
