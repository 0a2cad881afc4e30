"""A cache layer that compresses its prompt once and then holds at most ceil(R * T) entries.

transformers builds one causal mask per forward for all full-attention layers, indexed by *logical*
position. This layer therefore reports the logical length (tokens seen, padding columns included)
while it stores fewer physical slots, and tracks per sequence which slots are valid. The kvtool
attention function (attention.py) masks by slot validity, so every layer can hold its own length.

Physical slots are unordered: each slot remembers its logical column (`order`), which is all the
fixed-point queue needs. After compression each row's entries fill its first `kept` slots
(`packed`): a new token goes to slot `kept`, and an evicted slot takes the row's last entry, which is
freed. Both slots are known on the host, so a decode step writes plain slices rather than searching
the validity mask, and the buffer only grows when the layer's share grows. Layers whose validity is
not a prefix (a budget-1.0 layer of a left-padded batch) place new tokens in their first free slot.

Per-head layers (plan `heads="per-head"`) let each KV head keep its own entries, the same number in
every head, packed into the same slots: keys/values stay [B, Hkv, S, D] and slot validity stays
shared ([B, S]), so attention needs no new mask and memory shrinks for real (prompt.py and evict.py
say how selection and eviction keep that layout).

The layer is one class made of parts of one purpose each (this package's modules): prompt
compression (prompt.py), slot storage and placement (slots.py), decode-time eviction (evict.py),
the fixed-slot step a CUDA graph replays (fixed.py), image tokens (images.py) and stacking rows of
several layers (stacking.py). Its state is declared
in one place, `_clear` below; this module holds it and transformers' cache-layer interface.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from kvtool.errors import KvtoolError
from kvtool.runtime.importance import PromptScores
from kvtool.runtime.layer.evict import DecodeEviction
from kvtool.runtime.layer.fixed import FixedSlots
from kvtool.runtime.layer.images import ImageEntries
from kvtool.runtime.layer.plan import LayerPlan
from kvtool.runtime.layer.prompt import PromptCompression
from kvtool.runtime.layer.slots import SlotPlacement
from kvtool.runtime.layer.stacking import RowStacking
from kvtool.runtime.layer.stored import EntryStorage


class CompressingLayer(PromptCompression, ImageEntries, SlotPlacement, DecodeEviction, FixedSlots, RowStacking, DynamicLayer):
    """One full-attention decoder layer's cache under a `LayerPlan`: the whole prompt goes in, each
    row keeps its share of it, and every new token then places one entry and evicts as the plan's
    rule says. The attention function (attention.py) drives it: `compress_prompt` after the prompt
    forward; `discard_padded_token`, `decode_view`, `add_scores` and `evict_over_budget` per step."""

    is_croppable = False
    is_compileable = False

    def __init__(self, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self.storage = EntryStorage(*plan.storage)  # how the kept keys and values are stored (stored.py)
        # transformers builds the sliding-window mask from the first sliding layer's sizes (logical here)
        self.is_sliding = plan.native_window is not None
        self._clear()

    def _clear(self) -> None:
        self.seen = 0  # logical columns, padding included: what the shared mask machinery indexes
        self.head_dim = 0  # D of the keys and values as the model computes them (stored rows may differ)
        self.value_dim = 0  # D of the values: MLA caches keys and values of different widths (latent.py)
        self.valid: torch.Tensor | None = None  # [B, S] slot holds a real entry
        self.order: torch.Tensor | None = None  # [B, S] logical column of the slot's entry
        self.frozen: torch.Tensor | None = None  # [B, S] slot is in the frozen prefix
        self.score: torch.Tensor | None = None  # [B, S] accumulated attention, for rules that need it
        self.tokens = np.zeros(0, dtype=np.int64)  # real tokens seen per sequence (T)
        self.kept = np.zeros(0, dtype=np.int64)  # valid slots per sequence
        self.share = np.zeros(0, dtype=np.int64)  # entries each sequence may hold now (set before a victim is asked for)
        # [counts, B] the plan's share for each token count (`_share_now`); None until a step needs it.
        self._share_table: np.ndarray | None = None
        self._share_rows = np.zeros(0, dtype=np.int64)  # arange(B), the table's row index
        # The keys and values [B, Hkv, D] of the token the last step placed (a packed layer's eviction
        # moves that token, so it writes them instead of reading the slot back).
        self._placed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.compressed = False
        self._prompt_columns = 0
        self._prompt_rank: torch.Tensor | None = None  # [B, S] rank of compressed prompt entries, -1 elsewhere
        self.prompt_importance: torch.Tensor | None = None  # [B, n], when the plan records it
        self.prompt_valid: torch.Tensor | None = None  # [B, n] real (unpadded) prompt columns
        # [B, n] image-token positions of the prompt, handed over by the cache before the prompt forward
        # (vision-language models; None for text-only prompts).
        self.prompt_image: torch.Tensor | None = None
        self.image: torch.Tensor | None = None  # [B, S] slot holds an image entry (only when prompt_image is set)
        # [B, S] the attention the latest token gave each slot, for rules that rank by it (tova)
        self.attention: torch.Tensor | None = None
        self.prompt_scores: PromptScores | None = None  # everything the prompt pass scored, when recorded
        # When recorded: the queries of the prompt's last `plan.window` rows and the attention scale,
        # from which `window_scores` serves any shorter observation window (calibration's recipes).
        self.prompt_rows: torch.Tensor | None = None
        self.prompt_scaling: float | None = None
        self.prompt_score: torch.Tensor | None = None  # what selection ranked by ([B, n] / [B, Hkv, n]), when recorded
        self.per_head = False  # each KV head holds its own entries (set when the prompt is compressed)
        # Each row's valid slots are its first `kept` slots (checked when the prompt is compressed, kept
        # so by `_place` and `_evict_packed`): the new token's slot and the last entry are then known on
        # the host, and a step writes plain slices instead of searching the validity mask.
        self.packed = False
        self._any_frozen = True  # False once no entry is frozen (rules with no frozen prefix): nothing to move
        self._new_slot: torch.Tensor | np.ndarray | None = None
        # Draft rows at the end of the prompt forward (`set_draft`): they score, they are not kept.
        self._draft = 0
        self._hold = False  # keep the whole prompt aside when it is compressed (`hold_prompt`)
        self.held = None  # that prompt (a HeldPrompt) until the cache hands it on
        self._pending = None  # (token_valid, scores) of a held prompt compressed once its forward ends
        # The device counters while the slots are fixed (`fix_slots`, fixed.py); None: eager steps.
        self.fixed = None
        # With fixed slots and `fused_decode_step`, the new token's (key, value) between `update` and
        # the attention, which places it (`fused_step`); its kernels' buffers, made at the first step.
        self.fused = False
        self.step_token: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step_scratch = None

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
            # The prompt's ranks serve only `set_truncation_distance`, which a started generation refuses.
            self._prompt_rank = None
            if self.fixed is not None:
                self._place_fixed(key_states, value_states)
            else:
                self._place(key_states, value_states)
        return self.keys, self.values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # What the stored rows decode back to (slots hold the format's bytes, not the model's floats).
        self.dtype, self.head_dim = key_states.dtype, key_states.shape[-1]
        self.value_dim = value_states.shape[-1]
        try:
            self.storage.check(self.head_dim)
        except ValueError as exc:
            raise KvtoolError(str(exc)) from None

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
        if self.fixed is not None:
            raise KvtoolError("a cache with fixed slots cannot reorder its rows (release_slots() first)")
        for name in ("keys", "values", "valid", "order", "frozen", "score", "image", "attention", "_prompt_rank", "prompt_image"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        self.tokens, self.kept = self.tokens[host_index], self.kept[host_index]
        self._share_table, self._placed = None, None

    # ----- memory accounting -------------------------------------------------------------------

    def physical_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.valid, self.order, self.frozen, self.score, self.image, self.attention,
                   self._prompt_rank]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def full_bytes(self) -> int:
        """What transformers' own layer would hold for the same tokens (a sliding window's at most
        window - 1 of them): keys and values at their own widths (MLA's differ)."""
        if not self.is_initialized:
            return 0
        bsz, heads = self.keys.shape[:2]
        native = self.plan.native_window
        columns = self.seen if native is None else min(self.seen, native)
        value_dim = self.value_dim or self.head_dim  # a stacked layer (stacking.py) is given head_dim alone
        return bsz * heads * columns * (self.head_dim + value_dim) * self.dtype.itemsize
