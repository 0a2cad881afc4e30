"""The prompt phase a few rows at a time, joined into one cache: the batch's peak is one group's.

A prompt forward holds every row's activations and, until a kvtool layer compresses it (with a
draft, until the last round), its whole keys and values. So run as one forward, the prompt phase
and not the cache bounds the batch:
- on a GPU at 32k tokens of an 8B model a row costs about 8 GB there, while a compressed row keeps
  under 1 GB (`bash benchmarks/gpu_check.sh`'s capacity cells on an H100: 7.7 GiB a row with the full
  cache, 0.85 GiB with kvtool's rows a few at a time): `kvtool.runtime.draft.prepare` takes `rows` from a caller
  who wants that (gpu_bench's capacity cells);
- where a draft holds its prompt in the memory the model computes in (a CPU), the held prompt is the
  full cache's own keys and values, and the compressed cache sits beside it: over the whole batch,
  the prompt phase's peak is the full cache's plus the compressed cache. `rows_at_once` is the
  default there: groups small enough that one group's held prompt and every row's compressed cache
  stay within the batch's full cache, counted in bytes (a layer keeping every entry at 8 bits holds
  a quarter of a float32 model's). One row cannot be split, nor can a cache with a layer that is
  not kvtool's (`joinable`).

Each row's result is what the batch gives it: the rows of a left-padded batch never mix, and every
group keeps the batch's width, so positions and padding are the same (tests/test_row_groups.py).
`join_caches` joins the groups' caches row-wise (`CompressingLayer.stacked`): a compressed layer
with those of the other groups that decode alike, a layer that kept its whole prompt (ratio 1.0, at
any storage) with the other groups' of the same width, which left padding gives every group; a plain
cache joins too (its keys and values concatenated), but holds both copies while it does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvtool.errors import KvtoolError
from kvtool.profiles import Draft, fingerprint_of
from kvtool.profiles.entry_bytes import entry_share
from kvtool.runtime.layer import CompressingLayer, held_prompt
from kvtool.runtime.layer.slots import ENTRY_STATE
from kvtool.runtime.precision import native_bytes


def rows_at_once(batch: int, draft: Draft | None, cache: Any, model: Any, extras: bool = False) -> int:
    """How many of `batch` rows a prompt phase of `model` into caches like `cache` runs at once by default.

    All of them, unless a `draft` holds the prompt in the memory the model computes in (not on a GPU,
    `held_prompt.held_on_host`): then as few groups as keep one group's share of the batch plus the
    kept share of the bytes (`kept_share`) within one, `ceil(batch / floor(batch * (1 - kept)))`, of
    equal size. Prompts with image inputs (`extras`) run at once: their pixel inputs do not split by
    row. So do caches with a layer that is not kvtool's (`joinable`)."""
    if draft is None or batch < 2 or extras or held_prompt.held_on_host(model.device) or not joinable(cache):
        return batch
    per_group = max(1, math.floor(batch * (1.0 - kept_share(cache, model))))
    groups = -(-batch // per_group)
    return -(-batch // groups)


def joinable(cache: Any) -> bool:
    """Whether groups of rows prepared in caches like `cache` join into one (`join_caches`): every
    layer is a CompressingLayer of its own kind (a latent layer decodes through its module and
    never joins another)."""
    layers = getattr(cache, "layers", [])
    return bool(layers) and all(type(layer) is CompressingLayer for layer in layers)


def kept_share(cache: Any, model: Any) -> float:
    """The share of a full cache's bytes `cache` (every layer a CompressingLayer) keeps after the
    prompt, averaged over its layers: each layer's entries at its storage's bytes."""
    head_dim, native = fingerprint_of(model).head_dim, native_bytes(model)
    return sum(layer.plan.ratio * entry_share(*layer.plan.storage, head_dim, native) for layer in cache.layers) / len(cache.layers)


def check_rows(rows: int, extras: bool) -> None:
    """A one-line KvtoolError for rows a prompt phase cannot run at once."""
    if rows < 1:
        raise KvtoolError(f"rows at a time must be at least 1, got {rows}")
    if extras:
        raise KvtoolError("a prompt with image inputs runs its rows at once (its pixel inputs do not split by row)")


def join_caches(caches: list[Any], make_cache: Callable[[], Any]) -> Any:
    """One cache (from `make_cache`) holding the rows of `caches` in order, after their prompt phase."""
    joined = make_cache()
    for index, layer in enumerate(joined.layers):
        parts = [cache.layers[index] for cache in caches]
        if all(isinstance(part, CompressingLayer) for part in parts):
            kinds = {_join_kind(part) for part in parts}
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


def _join_kind(layer: CompressingLayer) -> tuple | None:
    """What one group's layer must share with the others' to join: a compressed layer's
    `decode_kind`; for a layer that kept its whole prompt, its width, storage and per-entry state
    (None: it cannot join)."""
    if layer.compresses or not layer.compressed:
        return layer.decode_kind
    present = tuple(getattr(layer, name) is None for name, _ in ENTRY_STATE)
    keys, values = layer.keys, layer.values
    return ("whole", type(layer.plan.evict), present, layer.seen, keys.dtype, keys.shape[1:], values.shape[1:], layer.storage.names)
