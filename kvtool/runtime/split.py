"""A left-padded batch's cache, after its prompt phase, as one cache per row: what each row's prompt
alone would have left.

A server runs the prompt phases of the requests waiting together as one left-padded batch
(`runtime.draft.prepare`), then decodes each request through its own cache (`serve.batch`). A row of
the batch differs from that row alone only in where its entries sit: its padding columns count in
the layer's logical length (`seen`) and in each entry's logical column (`order`), and a layer that
keeps every entry holds the padding's free slots before the row's own. `split_rows` gives each row
its own layers holding only its valid slots, in their order (a compressed layer's are its first
`kept` already), with the padding taken out of `seen`, `order` and the prompt's columns: the layout
the row's own prompt phase gives it, so the row decodes through the same operations as alone
(tests/test_split.py compares every attribute of every layer with that row's own cache).
The values in the slots are the batch's: the same up to the float rounding a batch's matrix
products and masked attention give them.

Only right after the prompt phase, and only caches whose every layer is a compressing kvtool layer
(transformers' own layers do not say which of their columns are padding): `splittable`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.layer import CompressingLayer

# Per-slot state ([B, S] or, per head, [B, Hkv, S]) that moves with the slot's entry.
_SLOT_STATE = ("valid", "order", "frozen", "score", "image", "attention")


def splittable(cache: Any) -> bool:
    """Whether caches like `cache` split into rows (`split_rows`): every layer a kvtool compressing
    layer (fresh or filled)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(isinstance(layer, CompressingLayer) for layer in layers)


def split_rows(cache: Any, make_cache: Callable[[], Any]) -> list[Any]:
    """One cache per row of `cache` (from `make_cache`, each holding that row alone), right after
    the prompt phase of a left-padded batch; `cache` itself is left as it was."""
    if not splittable(cache):
        raise KvtoolError("only a cache whose every layer is a kvtool compressing layer splits into rows")
    first = cache.layers[0]
    if not first.compressed:
        raise KvtoolError("internal: a cache splits into rows after its prompt phase")
    pads = first.seen - first.tokens
    rows = []
    for b in range(len(first.tokens)):
        row = make_cache()
        if len(row.layers) != len(cache.layers):
            raise KvtoolError("internal: the cache factory makes caches of another model")
        row.layers = [_row_layer(layer, b, int(pads[b])) for layer in cache.layers]
        mask = getattr(cache, "image_mask", None)
        row.image_mask = None if mask is None else mask[b : b + 1, int(pads[b]) :].clone()
        rows.append(row)
    return rows


def _row_layer(layer: CompressingLayer, b: int, pad: int) -> CompressingLayer:
    """Row `b` of `layer`, its `pad` padding columns taken out, as a layer of its own."""
    if not layer.compressed or layer.seen != layer._prompt_columns or layer.seen - int(layer.tokens[b]) != pad:
        raise KvtoolError("internal: a cache splits into rows right after its prompt phase, before any new token")
    if layer.fixed is not None or layer.held is not None or layer._pending is not None:
        raise KvtoolError("internal: a cache with fixed slots or a held prompt cannot split into rows")
    if layer.plan.record_importance:
        raise KvtoolError("internal: a recorded prompt (calibration's) cannot split into rows")
    slots = torch.nonzero(layer.valid[b])[:, 0]
    one = copy.copy(layer)  # its plan, storage and the subclass's own parts (a latent layer's expansion)
    one._clear()  # every piece of state back to a fresh layer's, then the row's own below
    one.keys = layer.keys[b : b + 1, :, slots].clone()
    one.values = layer.values[b : b + 1, :, slots].clone()
    for name in _SLOT_STATE:
        tensor = getattr(layer, name)
        if tensor is not None:
            setattr(one, name, tensor[b : b + 1, ..., slots].clone())
    one.order = one.order - pad
    if layer.prompt_image is not None:
        one.prompt_image = layer.prompt_image[b : b + 1, pad:].clone()
    # Every slot left is a prompt entry, ranked in slot order as the row's own compression ranks it
    # (a layer joined from row groups, `row_groups.join_caches`, carries no ranks, nor a value width).
    one._prompt_rank = torch.arange(len(slots), device=slots.device)[None]
    one.head_dim, one.value_dim = layer.head_dim, layer.value_dim or layer.head_dim
    one.seen = one._prompt_columns = layer.seen - pad
    one.tokens = layer.tokens[b : b + 1].copy()
    one.kept = layer.kept[b : b + 1].copy()
    one.compressed, one.per_head = True, layer.per_head
    one.packed = bool((one.valid).all())  # only valid slots are left, first to last
    one._any_frozen = bool(one.frozen.any())
    return one
