"""The two passes of a calibration run over its prompt batches.

The full pass runs each batch's prompt forward once through a budget-1.0 kvtool cache (exactly the
full cache) that records every compressing layer's importance, and from the full cache it leaves
behind generates the reference continuations and their full-cache NLL. The truncation search then
compresses each batch's recorded prompt state with the calibrated plans (no second prompt forward)
and teacher-forces the references through copies of it, one per candidate D and merge mode.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtool.calibrate.statistics import ImportanceStats, LayerImportance, PromptImages, batch_stats, combine
from kvtool.calibrate.truncation import TruncationResult, TruncationScores, compress_recorded_prompt, score_candidates
from kvtool.models.loader import eos_token_ids
from kvtool.profiles import MethodSettings, Profile
from kvtool.runtime import attach, uniform_profile
from kvtool.scoring import Batch, References, prompt_forward, reference_continuations

# Stage names reported to `progress(stage, done, total)`.
STAGE_IMPORTANCE = "importance"
STAGE_REFERENCES = "references"
STAGE_TRUNCATION = "truncation"

Progress = Callable[[str, int, int], None]


def no_progress(stage: str, done: int, total: int) -> None:
    pass


@dataclass
class _Counter:
    """Counts one stage's units and reports them; the first report opens the stage's bar, so it
    is made only when the stage's work begins (the bar's clock starts there)."""

    stage: str
    total: int
    progress: Progress
    done: int = 0
    started: bool = False

    def start(self) -> "_Counter":
        if not self.started:
            self.started = True
            self.progress(self.stage, self.done, self.total)
        return self

    def step(self, units: int = 1) -> None:
        self.done += units
        self.progress(self.stage, self.done, self.total)

    def finish(self) -> None:
        self.done = self.total
        self.progress(self.stage, self.done, self.total)


@dataclass(frozen=True)
class PromptState:
    """What the truncation search needs from a batch's full pass."""

    batch: Batch
    first_logits: Any  # [B, V] logits of the prompt's last position
    full_cache: Any  # deep copy of the budget-1.0 cache right after the prompt forward, importance recorded
    references: References


@dataclass(frozen=True)
class FullPass:
    """What the full pass measured: the importance statistics of every sample (in sample order),
    per batch the state the truncation search starts from (none without references), and the
    batches with image tokens (for the kept image share)."""

    stats: ImportanceStats
    states: tuple[PromptState, ...]
    images: tuple[PromptImages, ...]


def recorded_importance(cache: Any) -> dict[int, LayerImportance]:
    """Host copies of the prompt importance every compressing layer of `cache` recorded."""
    return {
        index: LayerImportance(
            importance=layer.prompt_importance.detach().cpu().double().numpy(),
            valid=layer.prompt_valid.detach().cpu().numpy().astype(bool),
        )
        for index, layer in cache.compressing_layers().items()
    }


def full_pass(
    model: Any,
    tokenizer: Any,
    batches: Sequence[Batch],
    answers: Sequence[list[list[int] | None]],
    method: MethodSettings,
    *,
    reference_tokens: int,
    with_references: bool,
    progress: Progress = no_progress,
) -> FullPass:
    """Importance of every prompt and, `with_references`, the references of every batch."""
    samples = sum(len(b.rows) for b in batches)
    importance = _Counter(STAGE_IMPORTANCE, samples, progress).start()
    steps = _Counter(STAGE_REFERENCES, len(batches) * (reference_tokens - 1), progress)
    parts, states, images = [], [], []
    eos = eos_token_ids(model, tokenizer)
    handle = attach(model, uniform_profile(model, 1.0, method))
    try:
        with torch.inference_mode():
            for batch, batch_answers in zip(batches, answers):
                cache = handle.new_cache(record_importance=True)
                first_logits = prompt_forward(model, batch, cache)
                stats = batch_stats(
                    recorded_importance(cache), sink_tokens=method.sink_tokens, recent_window=method.recent_window
                )
                parts.append((batch.rows, stats))
                if cache.image_mask is not None and bool(cache.image_mask.any()):
                    images.append(PromptImages.of(cache))
                importance.step(len(batch.rows))
                if not with_references:
                    continue
                # Kept before the references grow the cache: the truncation search compresses
                # this prompt state instead of running the prompt forward again.
                snapshot = copy.deepcopy(cache)
                steps.start()
                references = reference_continuations(
                    model, cache, first_logits, batch,
                    length=reference_tokens, eos_ids=eos,
                    pad_id=tokenizer.pad_token_id, answers=batch_answers, on_step=steps.step,
                )
                states.append(PromptState(batch, first_logits, snapshot, references))
    finally:
        handle.detach()
    if with_references:
        steps.finish()
    return FullPass(stats=combine(parts, samples), states=tuple(states), images=tuple(images))


def truncation_pass(
    model: Any,
    profile: Profile,
    states: Sequence[PromptState],
    candidates: tuple[int, ...],
    *,
    progress: Progress = no_progress,
    stage: str = STAGE_TRUNCATION,
) -> TruncationResult:
    """Calibration PPL of every candidate D with `profile`'s ratios and merge mode; exact ties go
    to the profile's own D."""
    scores = TruncationScores(candidates)
    total = sum(max(state.references.steps - 1, 0) for state in states) * len(candidates)
    steps = _Counter(stage, total, progress).start()
    handle = attach(model, profile)
    try:
        with torch.inference_mode():
            for state in states:
                cache = compress_recorded_prompt(handle.new_cache(), state.full_cache, state.batch.attention_mask)
                scores.full.add(state.references.nll_full, state.references.scored)
                score_candidates(model, cache, state.first_logits, state.batch, state.references, scores, on_step=steps.step)
    finally:
        handle.detach()
    steps.finish()
    return scores.result(default=profile.method.truncation_distance)


@dataclass(frozen=True)
class Search:
    """The D and merge-mode search: the best mode's result and every mode's PPL at its best D."""

    merge: str
    truncation: TruncationResult
    merge_ppl: dict[str, float]


def search_truncation_and_merge(
    model: Any,
    profile: Profile,
    states: Sequence[PromptState],
    candidates: tuple[int, ...],
    merge_modes: tuple[str, ...],
    *,
    progress: Progress = no_progress,
) -> Search:
    """Every D with every merge mode; the lowest calibration PPL wins (ties keep `profile`'s mode)."""
    tried = {}
    for mode in merge_modes:
        trial = dataclasses.replace(profile, method=dataclasses.replace(profile.method, merge=mode))
        stage = STAGE_TRUNCATION if len(merge_modes) == 1 else f"{STAGE_TRUNCATION} ({mode})"
        tried[mode] = truncation_pass(model, trial, states, candidates, progress=progress, stage=stage)
    merge_ppl = {mode: result.ppl_compressed for mode, result in tried.items()}
    best = min(tried, key=lambda mode: (merge_ppl[mode], mode != profile.method.merge))
    return Search(merge=best, truncation=tried[best], merge_ppl=merge_ppl)
