"""Decode-time eviction: the attention a new token gave the entries, and the entry that goes.

After each new token has attended, a layer over its share (ceil(R * T), at least the floor) asks
its plan's eviction rule (kvtool.runtime.eviction) for one victim per row, through a read-only
`EntryView` of its entries (the rules never see the layer). In a packed layer the victim's slot
takes the row's last entry and the last slot is freed. In per-head layers each KV head may name its
own victim: each head's victim slot takes that head's entry from the row's last valid slot, so
every head loses exactly its victim and the layout stays rectangular. Queue rules (fixed-point,
sliding) name the same slot in every head, which takes the last entry in every head alike.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction import EntryView
from kvtool.runtime.layer.slots import put, slot_index, take


class DecodeEviction:
    """CompressingLayer's decode-time eviction (state declared in `CompressingLayer._clear`):
    reads the plan's rule and the entries, writes `score`, `attention`, `share`, `kept` and moves
    entries between slots."""

    @property
    def needs_decode_scores(self) -> bool:
        return self.score is not None or (self.compressed and self.compresses and self.plan.evict.needs_attention)

    @property
    def decode_per_head(self) -> bool:
        """Whether the new token's attention is wanted per KV head ([B, Hkv, S]): per-head layers."""
        return self.per_head

    def add_scores(self, received: torch.Tensor) -> None:
        """Take the attention the new token gave each slot ([B, S] averaged over query heads; [B, Hkv, S]
        averaged over each KV head's query heads in per-head layers): accumulated into `score` for
        rules that need the sum, kept as `attention` for rules that rank by the latest token alone."""
        if self.score is not None:
            # `received` covers the slots the token attended to (`decode_view`: the first ones, or all).
            # Free slots among them received exactly 0 (masked before the softmax), so nothing is
            # masked here. A row with no valid slot at all gets NaN there, which no rule reads:
            # victims are valid slots, and placing a token resets its slot's score.
            width = received.shape[-1]
            score = self.score if width == self.score.shape[-1] else self.score[..., :width]
            score += received.to(score.dtype)
        if self.plan.evict.needs_attention:
            self.attention = received  # as wide as the view: the slots after it are free

    def evict_over_budget(self) -> None:
        """Where kept > ceil(R * T) (and the floor), drop the one entry the plan's eviction rule names (never for
        prompt-only rules, under which the cache grows by one entry per new token)."""
        if self.fixed is not None:
            self._evict_fixed()
            return
        if not self.plan.evict.holds_budget:
            return
        self.share = self._share_now()  # the rule reads it too
        over = self.kept > self.share
        if not over.any():
            return
        if not self.packed:
            # Selection keeps each row's entries first and placing and evicting keep them so; only
            # a layer that kept its whole (padded) prompt is not packed, and it is never over its share.
            raise KvtoolError("internal: a layer over its share holds its entries out of slot order")
        self._evict_packed(np.flatnonzero(over), self.plan.evict.victim(self.entry_view()))
        self.kept = self.kept - over

    def entry_view(self) -> EntryView:
        """What the eviction rule may read of the entries (the layer's own tensors, not copies; keys
        and values decoded from a quantized layer's stored rows for the rules that read them)."""
        keys, values = self.keys, self.values
        if self.storage.quantized:
            keys, values = self.storage.read(keys, values, self.dtype, self.head_dim) if self.plan.evict.needs_queries else (None, None)
        return EntryView(
            self.valid, self.order, self.frozen, self.seen, self.share, self.score, self.attention,
            keys, values, self.plan.queries, self.tokens,
        )

    def _share_now(self) -> np.ndarray:
        """`plan.keep(tokens)`, read from a table of the plan's share for every token count: one
        vectorised computation every few hundred tokens instead of several numpy calls per layer and
        step (which add up to milliseconds per decode step across a model's layers)."""
        tokens, table = self.tokens, self._share_table
        top = int(tokens.max())
        if table is None or top >= table.shape[0] or table.shape[1] != len(tokens):
            width = max(2 * top + 1, 512)
            counts = np.broadcast_to(np.arange(width)[:, None], (width, len(tokens)))
            table = self._share_table = np.asarray(self.plan.keep(counts))  # a row-wise plan broadcasts over B
            self._share_rows = np.arange(len(tokens))
        return table[tokens, self._share_rows]

    def _evict_packed(self, rows: np.ndarray, victim: torch.Tensor) -> None:
        """In each of `rows` the victim slot (`victim` [B], one for every head, or [B, Hkv], one per
        KV head) takes the entry of the row's last valid slot, which is freed: every head loses exactly
        its victim, the rows stay packed, and the last slot is known on the host. A victim that is the
        last slot moves onto itself."""
        last = self.kept[rows] - 1
        # The last slot holds the token this step placed (it went to slot `kept`, evictions run once
        # per step): what it moves is known without reading the slot back, except its score.
        moved = self._placed is not None and np.array_equal(last, np.asarray(self._new_slot)[rows])
        if len(rows) == len(self.kept):
            self._evict_every_row(last, victim, moved)
            return
        source = slot_index(last, self.valid.device, rows)
        subset = torch.as_tensor(rows, device=victim.device)
        row, target = subset, victim[subset]
        if victim.dim() == 2:
            head = torch.arange(victim.shape[1], device=victim.device)[None, :]
            row = subset[:, None]
        for name, tensor in self._entry_tensors():
            if moved and name in ("keys", "values"):
                entry = self._placed[0 if name == "keys" else 1][subset]
            elif moved and name != "score":
                # New tokens are never frozen or image tokens. A value made on the tensor's device: a
                # Python number written into a CUDA tensor by index is copied from the host, which
                # waits for the GPU.
                entry = tensor.new_full((), self.seen - 1 if name == "order" else False)
            else:
                entry = take(tensor, source)  # read before the write: the victim may be the last slot
            if victim.dim() == 2:
                tensor[row, head, target] = entry
            elif tensor.dim() == 2:
                tensor[row, target] = entry
            else:
                tensor[row, :, target] = entry
        put(self.valid, source, False)

    def _evict_every_row(self, last: np.ndarray, victim: torch.Tensor, moved: bool) -> None:
        """`_evict_packed` when every row drops an entry (a decode step's usual case): one scatter
        per tensor, its index built from the victim alone (no row index, nothing copied from the host
        when every row's last slot is the same)."""
        source = slot_index(last, self.valid.device)
        bsz, heads = self.keys.shape[:2]
        # The victim as an index into [B, Hkv, S] state; a [B] victim names the slot in every head.
        at = victim[:, :, None] if victim.dim() == 2 else victim[:, None, None].expand(bsz, heads, 1)
        for name, tensor in self._entry_tensors():
            if tensor.dim() == 4:  # keys, values (stored rows: their widths may differ)
                axis, index = 2, at[..., None].expand(bsz, heads, 1, tensor.shape[3])
            elif tensor.dim() == 3:
                axis, index = 2, at
            else:
                axis, index = 1, victim[:, None]  # shared layers' [B, S] state, whose victim is [B]
            if moved and name in ("keys", "values"):
                entry = self._placed[0 if name == "keys" else 1].unsqueeze(2)
            elif moved and name != "score":
                # New tokens are never frozen or image tokens. A scalar argument, not a tensor copied
                # from the host (which would wait for a GPU's queue).
                tensor.scatter_(axis, index, self.seen - 1 if name == "order" else False)
                continue
            else:
                entry = take(tensor, source).unsqueeze(axis)  # read before the write: the victim may be the last slot
            tensor.scatter_(axis, index, entry)
        put(self.valid, source, False)

    def _entry_tensors(self):
        """(name, tensor) of what an eviction moves: keys, values and the per-entry state present."""
        for name in ("keys", "values", "order", "frozen", "score", "image"):
            tensor = getattr(self, name)
            if tensor is not None and (name != "frozen" or self._any_frozen):
                yield name, tensor
