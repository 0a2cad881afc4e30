"""Prompt compression: the prompt forward's scores rank its tokens and each row keeps its share.

Runs once per layer, right after the prompt forward's attention (attention.py hands over the
scores `score_request` asked for). A draft's rows at the end of that forward (`set_draft`) add
their attention to the prompt's scores and are then cut. Shared layers keep one set of entries for
every KV head; per-head layers (plan `heads="per-head"`) select and merge each (row, KV head) pair
as a sequence of its own, the same count in every head, packed into the same slots: keys/values
stay [B, Hkv, S, D] and slot validity stays shared ([B, S]), while `order`, `frozen`, `score`,
`image` and `attention` are [B, Hkv, S]. The compressed prompt's first entries are then frozen for
the plan's eviction rule (`set_truncation_distance`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.importance import NO_EXTRAS, PromptScores, ScoreRequest
from kvtool.runtime.importance.queried import QUERY_FIELDS, added, with_expected
from kvtool.runtime.importance.window import window_sums
from kvtool.runtime.layer.held_prompt import HeldPrompt
from kvtool.runtime.layer.slots import is_packed


class PromptCompression:
    """CompressingLayer's prompt phase (state declared in `CompressingLayer._clear`): turns the
    whole prompt's keys and values into each row's kept entries, packed first."""

    @property
    def compresses(self) -> bool:
        return self.plan.compresses

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
            return ScoreRequest(heads=True, window=plan.window, expected=plan.queries is not None)
        ranks = self.compresses and plan.select.needs_importance
        request = plan.scoring.request(per_head) if ranks else NO_EXTRAS
        if self.compresses and plan.evict.needs_scores:
            seed = plan.evict.seed_request(per_head, window=plan.window)  # the plan's window, as the scorer's
            request = replace(request, heads=request.heads or seed.heads, window=request.window or seed.window)
        if request.expected and plan.queries is None:
            raise KvtoolError(
                "the expected-attention scorer needs the query statistics a calibrated profile carries "
                "(kvtool calibrate records them); this profile has none"
            )
        if request.window and self._draft:
            request = replace(request, window=request.window + self._draft)  # the draft rows read too
        return request

    @property
    def scores_last_rows_only(self) -> bool:
        """A scored window reads only its last rows' attention (`window_plan`): a few rows against
        the prompt, not a second pass over the whole of it."""
        plan = self.plan
        request = self.score_request
        return (self.compresses and plan.cap is not None and plan.native_window is not None and not plan.record_importance
                and plan.select.needs_importance and not plan.evict.needs_scores
                and request.window > 0 and not request.heads and not request.expected)

    def last_rows_scores(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> PromptScores:
        """The observation-window scores of a scored window's prompt forward (`scores_last_rows_only`),
        from its last rows under the model's sliding mask; the column sums it never reads are left
        as the window's mean over KV heads."""
        bsz, n = keys.shape[0], keys.shape[2]
        valid = torch.ones(bsz, n, dtype=torch.bool, device=keys.device) if mask is None \
            else mask[:, 0].diagonal(dim1=-2, dim2=-1)
        window = self.score_request.window
        rows = query[:, :, -window:]
        sums = window_sums(rows, keys, valid, scaling, min(window, n), span=self.plan.native_window + 1)
        return PromptScores(importance=sums.mean(dim=1), window=sums)

    @property
    def entry_valid(self) -> torch.Tensor:
        """Slot validity shaped to broadcast against the per-entry metadata ([B, S] or [B, 1, S])."""
        return self.valid[:, None, :] if self.per_head else self.valid

    def set_draft(self, tokens: int) -> None:
        """The prompt forward that fills this layer ends with `tokens` draft rows (a first draft of
        the answer): their attention joins the prompt's scores (every row's column sums, and the
        observation window, which grows by them), then the layer keeps only prompt entries and reports
        the prompt's length, so the next token continues from the prompt's end."""
        if self.is_initialized:
            raise KvtoolError("the draft length must be set before the prompt is processed")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise KvtoolError(f"draft tokens must be an integer >= 0, got {tokens!r}")
        self._draft = tokens

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
        if self._hold:
            # A layer that keeps everything goes on writing into these tensors' padded slots: it holds a copy.
            self.held = HeldPrompt.hold(
                self.keys, self.values, token_valid, scores, self.prompt_image, private=not self.compresses
            )
            if self.held.copied is None:
                # The whole prompt stays where it is anyway: compressed copies made now would sit
                # beside it under the rest of the forward's activations, above the full cache's peak.
                self._pending = (token_valid, scores)
                return
        self._compress(token_valid, scores)

    def compress_pending(self) -> None:
        """Compress a held prompt whose compression waited for the end of the prompt forward."""
        if self._pending is not None:
            (token_valid, scores), self._pending = self._pending, None
            self._compress(token_valid, scores)

    def hold_prompt(self) -> None:
        """Keep the whole prompt aside (`held`) when it is compressed: the draft reads it (runtime.draft)."""
        if self.is_initialized:
            raise KvtoolError("the prompt can only be held if asked before it is processed")
        self._hold = True

    def compress_held(self, held: HeldPrompt, scores: PromptScores | None) -> None:
        """Fill this fresh layer from another layer's held prompt, ranked by `scores` (the held
        prompt's own, with a draft's rows added): what the prompt forward would have left here."""
        if self.is_initialized:
            raise KvtoolError("internal: a held prompt fills a fresh layer only")
        if held.copied is not None:
            raise KvtoolError("internal: a held prompt in host memory is compressed from its copy on the device")
        keys, values = held.keys, held.values
        self.lazy_initialization(keys, values)
        if not self.compresses:  # as in `compress_prompt`
            keys, values = keys.clone(), values.clone()
        self.keys, self.values = keys, values
        bsz, n = keys.shape[0], keys.shape[2]
        self.seen = n
        self.order = torch.arange(n, device=keys.device).expand(bsz, n).contiguous()
        self.prompt_image = held.image
        self._compress(held.token_valid, scores)

    def _drop_draft(self, token_valid: torch.Tensor, scores: PromptScores | None) -> tuple[torch.Tensor, PromptScores | None]:
        """Cut the draft's columns: keys, values, positions and scores keep the prompt's alone."""
        n = self.seen - self._draft
        self._draft = 0
        self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        self.order = self.order[:, :n].contiguous()
        self.seen = n
        if self.prompt_image is not None:
            self.prompt_image = self.prompt_image[:, :n]
        if scores is not None:
            cut = (scores.importance, scores.heads, scores.window, scores.expected, scores.expected_output, scores.triattention)
            scores = PromptScores(*(None if t is None else t[..., :n] for t in cut))
        return token_valid[:, :n], scores

    def _compress(self, token_valid: torch.Tensor, scores: PromptScores | None) -> None:
        """Keep each sequence's share of the columns `keys`/`values` hold in logical order, ranked
        by `scores`."""
        keys, values = self.keys, self.values
        image_mask = self._image_mask(token_valid)
        self.tokens = token_valid.sum(dim=1).cpu().numpy().astype(np.int64)
        plan = self.plan
        keep = plan.keep(self.tokens)
        importance = None if scores is None else scores.importance
        if scores is not None and self.score_request.expected and not added(scores):
            # Recording (calibration) serves every scorer; a profile only its own.
            fields = self._recorded_fields(plan.queries) if plan.record_importance else (plan.scoring.field,)
            scores = with_expected(scores, keys, values, token_valid, plan.queries, fields)
        rank_by = self._rank_by(scores, token_valid)
        if plan.record_importance:
            self.prompt_importance, self.prompt_valid = importance, token_valid
            self.prompt_scores, self.prompt_score = scores, rank_by
        self.per_head = plan.heads == "per-head" and self.compresses
        if rank_by is None:
            rank_by = importance  # rules that rank by position ignore it
        if not self.compresses:
            keep = self.tokens
            index = self.order
            kept_valid = token_valid
            frozen_rank = torch.cumsum(token_valid.long(), dim=1) - 1
        else:
            select = self._select_per_head if self.per_head else self._select_shared
            keys, values, index, kept_valid = select(rank_by, token_valid, keep, image_mask)
            frozen_rank = torch.arange(index.shape[-1], device=keys.device).expand_as(kept_valid)
        self.keys, self.values = self.storage.write(keys.contiguous(), values.contiguous())
        self.valid = kept_valid.clone()
        self.order = index.clone()
        entry_valid = self.entry_valid
        if image_mask is not None:
            image = image_mask[:, None, :].expand(-1, index.shape[1], -1) if self.per_head else image_mask
            self.image = image.gather(-1, index) & entry_valid
        if plan.evict.needs_scores and self.compresses:
            accumulated = plan.evict.seed(scores, token_valid, self.per_head, window=plan.window, pool=plan.pool)
            self.score = accumulated.gather(-1, index).masked_fill(~entry_valid, 0.0)
        self._prompt_columns = self.seen
        self._prompt_rank = torch.where(kept_valid, frozen_rank, torch.full_like(frozen_rank, -1))
        self.kept = keep
        self.packed = is_packed(self.valid, keep)
        self.compressed = True
        self.set_truncation_distance(plan.truncation_distance)

    def record_rows(self, query: torch.Tensor, scaling: float) -> None:
        """Keep the prompt's last `plan.window` query rows (a recording plan's: calibration's)."""
        self.prompt_rows = query[:, :, -self.plan.window :].detach().clone()
        self.prompt_scaling = scaling

    def add_expected_scores(self, queries) -> None:
        """Add expected-attention scores (`queries`: a LayerQueries) to the recorded prompt, as
        `_compress` would have with them in the plan: calibration learns the statistics in the same
        prompt forwards it records, so they exist only afterwards."""
        if self.prompt_scores is None:
            raise KvtoolError("internal: expected-attention scores go onto a recorded prompt")
        n = self.prompt_valid.shape[1]
        self.prompt_scores = with_expected(
            self.prompt_scores, self.keys[:, :, :n], self.values[:, :, :n], self.prompt_valid, queries,
            self._recorded_fields(queries),
        )

    @staticmethod
    def _recorded_fields(queries) -> tuple[str, ...]:
        """Every query-statistics score calibration tries; triattention's where the statistics carry its norms."""
        return tuple(name for name in QUERY_FIELDS if name != "triattention" or queries.pair_norm is not None)

    def scores_for(self, window: int) -> PromptScores | None:
        """The recorded prompt scores as a pass asked for observation window `window` would give
        them: the recorded window sums where the windows agree, else sums over the recorded rows'
        last `window` (`window_sums`). A TOVA seed (one row) then ranks by the last row's attention,
        not by the recording's 32."""
        scores = self.prompt_scores
        if scores is None or not window or window == self.plan.window:
            return scores
        if self.prompt_rows is None:
            raise KvtoolError("internal: observation windows other than the recorded one need the recorded rows")
        n = self.prompt_valid.shape[1]  # the prompt's columns (the buffer may hold more)
        keys = self._read(self.keys[:, :, :n], self.values[:, :, :n])[0]  # as attention reads them (slots.py)
        return replace(scores, window=window_sums(self.prompt_rows, keys, self.prompt_valid, self.prompt_scaling, window))

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
        score = plan.scoring.score(scores, token_valid, plan.heads == "per-head")
        if plan.cap is not None and plan.native_window is not None:
            # A scored window keeps entries of the model's own window only: with the oldest dropped
            # first, none of them can then outlive it.
            real_rank = torch.cumsum(token_valid.long(), dim=1) - 1
            outside = real_rank < token_valid.sum(dim=1, keepdim=True) - plan.native_window
            score = score.masked_fill(outside if score.dim() == 2 else outside[:, None], float("-inf"))
        return score

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
