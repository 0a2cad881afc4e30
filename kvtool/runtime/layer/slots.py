"""Slot storage: where a new token's entry goes, how the buffer grows, and what attention reads.

A layer's entries live in physical slots ([B, Hkv, S, D] keys and values, [B, S] validity, and the
per-entry state of ENTRY_STATE). After compression each row's entries fill its first `kept` slots
(`packed`), so a new token goes to slot `kept` and a decode step writes plain slices at host-known
slots; a layer whose validity is not a prefix (a budget-1.0 layer of a left-padded batch) places a
new token in its first free slot. The helpers at the bottom read and write one slot per row; the
eviction (evict.py) moves entries with them.
"""

from __future__ import annotations

import numpy as np
import torch

# Slots added when a layer's share outgrows its buffer: the stated floor above the budget.
GROWTH_SLOTS = 16

# Per-entry state a compressed layer carries beside keys and values, and what its free slots hold.
ENTRY_STATE = (("valid", False), ("order", 0), ("frozen", False), ("score", 0.0), ("image", False))


class SlotPlacement:
    """CompressingLayer's slot storage (state declared in `CompressingLayer._clear`): writes
    `keys`, `values`, `valid`, `order`, `frozen`, `image`, `score`, `seen`, `tokens`, `kept`,
    `_placed` and `_new_slot`."""

    def _place(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the new token into each sequence's first free slot, growing the buffer if needed."""
        if int(self.kept.max()) + 1 > self.keys.shape[2]:
            grow = GROWTH_SLOTS
            if self.plan.cap is not None:  # a window holds at most its entries and the token placed before an eviction
                grow = max(1, min(grow, self.plan.cap + 1 - self.keys.shape[2]))
            self._grow(grow)
        key_states, value_states = self.storage.write(key_states, value_states)  # the stored form (stored.py)
        if self.packed:
            # The first free slot is the row's count: written at host-known slots, nothing searched.
            slot = self.kept.copy()
            at = slot_index(slot, self.valid.device)
            self._placed = (key_states[:, :, 0], value_states[:, :, 0])
            put(self.keys, at, self._placed[0])
            put(self.values, at, self._placed[1])
            put(self.valid, at, True)
            frozen = self.frozen if self._any_frozen else None
            for tensor, value in ((frozen, False), (self.image, False), (self.order, self.seen), (self.score, 0.0)):
                if tensor is not None:
                    put(tensor, at, value)
        else:
            self._placed = None
            slot = (~self.valid).to(torch.int8).argmax(dim=1)  # first free slot
            bsz, heads = self.keys.shape[:2]
            self.keys.scatter_(2, slot[:, None, None, None].expand(bsz, heads, 1, self.keys.shape[3]), key_states)
            self.values.scatter_(2, slot[:, None, None, None].expand(bsz, heads, 1, self.values.shape[3]), value_states)
            self.valid.scatter_(1, slot[:, None], True)
            write_slot(self.frozen, slot, False)
            if self.image is not None:
                write_slot(self.image, slot, False)
            write_slot(self.order, slot, self.seen)
            if self.score is not None:
                write_slot(self.score, slot, 0.0)
        self.seen += 1
        self.tokens = self.tokens + 1
        self.kept = self.kept + 1
        self._new_slot = slot

    def _grow(self, slots: int) -> None:
        bsz, heads = self.keys.shape[:2]
        self.keys = torch.cat([self.keys, self.keys.new_zeros(bsz, heads, slots, self.keys.shape[3])], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(bsz, heads, slots, self.values.shape[3])], dim=2)
        for name in ("valid", "frozen", "order", "image", "score"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, torch.cat([tensor, tensor.new_zeros(*tensor.shape[:-1], slots)], dim=-1))

    def discard_padded_token(self, given: torch.Tensor | None) -> None:
        """Un-place the new token of every sequence where the forward's mask (`given`, [B, 1, 1, T])
        marks it as padding: its slot goes back to free and the counts drop by one. generate never
        feeds padding after the prompt, but a bare forward on a padded batch may."""
        if given is None or self.fixed is not None:
            return  # fixed slots (fixed.py) are fed real tokens only: reading the mask would wait for the GPU
        real = real_new_tokens(given)
        if real is None:
            return
        slot = torch.as_tensor(self._new_slot, device=self.valid.device)
        self.valid.scatter_(1, slot[:, None], real[:, None])
        fake = ~real.cpu().numpy()
        self.tokens = self.tokens - fake
        self.kept = self.kept - fake

    def slot_mask(self) -> torch.Tensor:
        """Boolean [B, 1, 1, S] mask over physical slots for the one new query token (pure)."""
        return self.valid[:, None, None, :]

    def decode_view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys, values and mask the new token attends to. A packed layer's valid slots are each row's
        first `kept`, so it hands over its first max(kept) slots (views), and no mask at all when every
        row holds that many: on the CPU masking the spare slots cost as much as a tenth of the attention.
        Other layers: the whole buffer, masked by validity. Scores the attention returns are as wide
        as the view."""
        keys, values, mask = self._view()
        return (*self._read(keys, values), mask)

    def decode_view_scaled(self, acc: torch.dtype):
        """`decode_view` of a folding storage (`EntryStorage.folds`): key codes, key scales, value
        codes, value scales (`EntryStorage.read_scaled`) and the mask."""
        keys, values, mask = self._view()
        return (*self.storage.read_scaled(keys, values, self.dtype, self.head_dim, acc), mask)

    def _view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stored slots `decode_view` reads, and their mask."""
        if self.fixed is not None:
            return self.keys, self.values, self.slot_mask()  # every slot, the same shape each step
        if self.packed:
            width = int(self.kept.max())
            if width > 0:
                mask = None if (self.kept == width).all() else self.valid[:, None, None, :width]
                return self.keys[:, :, :width], self.values[:, :, :width], mask
        return self.keys, self.values, self.slot_mask()

    def _read(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries as attention reads them: decoded from their stored form (native: as they are)."""
        return self.storage.read(keys, values, self.dtype, self.head_dim)


# The last mask `real_new_tokens` read, and its answer: every layer of a forward gets the same mask
# object, so the host reads it once per forward instead of once per layer (each read waits for the GPU).
_last_mask: tuple[torch.Tensor, torch.Tensor | None] | None = None


def real_new_tokens(given: torch.Tensor) -> torch.Tensor | None:
    """Which rows' new token is real by the forward's mask ([B] bool), or None when all are."""
    global _last_mask
    memo = _last_mask  # one read: another thread's forward may replace it meanwhile
    if memo is not None and memo[0] is given:
        return memo[1]
    real = given[:, 0, -1, -1]
    answer = None if bool(real.all()) else real
    _last_mask = (given, answer)
    return answer


def write_slot(tensor: torch.Tensor, slot: torch.Tensor, value) -> None:
    """Set per-slot metadata ([B, S], or [B, Hkv, S] in per-head layers) at one slot per sequence;
    `value` a number or a 0-d tensor (fixed slots keep their counters on the device)."""
    index = slot[:, None] if tensor.dim() == 2 else slot[:, None, None].expand(-1, tensor.shape[1], 1)
    if isinstance(value, torch.Tensor):
        value = value.to(tensor.dtype).expand(index.shape)
    tensor.scatter_(tensor.dim() - 1, index, value)


def is_packed(valid: torch.Tensor, kept: np.ndarray) -> bool:
    """Whether each row's valid slots are exactly its first `kept[b]` slots."""
    first = torch.arange(valid.shape[1], device=valid.device)[None, :] < torch.as_tensor(kept, device=valid.device)[:, None]
    return bool(torch.equal(valid, first))


def slot_index(slot: np.ndarray, device: torch.device, rows: np.ndarray | None = None) -> int | tuple[torch.Tensor, torch.Tensor]:
    """One slot per row: an int when every row of the batch (`rows` None) uses the same slot, so
    reads and writes are plain slices; else (rows, slots) index tensors."""
    if rows is None and len(slot) and (slot == slot[0]).all():
        return int(slot[0])
    row_index = np.arange(len(slot)) if rows is None else rows
    return torch.as_tensor(row_index, device=device), torch.as_tensor(slot, device=device)


def put(tensor: torch.Tensor, at, value) -> None:
    """tensor[row, ..., slot] = value for one slot per row ([B, S], [B, Hkv, S] or [B, Hkv, S, D] keys)."""
    axis = 2 if tensor.dim() == 4 else tensor.dim() - 1
    if isinstance(at, int):
        column = tensor.select(axis, at)
        if isinstance(value, torch.Tensor):
            column.copy_(value)
        else:
            column.fill_(value)
    elif axis == 1:
        tensor[at[0], at[1]] = value
    else:
        tensor[at[0], :, at[1]] = value


def take(tensor: torch.Tensor, at) -> torch.Tensor:
    """tensor[row, ..., slot] for one slot per row: [B] or [B, Hkv] (keys: [B, Hkv, D])."""
    axis = 2 if tensor.dim() == 4 else tensor.dim() - 1
    if isinstance(at, int):
        return tensor.select(axis, at).clone()
    return tensor[at[0], at[1]] if axis == 1 else tensor[at[0], :, at[1]]
