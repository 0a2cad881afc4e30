"""Fixed slots: a compressed layer's decode step as one static shape, for CUDA graphs.

An eager decode step (slots.py, evict.py) keeps the counters on the host: the new token's slot and
the row's last entry are known there, so a step writes plain slices and attends to exactly the
slots in use. Every step then differs in its shapes and in numbers taken from the host. On a GPU
that keeps decoding launch-bound (about 22 µs of host time per kernel, 21 more kernels per layer
than a plain cache: `benchmarks/gpu_bench.py --shape llama3-8b --profile` on an H100), and a CUDA
graph, which replays the kernels of one step with the arguments they had when it was captured,
cannot be used.

`fix_slots(steps)` gives the layer buffers that hold every entry the next `steps` tokens can need
(its share after them, plus the token placed before one is evicted; from 512 slots on, rounded up
to whole chunks of the GPU's decode attention) and moves the counters to the device. A step then runs the same kernels on the same buffers every time:
- place: the new token goes to slot `kept` (a device index), or to the first free slot in a layer
  that kept its whole padded prompt (not packed, never over its share);
- attend: over every slot, masked by validity (free slots get exactly zero probability);
- evict, branch-free: every row asks the rule for a victim; a row within its share "moves" its last
  entry onto itself, so only rows over their share lose anything, as in the eager step.
Nothing is read back to the host and no state tensor is replaced, so the step can be captured once
and replayed (runtime.graphed). While slots are fixed the host counters stand still;
`release_slots()` reads the device's back and the layer decodes eagerly again. With
`RuntimeSettings.fused_decode_step` (the default) the shipped recipe's layers place, attend and evict
in four Triton kernels instead of some 40 eager ones (`fused_step`, kernels/triton_step.py).

A quantized layer (layer/stored.py) fixes its byte rows the same way: the new token is encoded
(`storage.write`) before it is scattered into its slot, an eviction moves whole byte rows (keys and
values each at their own width), and attention and the rules that read keys see the slots decoded
(`decode_view`, `storage.read`), as in the eager steps; decoding reads nothing on the host. The
fused step reads int8 and fp8 rows itself (kernels/stored_loads.py); other formats take the eager
fixed step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction import EntryView
from kvtool.runtime.eviction.heavy_hitter import HeavyHitter
from kvtool.runtime.importance.decode import SLOT_CHUNK, SPLIT_FROM
from kvtool.runtime.kernels import triton_step
from kvtool.runtime.layer.slots import write_slot
from kvtool.runtime.settings import current_settings


@dataclass(frozen=True)
class FixedCounters:
    """The counters of a layer with fixed slots, on its device (updated in place by each step)."""

    kept: torch.Tensor  # [B] long: valid slots per row (its entries fill slots 0..kept-1 when packed)
    tokens: torch.Tensor  # [B] long: real tokens seen per row (T)
    seen: torch.Tensor  # [] long: logical columns, padding included
    share: torch.Tensor  # [counts, B] long: the plan's share of each row for every token count
    rows: torch.Tensor  # [B] long: arange(B), the share table's row index


class FixedSlots:
    """CompressingLayer's fixed-slot decode step (state declared in `CompressingLayer._clear`: `fixed`)."""

    def fix_slots(self, steps: int) -> None:
        """Make room for `steps` more tokens and keep the counters on the device (see the module)."""
        if not self.compressed:
            raise KvtoolError("internal: fixed slots need a compressed layer (run the prompt first)")
        if self.fixed is not None:
            raise KvtoolError("internal: the layer's slots are fixed already")
        if steps < 1:
            raise KvtoolError("internal: fixed slots need at least one step")
        last = self.tokens + steps
        if self.plan.evict.holds_budget and self.packed:
            # The share never falls as T grows: at most the last step's share, plus the token placed
            # before the eviction.
            needed = max(int(self.kept.max()), int(np.max(self.plan.keep(last)))) + 1
        else:
            needed = int(self.kept.max()) + steps
            if not self.packed:
                needed = self.keys.shape[2] + steps  # the first free slot may lie past the valid ones
        needed = max(needed, self.keys.shape[2])
        if needed >= SPLIT_FROM:  # a whole number of the GPU decode attention's chunks (importance/decode.py)
            needed = -(-needed // SLOT_CHUNK) * SLOT_CHUNK
        if needed > self.keys.shape[2]:
            self._grow(needed - self.keys.shape[2])
        counts = int(last.max()) + 1
        table = np.asarray(self.plan.keep(np.broadcast_to(np.arange(counts)[:, None], (counts, len(self.tokens)))))
        device = self.keys.device
        self.fixed = FixedCounters(
            kept=torch.as_tensor(self.kept, device=device).clone(),
            tokens=torch.as_tensor(self.tokens, device=device).clone(),
            seen=torch.tensor(self.seen, device=device),
            share=torch.as_tensor(np.ascontiguousarray(table, dtype=np.int64), device=device),
            rows=torch.arange(len(self.tokens), device=device),
        )
        self._placed, self._new_slot = None, None
        self.fused = current_settings().fused_decode_step and self._fused_step_applies()

    def _fused_step_applies(self) -> bool:
        """Whether `triton_step` does this layer's steps: the shipped recipe's layers (packed, per-head,
        a heavy-hitter victim, scores kept, no image entries) on a device its kernels run on."""
        rule = self.plan.evict
        return (
            self.packed and self.per_head and rule.holds_budget and type(rule).victim is HeavyHitter.victim
            and not rule.needs_attention and self.score is not None and self.image is None
            and triton_step.available(self.keys, self.storage.names, self.dtype, self.head_dim)
        )

    def fused_step(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The step `_place_fixed`, the attention, `add_scores` and `_evict_fixed` make, in
        `triton_step`'s four kernels; returns the attention output [B, 1, Hq, D]."""
        key, value = self.storage.write(*self.step_token)  # the new token's stored rows, as `_place_fixed` writes them
        self.step_token = None
        if self._step_scratch is None:
            self._step_scratch = triton_step.StepScratch.for_layer(self.keys, query.shape[1], self.head_dim)
        fixed = self.fixed
        state = dict(
            keys=self.keys, values=self.values, valid=self.valid, order=self.order, score=self.score,
            frozen=self.frozen, kept=fixed.kept, tokens=fixed.tokens, seen=fixed.seen, share=fixed.share,
        )
        return triton_step.decode_step(query, key, value, state, scaling, self._step_scratch, self.storage.names)

    def place_step_token(self) -> None:
        """Place the held token the eager way (an attention call the fused step does not cover)."""
        key, value = self.step_token
        self.step_token = None
        self._place_fixed(key, value, eager=True)

    def release_slots(self) -> None:
        """Read the device's counters back: the layer decodes eagerly again (its buffer keeps its size)."""
        fixed = self.fixed
        if fixed is None:
            return
        self.kept = fixed.kept.cpu().numpy().copy()
        self.tokens = fixed.tokens.cpu().numpy().copy()
        self.seen = int(fixed.seen)
        self.fixed = None
        self._share_table = None
        self.fused, self.step_token, self._step_scratch = False, None, None

    def _place_fixed(self, key_states: torch.Tensor, value_states: torch.Tensor, eager: bool = False) -> None:
        if self.fused and not eager:
            self.step_token = (key_states, value_states)  # placed by `fused_step` with the rest
            return
        fixed = self.fixed
        key_states, value_states = self.storage.write(key_states, value_states)  # the stored form (stored.py)
        if self.packed:
            slot = fixed.kept.clone()  # the clone: `kept` changes below, the slot must not
        else:
            slot = (~self.valid).to(torch.int8).argmax(dim=1)  # first free slot
        bsz, heads = self.keys.shape[:2]
        at = slot.view(bsz, 1, 1, 1)  # stored keys and values may differ in width (their formats)
        self.keys.scatter_(2, at.expand(bsz, heads, 1, self.keys.shape[3]), key_states)
        self.values.scatter_(2, at.expand(bsz, heads, 1, self.values.shape[3]), value_states)
        self.valid.scatter_(1, slot[:, None], True)
        for tensor, value in ((self.frozen, False), (self.image, False), (self.score, 0.0)):
            if tensor is not None:
                write_slot(tensor, slot, value)
        write_slot(self.order, slot, fixed.seen)
        fixed.seen.add_(1)
        fixed.tokens.add_(1)
        fixed.kept.add_(1)

    def _evict_fixed(self) -> None:
        fixed = self.fixed
        if not (self.plan.evict.holds_budget and self.packed):
            return  # prompt-only rules never evict; a layer that kept its whole prompt is never over
        share = fixed.share[fixed.tokens, fixed.rows]
        keys, values = self.keys, self.values
        if self.storage.quantized:  # decoded for the rules that read them, as `entry_view` does
            keys, values = self.storage.read(keys, values, self.dtype, self.head_dim) if self.plan.evict.needs_queries else (None, None)
        view = EntryView(
            self.valid, self.order, self.frozen, fixed.seen, share, self.score, self.attention,
            keys, values, self.plan.queries, fixed.tokens,
        )
        victim = self.plan.evict.victim(view)
        over = fixed.kept > share
        last = fixed.kept - 1
        if victim.dim() == 2:
            target = torch.where(over[:, None], victim, last[:, None])
        else:
            target = torch.where(over, victim, last)
        bsz, heads = self.keys.shape[:2]
        at = target[:, :, None] if target.dim() == 2 else target[:, None, None].expand(bsz, heads, 1)
        source = last[:, None, None].expand(bsz, heads, 1)
        for name, tensor in self._entry_tensors():
            if tensor.dim() == 4:  # keys, values: whole rows, stored bytes or not (their widths may differ)
                width = tensor.shape[3]
                to, src = at[..., None].expand(bsz, heads, 1, width), source[..., None].expand(bsz, heads, 1, width)
                axis = 2
            elif tensor.dim() == 3:
                to, src, axis = at, source, 2
            else:
                to, src, axis = target[:, None], last[:, None], 1  # shared layers' [B, S] state, [B] victim
            tensor.scatter_(axis, to, tensor.gather(axis, src))
        self.valid.scatter_(1, last[:, None], ~over[:, None])
        fixed.kept.sub_(over.long())

