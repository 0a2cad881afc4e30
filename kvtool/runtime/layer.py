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
shared ([B, S]), so attention needs no new mask and memory shrinks for real. What differs per head
(`order`, `frozen`, `score`, `image`, `attention`) is [B, Hkv, S] there. When heads drop different
entries (tova, heavy-hitter), each head's victim slot takes that head's entry from the row's last
valid slot, and the last slot is freed: every head loses exactly its victim and the layout stays
rectangular. Queue rules (fixed-point, sliding) name the same slot in every head, which takes the
last entry in every head alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction import EvictRule, FixedPoint
from kvtool.runtime.importance import NO_EXTRAS, PromptScores, ScoreRequest
from kvtool.runtime.merge import MergeRule
from kvtool.runtime.scoring import Scorer, make_scorer
from kvtool.runtime.selection import SelectRule, TopImportance, kept_count

# Slots added when a layer's share outgrows its buffer: the stated floor above the budget.
GROWTH_SLOTS = 16

# Per-entry state a compressed layer carries beside keys and values, and what its free slots hold.
ENTRY_STATE = (("valid", False), ("order", 0), ("frozen", False), ("score", 0.0), ("image", False))

# "shared": one set of entries for all KV heads of a layer; "per-head": each KV head its own.
HEAD_MODES = ("shared", "per-head")


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
    # What a prompt token is worth (a name in kvtool.runtime.scoring.SCORERS): "attention-sum", the
    # attention all prompt rows give it (Elastic Cache, PrefixKV); "window", the attention of the
    # last `window` rows (SnapKV; 1 = TOVA's prefill score), max-pooled over `pool` positions.
    scorer: str = "attention-sum"
    window: int = 32
    pool: int = 7
    # "union": the share of its kept tokens that come from the window's top list.
    window_share: float = 0.5
    heads: str = "shared"  # one of HEAD_MODES
    # Share of each sequence's kept prompt entries reserved for the most recent tokens (on top of
    # `recent_window`): on a small budget the question and the last turn are what the answer reads.
    recent_share: float = 0.0
    # Entries a layer keeps however short the sequence (`attach(..., min_kept=N)`): at 0.2 a 30-token
    # chat prompt leaves SmolLM2's tightest layer (ratio 0.058) 2 entries and the model degenerates,
    # while a floor costs nothing once ratio * T passes it. 0: the ratio alone.
    min_kept: int = 0
    # New tokens generated over the whole prompt before the layer compresses (their attention joins
    # the prompt's scores: column sums, per-head sums and the observation window); 0: compress right
    # after the prompt.
    lookahead: int = 0
    # During the lookahead, hold this multiple of the layer's share (the prompt entries ranked
    # highest by the prompt's scores, one set for every head, nothing merged) instead of the whole
    # prompt: the KV memory peaks at that multiple of the budget, not at the full cache's. 0: the
    # whole prompt.
    lookahead_hold: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.min_kept, bool) or not isinstance(self.min_kept, int) or self.min_kept < 0:
            raise KvtoolError(f"min-kept must be an integer >= 0, got {self.min_kept!r}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise KvtoolError(f"lookahead must be an integer >= 0, got {self.lookahead!r}")
        if isinstance(self.lookahead_hold, bool) or not isinstance(self.lookahead_hold, (int, float)) or not (
            self.lookahead_hold == 0 or self.lookahead_hold >= 1
        ):
            raise KvtoolError(f"lookahead hold must be 0 (the whole prompt) or at least 1, got {self.lookahead_hold!r}")
        if self.heads not in HEAD_MODES:
            raise KvtoolError(f"unknown head mode {self.heads!r} (known: {', '.join(HEAD_MODES)})")
        self.scoring  # refuses an unknown scorer or a bad window / pool now, not at the first prompt

    def keep(self, tokens: np.ndarray) -> np.ndarray:
        """Entries each sequence keeps after `tokens` real tokens: ceil(ratio * T), at least `min_kept`."""
        return kept_count(self.ratio, tokens, self.min_kept)

    @property
    def scoring(self) -> Scorer:
        return make_scorer(self.scorer, window=self.window, pool=self.pool, window_share=self.window_share)


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
        self.prompt_score: torch.Tensor | None = None  # what selection ranked by ([B, n] / [B, Hkv, n]), when recorded
        self.per_head = False  # each KV head holds its own entries (set when the prompt is compressed)
        # Each row's valid slots are its first `kept` slots (checked when the prompt is compressed, kept
        # so by `_place` and `_evict_packed`): the new token's slot and the last entry are then known on
        # the host, and a step writes plain slices instead of searching the validity mask.
        self.packed = False
        self._any_frozen = True  # False once no entry is frozen (rules with no frozen prefix): nothing to move
        self._new_slot: torch.Tensor | np.ndarray | None = None
        # While the plan's lookahead tokens are generated: the prompt's scores grown by theirs, by
        # logical column ([B, n + t], heads and window [B, Hkv, n + t]); None otherwise.
        self._pending: PromptScores | None = None
        # Draft rows at the end of the prompt forward (`set_draft`): they score, they are not kept.
        self._draft = 0
        self._keep_draft = False  # hold the draft rows' keys and values until `reuse_draft` says which
        # The draft rows' keys and values ([B, Hkv, k, D] each), computed with full attention over the
        # prompt: the full cache's own for the draft tokens it confirmed. Step t writes row b's column
        # t in place of the new token's where the cache says the token is the draft's; freed after.
        self._draft_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._draft_take: np.ndarray | None = None  # [B] rows whose next token is their draft's (`take_draft`)

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
            if self._draft_kv is not None:
                key_states, value_states = self._from_draft(key_states, value_states)
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
        for name in ("keys", "values", "valid", "order", "frozen", "score", "image", "attention", "_prompt_rank", "prompt_image"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        if self._pending is not None:
            self._pending = PromptScores(*(None if t is None else fn(t) for t in (self._pending.importance, self._pending.heads, self._pending.window)))
        self._draft_kv = None  # the rows no longer follow their drafts (beam search): compute as usual
        self.tokens, self.kept = self.tokens[host_index], self.kept[host_index]
        self._share_table, self._placed = None, None

    # ----- several layers' rows as one (calibration's side-by-side recipes, runtime.grouped) -----

    @property
    def decode_kind(self) -> tuple | None:
        """What two compressed layers must share to decode as one layer with a share per row (their
        generation rule, head mode, per-entry state, length and shapes); None for a layer that
        cannot join one (not compressed and packed, or in its lookahead)."""
        if not (self.compressed and self.compresses and self.packed and self._pending is None and self._draft_kv is None):
            return None
        present = tuple(getattr(self, name) is None for name, _ in ENTRY_STATE)
        keys = self.keys
        return (type(self.plan.evict), self.per_head, present, self.seen, keys.dtype, keys.shape[1], keys.shape[3])

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
        layer.dtype, layer.device, layer.is_initialized = first.keys.dtype, first.keys.device, True
        layer.keys, layer.values = stack("keys", 0.0), stack("values", 0.0)
        for name, fill in ENTRY_STATE:
            setattr(layer, name, stack(name, fill))
        layer.seen, layer._prompt_columns = first.seen, first._prompt_columns
        layer.tokens = np.concatenate([p.tokens for p in parts])
        layer.kept = np.concatenate([p.kept for p in parts])
        layer.compressed, layer.per_head, layer.packed = True, first.per_head, True
        layer._any_frozen = any(p._any_frozen for p in parts)
        return layer

    # ----- memory accounting -------------------------------------------------------------------

    def physical_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.valid, self.order, self.frozen, self.score, self.image, self.attention]
        tensors += list(self._draft_kv or ())  # a verified draft's entries, held until generation stores them
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

    @property
    def score_request(self) -> ScoreRequest:
        """What the prompt pass must score beside the layer-averaged column sums."""
        plan = self.plan
        per_head = plan.heads == "per-head"
        if plan.record_importance:
            # Recording is for calibration, which tries every scorer and head mode on the same
            # recorded prompt: score everything (the extra sums come from the same blocks).
            return ScoreRequest(heads=True, window=plan.window)
        ranks = self.compresses and plan.select.needs_importance
        request = plan.scoring.request(per_head) if ranks else NO_EXTRAS
        if self.compresses and plan.evict.needs_scores:
            seed = plan.evict.seed_request(plan, per_head)  # its window is the plan's, as the scorer's
            request = replace(request, heads=request.heads or seed.heads, window=request.window or seed.window)
        if request.window and self._draft:
            request = replace(request, window=request.window + self._draft)  # the draft rows read too
        return request

    @property
    def entry_valid(self) -> torch.Tensor:
        """Slot validity shaped to broadcast against the per-entry metadata ([B, S] or [B, 1, S])."""
        return self.valid[:, None, :] if self.per_head else self.valid

    def set_draft(self, tokens: int, keep: bool = False) -> None:
        """The prompt forward that fills this layer ends with `tokens` draft rows (a first draft of
        the answer): their attention joins the prompt's scores (every row's column sums, and the
        observation window, which grows by them), then the layer keeps only prompt entries and reports
        the prompt's length, so the next token continues from the prompt's end. With `keep`, the
        draft rows' keys and values are held until `reuse_draft` says how many of them to use."""
        if self.is_initialized:
            raise KvtoolError("the draft length must be set before the prompt is processed")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise KvtoolError(f"draft tokens must be an integer >= 0, got {tokens!r}")
        if tokens and self.plan.lookahead:
            raise KvtoolError("a draft and a lookahead cannot be combined: the draft replaces the lookahead")
        self._draft = tokens
        self._keep_draft = bool(keep and tokens)

    def reuse_draft(self, agreed: np.ndarray) -> None:
        """Row b's first `agreed[b]` draft tokens are the full cache's own (a verified draft): their
        keys and values from the prompt forward, where they attended to the whole prompt, are the full
        cache's too. Keep them for the steps that feed those tokens (`take_draft`); only right after a
        prompt forward that kept its draft."""
        if self._draft_kv is None or self.seen != self._prompt_columns:
            raise KvtoolError("internal: a draft is reused only right after the prompt forward that kept it")
        agreed = np.asarray(agreed, dtype=np.int64).reshape(-1)
        if agreed.shape != self.tokens.shape:
            raise KvtoolError(f"internal: {agreed.shape[0]} draft lengths for a batch of {len(self.tokens)}")
        top = int(min(agreed.max(initial=0), self._draft_kv[0].shape[2]))
        keys, values = self._draft_kv
        # Copies: the columns past `top` are never read, and views would keep them alive.
        self._draft_kv = (keys[:, :, :top].clone(), values[:, :, :top].clone()) if top > 0 else None

    def take_draft(self, rows: np.ndarray) -> None:
        """The next step's token is row b's draft token where `rows[b]` ([B] bool, set by the cache,
        which sees the tokens): that step stores the draft forward's keys and values for it instead
        of the ones computed through the compressed cache."""
        self._draft_take = rows

    def _from_draft(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new token's keys and values: the held draft's where this step reuses them. Each step
        still places one entry and evicts as its rule says."""
        rows, self._draft_take = self._draft_take, None
        t = self.seen - self._prompt_columns
        keys, values = self._draft_kv
        if rows is None or t >= keys.shape[2] or not rows.any():  # the rows left the draft, or it was never confirmed
            self._draft_kv = None
            return key_states, value_states
        drafted_k, drafted_v = keys[:, :, t : t + 1], values[:, :, t : t + 1]
        if t + 1 >= keys.shape[2]:
            self._draft_kv = None
        if rows.all():
            return drafted_k, drafted_v
        take = torch.as_tensor(rows, device=key_states.device)[:, None, None, None]
        return torch.where(take, drafted_k, key_states), torch.where(take, drafted_v, value_states)

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
        if self.per_head:
            # Heads keep different entries: the count averaged over KV heads, rounded.
            per_row = (self.image & self.entry_valid).sum(dim=(1, 2)).double() / self.image.shape[1]
            return per_row.round().cpu().numpy().astype(np.int64)
        return (self.image & self.valid).sum(dim=1).cpu().numpy().astype(np.int64)

    def compress_prompt(self, mask: torch.Tensor | None, scores: PromptScores | torch.Tensor | None) -> None:
        """Keep ceil(R * n) entries per sequence (merging the rest), given the prompt's scores.

        `scores` is what the prompt pass scored (a bare [B, n] tensor stands for the importance alone,
        which is all the default attention-sum scorer over shared heads needs).
        """
        if isinstance(scores, torch.Tensor):
            scores = PromptScores(importance=scores)
        bsz, _, n, _ = self.keys.shape
        if mask is None:
            token_valid = torch.ones(bsz, n, dtype=torch.bool, device=self.keys.device)
        else:
            token_valid = mask[:, 0].diagonal(dim1=-2, dim2=-1).clone()
        if self._draft:
            token_valid, scores = self._drop_draft(token_valid, scores)
        if self.compresses and self.plan.lookahead > 0 and scores is not None:
            # Hold the prompt (all of it, or the plan's multiple of its share; nothing evicted) until
            # the lookahead tokens have added their attention; `_end_lookahead` then compresses what
            # is held and the tokens at once.
            self._compress(token_valid, scores, hold=True)
            self._pending = scores
            return
        self._compress(token_valid, scores)

    def _drop_draft(self, token_valid: torch.Tensor, scores: PromptScores | None) -> tuple[torch.Tensor, PromptScores | None]:
        """Cut the draft's columns: keys, values, positions and scores keep the prompt's alone."""
        n = self.seen - self._draft
        self._draft = 0
        if self._keep_draft:
            self._draft_kv = (self.keys[:, :, n:].clone(), self.values[:, :, n:].clone())
        self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        self.order = self.order[:, :n].contiguous()
        self.seen = n
        if self.prompt_image is not None:
            self.prompt_image = self.prompt_image[:, :n]
        if scores is not None:
            scores = PromptScores(*(None if t is None else t[..., :n] for t in (scores.importance, scores.heads, scores.window)))
        return token_valid[:, :n], scores

    def _compress(
        self, token_valid: torch.Tensor, scores: PromptScores | None, hold: bool = False, tokens: np.ndarray | None = None
    ) -> None:
        """Keep each sequence's share of the columns `keys`/`values` hold in logical order, ranked
        by `scores`; with `hold`, what the lookahead holds instead. `tokens`: the tokens seen per
        sequence where `token_valid` marks fewer (columns the lookahead hold dropped)."""
        keys, values = self.keys, self.values
        image_mask = self._image_mask(token_valid)
        self.tokens = token_valid.sum(dim=1).cpu().numpy().astype(np.int64) if tokens is None else tokens.copy()
        plan = self.plan
        keep = plan.keep(self.tokens)
        keep_all = hold and not plan.lookahead_hold
        if hold and not keep_all:
            keep = np.minimum(np.ceil(plan.lookahead_hold * keep - 1e-9).astype(np.int64), self.tokens)
            keep_all = bool((keep >= self.tokens).all())
        importance = None if scores is None else scores.importance
        rank_by = self._rank_by(scores, token_valid)
        if plan.record_importance:
            self.prompt_importance, self.prompt_valid = importance, token_valid
            self.prompt_scores, self.prompt_score = scores, rank_by
        self.per_head = plan.heads == "per-head" and self.compresses and not hold
        if rank_by is None:
            rank_by = importance  # rules that rank by position ignore it
        if plan.ratio >= 1.0 or keep_all:
            keep = self.tokens
            index = self.order
            kept_valid = token_valid
            frozen_rank = torch.cumsum(token_valid.long(), dim=1) - 1
        elif hold:
            keys, values, index, kept_valid = self._select_hold(rank_by, token_valid, keep, image_mask)
            frozen_rank = torch.arange(index.shape[-1], device=keys.device).expand_as(kept_valid)
        else:
            select = self._select_per_head if self.per_head else self._select_shared
            keys, values, index, kept_valid = select(rank_by, token_valid, keep, image_mask)
            frozen_rank = torch.arange(index.shape[-1], device=keys.device).expand_as(kept_valid)
        self.keys, self.values = keys.contiguous(), values.contiguous()
        self.valid = kept_valid.clone()
        self.order = index.clone()
        entry_valid = self.entry_valid
        if image_mask is not None:
            image = image_mask[:, None, :].expand(-1, index.shape[1], -1) if self.per_head else image_mask
            self.image = image.gather(-1, index) & entry_valid
        if plan.evict.needs_scores and self.compresses and not hold:
            accumulated = plan.evict.seed(scores, token_valid, plan, self.per_head)
            self.score = accumulated.gather(-1, index).masked_fill(~entry_valid, 0.0)
        self._prompt_columns = self.seen
        self._prompt_rank = torch.where(kept_valid, frozen_rank, torch.full_like(frozen_rank, -1))
        self.kept = keep
        self.packed = _is_packed(self.valid, keep)
        self.compressed = True
        self.set_truncation_distance(plan.truncation_distance)

    def _rank_by(self, scores: PromptScores | None, token_valid: torch.Tensor) -> torch.Tensor | None:
        """The scorer's score, where selection ranks by it or the plan records it (else None)."""
        plan = self.plan
        if scores is None:
            return None
        request = self.score_request
        if (request.heads and scores.heads is None) or (request.window and scores.window is None):
            raise KvtoolError(
                f"scorer {plan.scorer!r} with {plan.heads} heads needs prompt scores that were not computed "
                "(per-head or observation-window sums); hand the layer what its score_request asks for"
            )
        if not ((self.compresses and plan.select.needs_importance) or plan.record_importance):
            return None
        return plan.scoring.score(scores, token_valid, plan.heads == "per-head")

    def _protected_recent(self, keep: np.ndarray) -> int | np.ndarray:
        """The recent tokens selection keeps whatever their score: the plan's window, or its share
        of each sequence's kept entries when that is more (an array of B counts then)."""
        plan = self.plan
        window = plan.scoring.protected_recent(plan.recent_window)
        if plan.recent_share <= 0.0:
            return window
        return np.maximum(window, np.ceil(plan.recent_share * np.asarray(keep)).astype(np.int64))

    def _select_shared(self, rank_by, token_valid, keep, image_mask):
        """One index set for every KV head: keys/values [B, Hkv, K, D], index and validity [B, K]."""
        plan = self.plan
        selection = plan.select.select(
            rank_by,
            token_valid,
            keep,
            sink_tokens=plan.sink_tokens,
            recent_window=self._protected_recent(keep),
            image_mask=image_mask,
        )
        keys, values = plan.merge.merge(self.keys, self.values, selection, token_valid, rank_by)
        return keys, values, selection.index, selection.valid

    def _select_hold(self, rank_by, token_valid, keep, image_mask):
        """What a bounded lookahead holds: one index set for every KV head (a per-head score counts
        at its best head, so each head's top entries are among them), selected like the plan's own
        but nothing merged: the dropped entries are simply gone."""
        if rank_by is not None and rank_by.dim() == 3:
            rank_by = rank_by.amax(dim=1)
        plan = self.plan
        selection = plan.select.select(
            rank_by, token_valid, keep, sink_tokens=plan.sink_tokens,
            recent_window=self._protected_recent(keep), image_mask=image_mask,
        )
        index, dim = selection.index, self.keys.shape[-1]
        spread = index[:, None, :, None].expand(-1, self.keys.shape[1], -1, dim)
        return self.keys.gather(2, spread), self.values.gather(2, spread), index, selection.valid

    def _select_per_head(self, rank_by, token_valid, keep, image_mask):
        """Each KV head its own top-`keep[b]`: every (sequence, head) pair is selected and merged as a
        sequence of its own with one head. Index [B, Hkv, K]; validity [B, K], the same in every head
        because every head of a row keeps the same count and selection packs kept slots first."""
        plan = self.plan
        bsz, heads, n, _ = self.keys.shape
        per_row = lambda t: None if t is None else t.repeat_interleave(heads, dim=0)  # noqa: E731
        flat_valid = per_row(token_valid)
        if rank_by is not None:
            rank_by = rank_by.reshape(bsz * heads, n) if rank_by.dim() == 3 else per_row(rank_by)
        selection = plan.select.select(
            rank_by,
            flat_valid,
            np.repeat(keep, heads),
            sink_tokens=plan.sink_tokens,
            recent_window=np.repeat(np.broadcast_to(self._protected_recent(keep), keep.shape), heads),
            image_mask=per_row(image_mask),
        )
        one_head = lambda t: t.reshape(bsz * heads, 1, n, t.shape[-1])  # noqa: E731
        keys, values = plan.merge.merge(one_head(self.keys), one_head(self.values), selection, flat_valid, rank_by)
        width = selection.index.shape[1]
        keys = keys.reshape(bsz, heads, width, keys.shape[-1])
        values = values.reshape(bsz, heads, width, values.shape[-1])
        index = selection.index.view(bsz, heads, width)
        return keys, values, index, selection.valid.view(bsz, heads, width)[:, 0]

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
        frozen = (self._prompt_rank >= 0) & (self._prompt_rank < frozen_n[:, None])
        if self.per_head:
            # Before any new token every head's compressed prompt sits in position order in the same
            # slots, so the frozen prefix is the same slots in every head.
            frozen = frozen[:, None, :].expand(-1, self.keys.shape[1], -1).clone()
        self.frozen = frozen
        # New tokens are never frozen, so a layer with no frozen entry now never has one.
        self._any_frozen = bool(frozen.any())

    # ----- generation phase --------------------------------------------------------------------

    def _place(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the new token into each sequence's first free slot, growing the buffer if needed."""
        if int(self.kept.max()) + 1 > self.keys.shape[2]:
            self._grow(GROWTH_SLOTS)
        if self.packed:
            # The first free slot is the row's count: written at host-known slots, nothing searched.
            slot = self.kept.copy()
            at = _slots(slot, self.valid.device)
            self._placed = (key_states[:, :, 0], value_states[:, :, 0])
            _put(self.keys, at, self._placed[0])
            _put(self.values, at, self._placed[1])
            _put(self.valid, at, True)
            frozen = self.frozen if self._any_frozen else None
            for tensor, value in ((frozen, False), (self.image, False), (self.order, self.seen), (self.score, 0.0)):
                if tensor is not None:
                    _put(tensor, at, value)
        else:
            self._placed = None
            slot = (~self.valid).to(torch.int8).argmax(dim=1)  # first free slot
            bsz, heads, _, dim = self.keys.shape
            self.keys.scatter_(2, slot[:, None, None, None].expand(bsz, heads, 1, dim), key_states)
            self.values.scatter_(2, slot[:, None, None, None].expand(bsz, heads, 1, dim), value_states)
            self.valid.scatter_(1, slot[:, None], True)
            _write_slot(self.frozen, slot, False)
            if self.image is not None:
                _write_slot(self.image, slot, False)
            _write_slot(self.order, slot, self.seen)
            if self.score is not None:
                _write_slot(self.score, slot, 0.0)
        self.seen += 1
        self.tokens = self.tokens + 1
        self.kept = self.kept + 1
        self._new_slot = slot

    def _grow(self, slots: int) -> None:
        bsz, heads, _, dim = self.keys.shape
        pad = self.keys.new_zeros(bsz, heads, slots, dim)
        self.keys = torch.cat([self.keys, pad], dim=2)
        self.values = torch.cat([self.values, pad], dim=2)
        for name in ("valid", "frozen", "order", "image", "score"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, torch.cat([tensor, tensor.new_zeros(*tensor.shape[:-1], slots)], dim=-1))

    def discard_padded_token(self, given: torch.Tensor | None) -> None:
        """Un-place the new token of every sequence where the forward's mask (`given`, [B, 1, 1, T])
        marks it as padding: its slot goes back to free and the counts drop by one. generate never
        feeds padding after the prompt, but a bare forward on a padded batch may."""
        if given is None:
            return
        real = _real_new_tokens(given)
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
        Other layers (and a layer in its lookahead, whose scores grow over every slot): the whole
        buffer, masked by validity. Scores the attention returns are as wide as the view."""
        if self.packed and self._pending is None:
            width = int(self.kept.max())
            if width > 0:
                mask = None if (self.kept == width).all() else self.valid[:, None, None, :width]
                return self.keys[:, :, :width], self.values[:, :, :width], mask
        return self.keys, self.values, self.slot_mask()

    @property
    def needs_decode_scores(self) -> bool:
        return (
            self._pending is not None
            or self.score is not None
            or (self.compressed and self.compresses and self.plan.evict.needs_attention)
        )

    @property
    def decode_per_head(self) -> bool:
        """Whether the new token's attention is wanted per KV head ([B, Hkv, S]): per-head layers,
        and every layer during its lookahead (the per-head and window sums grow by it)."""
        return self.per_head or self._pending is not None

    def add_scores(self, received: torch.Tensor) -> None:
        """Take the attention the new token gave each slot ([B, S] averaged over query heads; [B, Hkv, S]
        averaged over each KV head's query heads in per-head layers): accumulated into `score` for
        rules that need the sum, kept as `attention` for rules that rank by the latest token alone.
        During the lookahead ([B, Hkv, S]) it is added to the prompt's scores instead."""
        if self._pending is not None:
            self._add_lookahead(received)
            return
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
        prompt-only rules, under which the cache grows by one entry per new token). The last
        lookahead token compresses the layer instead."""
        if self._pending is not None:
            if self.seen - self._prompt_columns >= self.plan.lookahead:
                self._end_lookahead()
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
        self._evict_packed(np.flatnonzero(over), self.plan.evict.victim(self))
        self.kept = self.kept - over

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

    def _add_lookahead(self, received: torch.Tensor) -> None:
        """The new token's attention ([B, Hkv, S], each KV head's query heads averaged) joins the
        prompt's scores at the logical columns of the slots; the scores grow by the token's own column."""
        pending = self._pending
        columns = self.seen
        grow = lambda t: None if t is None else torch.cat([t, t.new_zeros(*t.shape[:-1], columns - t.shape[-1])], dim=-1)  # noqa: E731
        importance, heads, window = (grow(t) for t in (pending.importance, pending.heads, pending.window))
        received = received.to(importance.dtype).masked_fill(~self.valid[:, None, :], 0.0)
        index = self.order[:, None, :].expand_as(received)
        per_column = torch.zeros(*received.shape[:-1], columns, dtype=received.dtype, device=received.device)
        per_column.scatter_add_(-1, index, received)
        importance = importance + per_column.mean(dim=1)
        heads = None if heads is None else heads + per_column
        window = None if window is None else window + per_column
        self._pending = PromptScores(importance=importance, heads=heads, window=window)

    def _end_lookahead(self) -> None:
        """Compress the prompt and the lookahead tokens as one prompt: their keys and values in
        logical order, ranked by the prompt's scores grown by the lookahead tokens' attention."""
        bsz, heads, _, dim = self.keys.shape
        columns = self.seen
        index = torch.where(self.valid, self.order, columns)  # free slots go to a column cut off below
        token_valid = torch.zeros(bsz, columns + 1, dtype=torch.bool, device=self.keys.device)
        token_valid.scatter_(1, index, self.valid)
        token_valid = token_valid[:, :columns]
        keys = self.keys.new_zeros(bsz, heads, columns + 1, dim)
        values = self.values.new_zeros(bsz, heads, columns + 1, dim)
        spread = index[:, None, :, None].expand(bsz, heads, -1, dim)
        keys.scatter_(2, spread, self.keys)
        values.scatter_(2, spread, self.values)
        scores = self._pending
        self._pending = None
        tokens = self.tokens
        if self.prompt_image is not None:
            extra = columns - self.prompt_image.shape[1]
            self.prompt_image = torch.cat([self.prompt_image, self.prompt_image.new_zeros(bsz, extra)], dim=1)
        self.keys, self.values = keys[:, :, :columns], values[:, :, :columns]
        self.order = torch.arange(columns, device=self.keys.device).expand(bsz, columns).contiguous()
        self.attention = None
        self._compress(token_valid, scores, tokens=tokens)

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
        source = _slots(last, self.valid.device, rows)
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
                entry = _take(tensor, source)  # read before the write: the victim may be the last slot
            if victim.dim() == 2:
                tensor[row, head, target] = entry
            elif tensor.dim() == 2:
                tensor[row, target] = entry
            else:
                tensor[row, :, target] = entry
        _put(self.valid, source, False)

    def _evict_every_row(self, last: np.ndarray, victim: torch.Tensor, moved: bool) -> None:
        """`_evict_packed` when every row drops an entry (a decode step's usual case): one scatter
        per tensor, its index built from the victim alone (no row index, nothing copied from the host
        when every row's last slot is the same)."""
        source = _slots(last, self.valid.device)
        bsz, heads, _, dim = self.keys.shape
        # The victim as an index into [B, Hkv, S] state; a [B] victim names the slot in every head.
        at = victim[:, :, None] if victim.dim() == 2 else victim[:, None, None].expand(bsz, heads, 1)
        for name, tensor in self._entry_tensors():
            if tensor.dim() == 4:  # keys, values
                axis, index = 2, at[..., None].expand(bsz, heads, 1, dim)
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
                entry = _take(tensor, source).unsqueeze(axis)  # read before the write: the victim may be the last slot
            tensor.scatter_(axis, index, entry)
        _put(self.valid, source, False)

    def _entry_tensors(self):
        """(name, tensor) of what an eviction moves: keys, values and the per-entry state present."""
        for name in ("keys", "values", "order", "frozen", "score", "image"):
            tensor = getattr(self, name)
            if tensor is not None and (name != "frozen" or self._any_frozen):
                yield name, tensor


# The last mask `_real_new_tokens` read, and its answer: every layer of a forward gets the same mask
# object, so the host reads it once per forward instead of once per layer (each read waits for the GPU).
_last_mask: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _real_new_tokens(given: torch.Tensor) -> torch.Tensor | None:
    """Which rows' new token is real by the forward's mask ([B] bool), or None when all are."""
    global _last_mask
    memo = _last_mask  # one read: another thread's forward may replace it meanwhile
    if memo is not None and memo[0] is given:
        return memo[1]
    real = given[:, 0, -1, -1]
    answer = None if bool(real.all()) else real
    _last_mask = (given, answer)
    return answer


def _write_slot(tensor: torch.Tensor, slot: torch.Tensor, value) -> None:
    """Set per-slot metadata ([B, S], or [B, Hkv, S] in per-head layers) at one slot per sequence."""
    if tensor.dim() == 2:
        tensor.scatter_(1, slot[:, None], value)
    else:
        tensor.scatter_(2, slot[:, None, None].expand(-1, tensor.shape[1], 1), value)


def _is_packed(valid: torch.Tensor, kept: np.ndarray) -> bool:
    """Whether each row's valid slots are exactly its first `kept[b]` slots."""
    first = torch.arange(valid.shape[1], device=valid.device)[None, :] < torch.as_tensor(kept, device=valid.device)[:, None]
    return bool(torch.equal(valid, first))


def _slots(slot: np.ndarray, device: torch.device, rows: np.ndarray | None = None) -> int | tuple[torch.Tensor, torch.Tensor]:
    """One slot per row: an int when every row of the batch (`rows` None) uses the same slot, so
    reads and writes are plain slices; else (rows, slots) index tensors."""
    if rows is None and len(slot) and (slot == slot[0]).all():
        return int(slot[0])
    row_index = np.arange(len(slot)) if rows is None else rows
    return torch.as_tensor(row_index, device=device), torch.as_tensor(slot, device=device)


def _put(tensor: torch.Tensor, at, value) -> None:
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


def _take(tensor: torch.Tensor, at) -> torch.Tensor:
    """tensor[row, ..., slot] for one slot per row: [B] or [B, Hkv] (keys: [B, Hkv, D])."""
    axis = 2 if tensor.dim() == 4 else tensor.dim() - 1
    if isinstance(at, int):
        return tensor.select(axis, at).clone()
    return tensor[at[0], at[1]] if axis == 1 else tensor[at[0], :, at[1]]
