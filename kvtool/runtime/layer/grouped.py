"""Several kvtool caches run as one batch: each over its own block of rows.

Calibration measures many recipes on the same prompts. One decode step of a small model on a CPU
costs about the same for 5 rows as for 15 (reading the weights dominates), so the recipes of one
search stage run side by side: the rows of the batch are the prompts repeated once per recipe, and
each block of rows is served by that recipe's own cache. Nothing mixes between blocks: a block's
layers see only its rows, attention runs per block on that block's own slots
(`attention.kvtool_attention_forward`), and a block's results equal the same cache run alone.

Every block must hold the same prompts (same logical length and padding), which is what the
recipe search hands it. Only decoding is supported: the prompts are put in with
`calibrate.truncation.compress_recorded_prompt` per block before grouping.

With `merge=True` the blocks whose layers decode alike (the same generation rule, head mode and
per-entry state; their ratios may differ) are, layer by layer, moved into one layer that holds all
their rows, each row keeping its own recipe's share (`RowShares`). A decode step then runs one
attention and one round of eviction bookkeeping per kind of rule instead of one per recipe: a search
stage varies one rule at a time, so most of its recipes share the generation rule, and the per-block
bookkeeping (a few dozen small tensor operations per layer) was most of a search step's overhead.
The layers transformers keeps (a hybrid model's sliding windows) are stacked into one layer of all
the rows the same way. The merged layer takes the blocks' state over: their own caches are not
updated any more.

A linear-attention or Mamba layer (Qwen3-Next, Jamba, Bamba, Granite 4, Nemotron-H) holds a
fixed-size conv and recurrent state per row, which transformers' layer reads and writes itself
through the cache (`update_conv_state`, `has_previous_state`). Grouping such a layer gives one
transformers layer over all the blocks' rows, its states stacked by rows in block order (with or
without `merge`): each row's state evolves from its own inputs alone, so each block's rows are
exactly what its own cache would hold.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from kvtool.errors import KvtoolError
from kvtool.runtime.layer import CompressingLayer, LayerPlan
from kvtool.runtime.selection import kept_count


class RowShares:
    """A layer plan whose share is per row: the plan of the first merged layer, with each row's own
    recipe's ratio and floor (everything else a decode step reads is the same for every merged layer)."""

    def __init__(self, plan: LayerPlan, ratios: np.ndarray, floors: np.ndarray):
        self._plan = plan
        self.ratios = ratios
        self.floors = floors

    def __getattr__(self, name: str):
        return getattr(self._plan, name)

    @property
    def ratio(self) -> float:
        return float(self.ratios.max())

    def keep(self, tokens: np.ndarray) -> np.ndarray:
        return kept_count(self.ratios, tokens, self.floors)


def _decodes_alike(layer: DynamicLayer):
    """What must match for two compressed layers to decode as one (None: the layer cannot merge)."""
    if not isinstance(layer, CompressingLayer) or isinstance(layer.plan, RowShares) or layer.plan.cap is not None:
        return None  # a window-shaped layer's cap is its own: a per-row share cannot carry it
    return layer.decode_kind


def _merged(parts: Sequence[CompressingLayer]) -> CompressingLayer:
    """One layer holding the rows of `parts` (in order), each row with its own recipe's share."""
    rows = [len(p.kept) for p in parts]
    shares = RowShares(
        parts[0].plan,
        np.repeat([p.plan.ratio for p in parts], rows),
        np.repeat([p.plan.min_kept for p in parts], rows),
    )
    return CompressingLayer.stacked(parts, shares)


def _stacked_plain(parts: Sequence[DynamicLayer]) -> DynamicLayer | None:
    """transformers' own layers of one class holding the same columns (the blocks' prompts are the
    same) as one layer of all their rows: a step then appends to one tensor, not to each block's
    and then again to their concatenation (None: they differ)."""
    kind = type(parts[0])
    if kind not in (DynamicLayer, DynamicSlidingWindowLayer) or any(type(p) is not kind for p in parts):
        return None
    if len({(p.keys.shape[1:], getattr(p, "cumulative_length", None)) for p in parts}) != 1:
        return None
    stacked = copy.copy(parts[0])
    stacked.keys = torch.cat([p.keys for p in parts])
    stacked.values = torch.cat([p.values for p in parts])
    return stacked


