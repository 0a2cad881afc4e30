"""Several compressed layers' rows as one layer: calibration runs recipes side by side
(runtime.grouped), and layers that decode alike are merged into one with a share per row."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.layer.slots import ENTRY_STATE


class RowStacking:
    """CompressingLayer's merging of rows from several layers (reads every slot's state)."""

    @property
    def decode_kind(self) -> tuple | None:
        """What two compressed layers must share to decode as one layer with a share per row (their
        generation rule, head mode, per-entry state, length and shapes); None for a layer that
        cannot join one (not compressed and packed)."""
        if not (self.compressed and self.compresses and self.packed):
            return None
        present = tuple(getattr(self, name) is None for name, _ in ENTRY_STATE)
        keys = self.keys
        return (type(self.plan.evict), self.per_head, present, self.seen, keys.dtype, keys.shape[1], keys.shape[3],
                self.storage.names)

    @classmethod
    def stacked(cls, parts: "list[CompressingLayer]", plan: object) -> "CompressingLayer":
        """One layer holding the rows of `parts` (same `decode_kind`), in order, under `plan` (which
        gives each row its share); slots padded to the widest part's buffer (free: validity False)."""
        first = parts[0]
        width = max(p.keys.shape[2] for p in parts)

        def stack(name: str, fill) -> torch.Tensor | None:
            tensors = [getattr(p, name) for p in parts]
            if tensors[0] is None:
                return None
            axis = 2 if name in ("keys", "values") else tensors[0].dim() - 1
            padded = []
            for t in tensors:
                if t.shape[axis] < width:
                    shape = list(t.shape)
                    shape[axis] = width - t.shape[axis]
                    t = torch.cat([t, t.new_full(shape, fill)], dim=axis)
                padded.append(t)
            return torch.cat(padded)

        layer = cls(first.plan)
        layer.plan = plan
        layer.dtype, layer.device, layer.is_initialized = first.dtype, first.keys.device, True
        layer.head_dim = first.head_dim
        layer.keys, layer.values = stack("keys", 0.0), stack("values", 0.0)
        for name, fill in ENTRY_STATE:
            setattr(layer, name, stack(name, fill))
        layer.seen, layer._prompt_columns = first.seen, first._prompt_columns
        layer.tokens = np.concatenate([p.tokens for p in parts])
        layer.kept = np.concatenate([p.kept for p in parts])
        # A layer that kept its whole left-padded prompt is not packed (slots.py), nor is its join.
        layer.compressed, layer.per_head, layer.packed = True, first.per_head, all(p.packed for p in parts)
        layer._any_frozen = any(p._any_frozen for p in parts)
        return layer
