"""A cache layer that compresses its prompt once and then holds at most ceil(R * T) entries.

transformers builds one causal mask per forward for all full-attention layers, indexed by *logical*
position. This layer therefore reports the logical length (tokens seen, padding columns included)
while it stores fewer physical slots, and tracks per sequence which slots are valid. The kvtool
attention function (attention.py) masks by slot validity, so every layer can hold its own length.

Physical slots are unordered: each slot remembers its logical column (`order`), which is all the
fixed-point queue needs. New tokens fill a free slot (the one the last eviction left), so the
buffer only grows when the layer's share grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction import EvictRule, FixedPoint
from kvtool.runtime.merge import MergeRule
from kvtool.runtime.selection import SelectRule, TopImportance, kept_count

# Slots added when a layer's share outgrows its buffer: the stated floor above the budget.
GROWTH_SLOTS = 16


@dataclass(frozen=True)
class LayerPlan:
    """What one compressing layer does; built from a profile."""

    ratio: float
    merge: MergeRule
    sink_tokens: int
    recent_window: int
    truncation_distance: int
    select: SelectRule = field(default_factory=TopImportance)
    evict: EvictRule = field(default_factory=FixedPoint)
    # Keep the prompt importance after compressing (calibration reads it; costs one score pass).
    record_importance: bool = False


class CompressingLayer(DynamicLayer):
    is_croppable = False
    is_compileable = False

    def __init__(self, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self._clear()

    def _clear(self) -> None:
        self.seen = 0  # logical columns, padding included: what the shared mask machinery indexes
        self.valid: torch.Tensor | None = None  # [B, S] slot holds a real entry
        self.order: torch.Tensor | None = None  # [B, S] logical column of the slot's entry
        self.frozen: torch.Tensor | None = None  # [B, S] slot is in the frozen prefix
        self.score: torch.Tensor | None = None  # [B, S] accumulated attention, for rules that need it
        self.tokens = np.zeros(0, dtype=np.int64)  # real tokens seen per sequence (T)
        self.kept = np.zeros(0, dtype=np.int64)  # valid slots per sequence
        self.compressed = False
        self._prompt_columns = 0
        self._prompt_rank: torch.Tensor | None = None  # [B, S] rank of compressed prompt entries, -1 elsewhere
        self.prompt_importance: torch.Tensor | None = None  # [B, n], when the plan records it
        self.prompt_valid: torch.Tensor | None = None  # [B, n] real (unpadded) prompt columns
        # [B, n] image-token positions of the prompt, handed over by the cache before the prompt forward
        # (vision-language models; None for text-only prompts).
        self.prompt_image: torch.Tensor | None = None
        self.image: torch.Tensor | None = None  # [B, S] slot holds an image entry (only when prompt_image is set)
        self._new_slot: torch.Tensor | None = None

    # ----- transformers' cache-layer interface -------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():
            raise KvtoolError("kvtool caches change shape every step and cannot run under torch.compile")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            bsz, n = key_states.shape[0], key_states.shape[2]
            self.seen = n
            self.order = torch.arange(n, device=key_states.device).expand(bsz, n).contiguous()
        else:
            if not self.compressed:
                raise KvtoolError(
                    "a kvtool cache was used without kvtool attention: call kvtool.runtime.attach(model, profile) first "
                    "and pass the cache to that model"
                )
            if key_states.shape[2] != 1:
                raise KvtoolError(
                    "kvtool compresses the whole prompt in one forward; later forwards must feed one token at a time "
                    "(chunked prefill and multi-token continuation are not supported)"
                )
            self._place(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise KvtoolError("assisted decoding needs to crop the cache, which an evicting kvtool cache cannot do")

    def reset(self) -> None:
        super().reset()
        self._clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0), np.repeat(np.arange(len(self.tokens)), repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            idx = indices.to(self.keys.device)
            self._map_batch(lambda t: t.index_select(0, idx), indices.cpu().numpy())

    def _map_batch(self, fn, host_index: np.ndarray) -> None:
        for name in ("keys", "values", "valid", "order", "frozen", "score", "image", "_prompt_rank"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        self.tokens, self.kept = self.tokens[host_index], self.kept[host_index]

    # ----- memory accounting -------------------------------------------------------------------

    def physical_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.valid, self.order, self.frozen, self.score, self.image]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def full_bytes(self) -> int:
        """What a plain DynamicLayer would hold for the same tokens."""
        if not self.is_initialized:
            return 0
        bsz, heads, _, dim = self.keys.shape
        return 2 * bsz * heads * self.seen * dim * self.keys.element_size()

    # ----- prompt phase (called by the attention function after the layer's sdpa) -------------

    @property
    def compresses(self) -> bool:
        return self.plan.ratio < 1.0

    @property
    def needs_importance(self) -> bool:
        plan = self.plan
        return (self.compresses and (plan.select.needs_importance or plan.evict.needs_scores)) or plan.record_importance

    def set_prompt_image(self, image_mask: torch.Tensor | None) -> None:
        """Which prompt positions are image tokens ([B, n] bool); before the prompt forward only."""
        if self.is_initialized:
            raise KvtoolError("the image-token mask must be set before the prompt is processed")
        self.prompt_image = None if image_mask is None else image_mask.to(torch.bool)

    def _image_mask(self, token_valid: torch.Tensor) -> torch.Tensor | None:
        image = self.prompt_image
        if image is None:
            return None
        if image.shape != token_valid.shape:
            raise KvtoolError(
                f"the image-token mask has shape {tuple(image.shape)} but the prompt reached the cache as "
                f"{tuple(token_valid.shape)} (batch, tokens): the input ids must map 1:1 to language-model positions"
            )
        return image.to(token_valid.device) & token_valid  # padding is never an image token

    @property
    def kept_image(self) -> np.ndarray:
        """Kept (valid) entries per sequence that came from image tokens of the prompt ([B] int64).

        Zeros for text-only prompts and before the prompt is compressed. Generated tokens are text.
        """
        if self.image is None or self.valid is None:
            return np.zeros(len(self.kept), dtype=np.int64)
        return (self.image & self.valid).sum(dim=1).cpu().numpy().astype(np.int64)

    def compress_prompt(self, mask: torch.Tensor | None, importance: torch.Tensor | None) -> None:
        """Keep ceil(R * n) entries per sequence (merging the rest), given the prompt's importance."""
        keys, values = self.keys, self.values
        bsz, _, n, _ = keys.shape
        if mask is None:
            token_valid = torch.ones(bsz, n, dtype=torch.bool, device=keys.device)
        else:
            token_valid = mask[:, 0].diagonal(dim1=-2, dim2=-1).clone()
        image_mask = self._image_mask(token_valid)
        self.tokens = token_valid.sum(dim=1).cpu().numpy().astype(np.int64)
        plan = self.plan
        keep = kept_count(plan.ratio, self.tokens)
        if plan.record_importance:
            self.prompt_importance, self.prompt_valid = importance, token_valid
        if plan.ratio >= 1.0:
            index = self.order
            kept_valid = token_valid
            frozen_rank = torch.cumsum(token_valid.long(), dim=1) - 1
        else:
            selection = plan.select.select(
                importance,
                token_valid,
                keep,
                sink_tokens=plan.sink_tokens,
                recent_window=plan.recent_window,
                image_mask=image_mask,
            )
            keys, values = plan.merge.merge(keys, values, selection, token_valid, importance)
            index, kept_valid = selection.index, selection.valid
            frozen_rank = torch.arange(index.shape[1], device=keys.device).expand_as(index)
        self.keys, self.values = keys.contiguous(), values.contiguous()
        self.valid = kept_valid.clone()
        self.order = index.clone()
        if image_mask is not None:
            self.image = image_mask.gather(1, index) & kept_valid
        if plan.evict.needs_scores and self.compresses:
            self.score = importance.gather(1, index).masked_fill(~kept_valid, 0.0)
        self._prompt_columns = self.seen
        self._prompt_rank = torch.where(kept_valid, frozen_rank, torch.full_like(frozen_rank, -1))
        self.kept = keep
        self.compressed = True
        self.set_truncation_distance(plan.truncation_distance)

    def set_truncation_distance(self, distance: int) -> None:
        """Re-freeze the compressed prompt for another D (before generation starts): calibration
        compresses a prompt once and tries every candidate D on copies of the cache."""
        if not self.compressed or self.seen != self._prompt_columns:
            raise KvtoolError("the truncation distance can only be changed between the prompt and the first new token")
        if self.plan.truncation_distance != distance:
            self.plan = replace(self.plan, truncation_distance=distance)
        prompt_kept = (self._prompt_rank >= 0).sum(dim=1).cpu().numpy()
        frozen_n = self.plan.evict.frozen_count(
            prompt_kept, truncation_distance=distance, sink_tokens=self.plan.sink_tokens
        )
        frozen_n = torch.as_tensor(frozen_n, device=self.keys.device)
        self.frozen = (self._prompt_rank >= 0) & (self._prompt_rank < frozen_n[:, None])

    # ----- generation phase --------------------------------------------------------------------

    def _place(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the new token into each sequence's first free slot, growing the buffer if needed."""
        if int(self.kept.max()) + 1 > self.keys.shape[2]:
            self._grow(GROWTH_SLOTS)
        slot = (~self.valid).to(torch.int8).argmax(dim=1)  # first free slot
        bsz, heads, _, dim = self.keys.shape
        self.keys.scatter_(2, slot[:, None, None, None].expand(bsz, heads, 1, dim), key_states)
        self.values.scatter_(2, slot[:, None, None, None].expand(bsz, heads, 1, dim), value_states)
        column = slot[:, None]
        self.valid.scatter_(1, column, True)
        self.frozen.scatter_(1, column, False)
        if self.image is not None:
            self.image.scatter_(1, column, False)
        self.order.scatter_(1, column, self.seen)
        if self.score is not None:
            self.score.scatter_(1, column, 0.0)
        self.seen += 1
        self.tokens = self.tokens + 1
        self.kept = self.kept + 1
        self._new_slot = slot

    def _grow(self, slots: int) -> None:
        bsz, heads, _, dim = self.keys.shape
        pad = self.keys.new_zeros(bsz, heads, slots, dim)
        self.keys = torch.cat([self.keys, pad], dim=2)
        self.values = torch.cat([self.values, pad], dim=2)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(bsz, slots)], dim=1)
        self.frozen = torch.cat([self.frozen, self.frozen.new_zeros(bsz, slots)], dim=1)
        self.order = torch.cat([self.order, self.order.new_zeros(bsz, slots)], dim=1)
        if self.image is not None:
            self.image = torch.cat([self.image, self.image.new_zeros(bsz, slots)], dim=1)
        if self.score is not None:
            self.score = torch.cat([self.score, self.score.new_zeros(bsz, slots)], dim=1)

    def discard_padded_token(self, given: torch.Tensor | None) -> None:
        """Un-place the new token of every sequence where the forward's mask (`given`, [B, 1, 1, T])
        marks it as padding: its slot goes back to free and the counts drop by one. generate never
        feeds padding after the prompt, but a bare forward on a padded batch may."""
        if given is None:
            return
        real = given[:, 0, -1, -1]
        if bool(real.all()):
            return
        self.valid.scatter_(1, self._new_slot[:, None], real[:, None])
        fake = ~real.cpu().numpy()
        self.tokens = self.tokens - fake
        self.kept = self.kept - fake

    def slot_mask(self) -> torch.Tensor:
        """Boolean [B, 1, 1, S] mask over physical slots for the one new query token (pure)."""
        return self.valid[:, None, None, :]

    @property
    def needs_decode_scores(self) -> bool:
        return self.score is not None

    def add_scores(self, received: torch.Tensor) -> None:
        """Accumulate the attention the new token gave each slot ([B, S], averaged over query heads)."""
        self.score += received.to(self.score.dtype).masked_fill(~self.valid, 0.0)

    def evict_over_budget(self) -> None:
        """Where kept > ceil(R * T), drop the one entry the plan's eviction rule names."""
        over = self.kept > kept_count(self.plan.ratio, self.tokens)
        if not over.any():
            return
        victim = self.plan.evict.victim(self)
        rows = torch.as_tensor(np.flatnonzero(over), device=self.valid.device)
        self.valid[rows, victim[rows]] = False
        self.kept = self.kept - over
