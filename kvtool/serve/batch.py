"""One decode step for every running request at once, each over its own cache.

Every request keeps its own kvtool cache, filled by its own prompt phase (`runtime.draft.prepare`),
so requests of any length, arriving at any time, sit in one batch: `runtime.grouped.GroupedCache`
with one row per cache routes row i of the step to request i's layers, and kvtool attention reads
each row's keys and values from that row's own slots (`attention.kvtool_attention_forward`), so no
row attends to padding or to another request's entries. Each row is fed at its own true position.
Only the weights' matrix products run over the whole batch, row by row, so a row's logits are its
request's logits alone (tests/test_serve_scheduler.py checks the tokens against `kvtool generate`
of each request alone, with requests joining and leaving).

A cache with a layer kvtool leaves to transformers (a hybrid model's sliding windows) cannot be
routed row by row: such a request steps alone, in the same step, through its own cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtool.models.forward import with_cache
from kvtool.runtime.grouped import GroupedCache
from kvtool.runtime.layer import CompressingLayer


def routable(cache: Any) -> bool:
    """Whether `cache` can share a batched step: every layer a compressed kvtool layer."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(isinstance(layer, CompressingLayer) and layer.compressed for layer in layers)


def decode_step(model: Any, caches: Sequence[Any], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """Feed token i at position i through cache i, for every i at once; returns the [N, V] logits
    that predict each row's next token."""
    batched = [i for i, cache in enumerate(caches) if routable(cache)]
    alone = [i for i in range(len(caches)) if i not in set(batched)]
    out: list[torch.Tensor | None] = [None] * len(caches)
    if batched:
        logits = _forward(
            model, GroupedCache([caches[i] for i in batched], rows=1) if len(batched) > 1 else caches[batched[0]],
            [tokens[i] for i in batched], [positions[i] for i in batched],
        )
        for row, i in enumerate(batched):
            out[i] = logits[row]
    for i in alone:
        out[i] = _forward(model, caches[i], [tokens[i]], [positions[i]])[0]
    return torch.stack(out)


def _forward(model: Any, cache: Any, tokens: list[int], positions: list[int]) -> torch.Tensor:
    device = model.device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
    position = torch.tensor(positions, dtype=torch.long, device=device)[:, None]
    # No attention mask: kvtool layers mask by their own slots; a cache stepped alone has one
    # unpadded row, whose causal mask over everything before it is no mask at all.
    result = model(input_ids=ids, position_ids=position, use_cache=True, **with_cache(model, cache))
    return result.logits[:, -1]