def _stacked_linear(parts: Sequence[LinearAttentionCacheLayerMixin]) -> LinearAttentionCacheLayerMixin:
    """transformers' linear-attention layers of one class as one layer of all their rows: every
    conv and recurrent state concatenated by rows, in order (the parts keep their own tensors)."""
    kind = type(parts[0])
    if isinstance(parts[0], CacheLayerMixin) or any(type(p) is not kind for p in parts):
        raise KvtoolError(f"grouped caches cannot stack {kind.__name__} layers (linear-attention layers that also hold keys)")
    stacked = copy.copy(parts[0])
    for name in ("conv_states", "recurrent_states"):
        held = {i: [getattr(p, name)[i] for p in parts] for i in getattr(parts[0], name)}
        if any((t[0] is None) != (x is None) for t in held.values() for x in t):
            raise KvtoolError("grouped caches must hold the same prompts: a linear-attention state is set in some blocks only")
        setattr(stacked, name, {i: None if t[0] is None else torch.cat(t) for i, t in held.items()})
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size"):
        setattr(stacked, name, dict(getattr(parts[0], name)))
    return stacked


class GroupedLayer(DynamicLayer):
    """One layer index of several caches; part i serves rows [i * rows, (i + 1) * rows). With
    `merge`, parts that decode alike are served by one merged layer (`units`). Parts that are
    transformers' linear-attention layers give one such layer of all their rows instead
    (`_stacked_linear`): transformers' cache reaches those through their own class."""

    is_croppable = False
    is_compileable = False

    def __new__(cls, parts: Sequence[DynamicLayer] = (), rows: int = 0, merge: bool = False):
        # (Defaults: copy and pickle call __new__ without arguments.)
        if parts and isinstance(parts[0], LinearAttentionCacheLayerMixin):
            return _stacked_linear(parts)  # not a GroupedLayer: Python then skips __init__
        return super().__new__(cls)

    def __init__(self, parts: Sequence[DynamicLayer], rows: int, merge: bool = False):
        super().__init__()
        self.parts = list(parts)
        self.rows = rows
        self.is_initialized = all(p.is_initialized for p in self.parts)
        self.is_sliding = getattr(self.parts[0], "is_sliding", False)
        self.compressing = isinstance(self.parts[0], CompressingLayer)
        if any(isinstance(p, CompressingLayer) != self.compressing for p in self.parts):
            raise KvtoolError("grouped caches must compress the same layers")
        self._units, self._restore = self._group(merge)

    def blocks(self) -> list[slice]:
        return [slice(i * self.rows, (i + 1) * self.rows) for i in range(len(self.parts))]

    def _group(self, merge: bool) -> tuple[list[tuple[DynamicLayer, slice | torch.Tensor]], torch.Tensor | None]:
        """(layer, its rows of the batch) per unit, and the permutation that puts the units'
        outputs (concatenated) back in batch order (None: they already are)."""
        blocks = self.blocks()
        if merge and not self.compressing and self.is_initialized:
            stacked = _stacked_plain(self.parts)
            if stacked is not None:
                return [(stacked, slice(0, blocks[-1].stop))], None
        if not (merge and self.compressing and self.is_initialized):
            return list(zip(self.parts, blocks)), None
        groups: dict[object, list[int]] = {}
        for i, part in enumerate(self.parts):
            key = _decodes_alike(part)
            groups.setdefault(("alone", i) if key is None else key, []).append(i)
        units, order = [], []
        for members in groups.values():
            layer = self.parts[members[0]] if len(members) == 1 else _merged([self.parts[i] for i in members])
            rows = [r for i in members for r in range(blocks[i].start, blocks[i].stop)]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            index = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=self.parts[0].keys.device)
            units.append((layer, index))
            order += rows
        if order == list(range(len(order))):
            return units, None
        return units, torch.as_tensor(np.argsort(order), device=self.parts[0].keys.device)

    def units(self) -> list[tuple[DynamicLayer, slice | torch.Tensor]]:
        """The layers that serve the batch, each with its rows (a slice, or an index where merged
        blocks are not adjacent)."""
        return self._units

    def assemble(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The units' outputs (in `units` order, rows first) as one batch in row order."""
        out = torch.cat(list(outputs))
        return out if self._restore is None else out.index_select(0, self._restore)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            raise KvtoolError("a grouped cache only decodes: put each block's prompt in before grouping")
        if key_states.shape[0] != self.rows * len(self.parts):
            raise KvtoolError(
                f"a grouped cache of {len(self.parts)} x {self.rows} rows was fed a batch of {key_states.shape[0]}"
            )
        states = [layer.update(key_states[rows], value_states[rows], *args, **kwargs) for layer, rows in self._units]
        if self.compressing:
            # kvtool attention reads each unit's own slots (their counts differ between units).
            return key_states, value_states
        if len(states) == 1:
            return states[0]
        # Layers kvtool leaves alone hold the same columns in every block: one tensor serves sdpa.
        return torch.cat([k for k, _ in states]), torch.cat([v for _, v in states])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise KvtoolError("a grouped cache only decodes: put each block's prompt in before grouping")

    def get_seq_length(self) -> int:
        return self._units[0][0].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._units[0][0].get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self._units[0][0].get_max_length()
