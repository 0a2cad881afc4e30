"""`window-tova`: TOVA's generation rule inside a sliding layer's own window (a scored window's rule).

After each new token has attended, the layer drops the entry that token attended least, as `tova`
does, except that an entry leaving the model's own window goes first: the model never attends past
it (transformers' sliding mask), so neither may the layer. Sinks (the frozen first tokens) stay. Not
a method of its own: `attach.window_plan` builds it with the model's window for scored windows.
"""

from __future__ import annotations

import torch

from kvtool.runtime.eviction.base import EntryView, oldest_unfrozen, queue_view
from kvtool.runtime.eviction.tova import Tova


class WindowTova(Tova):
    name = "window-tova"
    searched = False

    def __init__(self, native_window: int):
        self.native_window = native_window  # entries the model's own sliding layer holds (window - 1)

    def victim(self, entries: EntryView) -> torch.Tensor:
        least = super().victim(entries)
        valid, frozen, order = queue_view(entries)
        # The next token sees columns seen - native_window and later; older ones leave now.
        last_out = torch.as_tensor(entries.seen, device=order.device) - 1 - self.native_window
        if last_out.dim() == 1:
            last_out = last_out[:, None]
        leaving = (valid & ~frozen & (order <= last_out)).any(dim=-1)
        return torch.where(leaving, oldest_unfrozen(valid, frozen, order), least)
