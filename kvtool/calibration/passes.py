"""The two passes of a calibration run over its prompt batches.

The full pass runs each batch's prompt forward once through a budget-1.0 kvtool cache (exactly the
full cache) that records every compressing layer's importance, and from the full cache it leaves
behind generates the reference continuations and their full-cache NLL. The truncation search then
compresses each batch's recorded prompt state with the calibrated plans (no second prompt forward)
and teacher-forces the references through copies of it, one per candidate D and merge mode.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtool.calibration.queries import QueryRecorder
from kvtool.calibration.statistics import ImportanceStats, LayerImportance, PromptImages, batch_stats, combine
from kvtool.calibration.truncation import TruncationResult, TruncationScores, compress_recorded_prompt, score_candidates
from kvtool.errors import KvtoolError
from kvtool.models.loader import eos_token_ids
from kvtool.profiles import MethodSettings, Profile
from kvtool.profiles.queries import QueryStats
from kvtool.profiles.schema import QUERY_SCORERS, WINDOW_SCORERS
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.attach import layer_queries
from kvtool.runtime.draft import prepare
from kvtool.runtime.eviction import EVICT_RULES
from kvtool.runtime.grouped import GroupedCache
from kvtool.runtime.importance import make_scorer
from kvtool.scoring import (
    Batch, PromptMeanNll, References, prompt_forward, reference_continuations, teacher_forced_nll,
)

# Stage names reported to `progress(stage, done, total)`.
STAGE_IMPORTANCE = "importance"
STAGE_REFERENCES = "references"
STAGE_TRUNCATION = "truncation"
STAGE_QUERIES = "queries"

Progress = Callable[[str, int, int], None]


def no_progress(stage: str, done: int, total: int) -> None:
    pass


@dataclass
class StageCounter:
    """Counts one stage's units and reports them; the first report opens the stage's bar, so it
    is made only when the stage's work begins (the bar's clock starts there)."""

    stage: str
    total: int
    progress: Progress
    done: int = 0
    started: bool = False

    def start(self) -> "StageCounter":
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
    # The same statistics under every scorer calibration may choose, by `scorer_key` (stats is the
    # first scorer's).
    stats_by_scorer: dict[str, ImportanceStats] = dataclasses.field(default_factory=dict)
    # The query statistics the expected-attention scorer read (given, or learned in this pass).
    query_stats: QueryStats | None = None


def recorded_importance(cache: Any, scorer: str = "attention-sum", method: MethodSettings | None = None) -> dict[int, LayerImportance]:
    """Host copies of what `scorer` makes of the prompt scores every compressing layer of `cache`
    recorded (shared over heads: one curve per layer); `method` gives the window scorer's window and pool."""
    method = method or MethodSettings()
    rule = make_scorer(scorer, window=method.window, pool=method.pool, window_share=method.window_share)
    out = {}
    for index, layer in cache.compressing_layers().items():
        valid = layer.prompt_valid
        if scorer == "attention-sum":
            score = layer.prompt_importance
        else:  # the scores a pass asked for this scorer's own window would give
            score = rule.score(layer.scores_for(rule.request(False).window), valid, False)
        out[index] = LayerImportance(
            importance=score.detach().cpu().double().numpy(), valid=valid.detach().cpu().numpy().astype(bool)
        )
    return out


def scorer_key(settings: MethodSettings) -> str:
    """Names a scorer with what changes its scores (window and pool, for the scorers that read them;
    the union's window share when it is not the even split)."""
    if settings.scorer == "union" and settings.window_share != 0.5:
        return f"union {settings.window} pool {settings.pool} share {settings.window_share:g}"
    if settings.scorer in WINDOW_SCORERS:
        return f"{settings.scorer} {settings.window} pool {settings.pool}"
    return settings.scorer


def scorer_stats(cache: Any, scorer: str, method: MethodSettings) -> ImportanceStats:
    """One batch's Lorenz statistics under `scorer`. The protected tokens are left out as the
    runtime protects them; attention-sum column sums are divided by the rows that see each column
    (see `statistics.compressible`), window scores are not (every scored column sees all window rows)."""
    rule = make_scorer(scorer, window=method.window, pool=method.pool, window_share=method.window_share)
    scores = recorded_importance(cache, scorer, method)
    recent = rule.protected_recent(method.recent_window)
    if recent > method.recent_window:
        # A prompt barely longer than the observation window still gets a curve: its last tokens
        # (inside the window) enter it rather than leave nothing to rank.
        shortest = int(min(layer.valid.sum(axis=1).min() for layer in scores.values()))
        recent = max(method.recent_window, min(recent, shortest - method.sink_tokens - 1))
    return batch_stats(
        scores, sink_tokens=method.sink_tokens, recent_window=recent, per_row_mean=scorer == "attention-sum"
    )


def full_pass(
    model: Any,
    tokenizer: Any,
    batches: Sequence[Batch],
    answers: Sequence[list[list[int] | None]],
    method: MethodSettings,
    *,
    reference_tokens: int | Sequence[int],
    with_references: bool,
    progress: Progress = no_progress,
    scorers: Sequence[MethodSettings] = (),
    query_stats: QueryStats | None = None,
    queries: QueryRecorder | None = None,
) -> FullPass:
    """Importance of every prompt and, `with_references`, the references of every batch
    (`reference_tokens` long: one length, or one per batch).

    Statistics are made for the scorer of each settings in `scorers` (default: `method`'s alone),
    keyed by `scorer_key`; `query_stats` serve the expected-attention scorer. Without them, a
    `queries` recorder learns them in these prompt forwards (`with_references` only): the recorded
    prompt states are then scored by them once every batch has run (`FullPass.query_stats`)."""
    scorers = tuple({scorer_key(s): s for s in (scorers or (method,))}.items())
    deferred = {key for key, s in scorers if s.scorer in QUERY_SCORERS} if queries is not None else set()
    if queries is not None and (query_stats is not None or not with_references):
        raise KvtoolError("internal: query statistics are learned in the full pass only with references and none given")
    samples = sum(len(b.rows) for b in batches)
    importance = StageCounter(STAGE_IMPORTANCE, samples, progress).start()
    lengths = [reference_tokens] * len(batches) if isinstance(reference_tokens, int) else list(reference_tokens)
    if len(lengths) != len(batches):
        raise KvtoolError("internal: one reference length per batch")
    steps = StageCounter(STAGE_REFERENCES, sum(length - 1 for length in lengths), progress)
    parts, states, images = [], [], []
    eos = eos_token_ids(model, tokenizer)
    # The recording keeps the widest observation window any scorer asks for; shorter ones (TOVA's
    # one row) are served from its recorded rows (`CompressingLayer.scores_for`).
    widest = max([method.window, *(s.window for _, s in scorers if s.scorer in WINDOW_SCORERS)])
    recording = uniform_profile(model, 1.0, dataclasses.replace(method, window=widest))
    if deferred and method.scorer in QUERY_SCORERS:  # nothing to rank by yet; the recording's own rank goes unread
        recording = dataclasses.replace(recording, method=dataclasses.replace(recording.method, scorer="attention-sum"))
    if query_stats is None and EVICT_RULES[method.eviction].needs_queries:  # at budget 1.0 nothing is evicted
        recording = dataclasses.replace(recording, method=dataclasses.replace(recording.method, eviction=MethodSettings().eviction))
    handle = attach(model, dataclasses.replace(recording, query_stats=query_stats))
    try:
        with torch.inference_mode(), (queries.installed() if queries is not None else contextlib.nullcontext()):
            for batch, batch_answers, length in zip(batches, answers, lengths):
                cache = handle.bare_cache(record_importance=True)
                with queries.prompt(batch.attention_mask) if queries is not None else contextlib.nullcontext():
                    first_logits = prompt_forward(model, batch, cache)
                parts.append((batch.rows, {
                    key: scorer_stats(cache, s.scorer, _scored_by(method, s)) for key, s in scorers if key not in deferred
                }))
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
                    length=length, eos_ids=eos,
                    pad_id=tokenizer.pad_token_id, answers=batch_answers, on_step=steps.step,
                )
                states.append(PromptState(batch, first_logits, snapshot, references))
    finally:
        handle.detach()
    if with_references:
        steps.finish()
    if queries is not None:
        query_stats = queries.stats()
        layers = layer_queries(model, dataclasses.replace(recording, query_stats=query_stats))
        for (_, stats), state in zip(parts, states):
            for index, layer in state.full_cache.compressing_layers().items():
                layer.add_expected_scores(layers[index])
            stats.update({
                key: scorer_stats(state.full_cache, s.scorer, _scored_by(method, s)) for key, s in scorers if key in deferred
            })
    by_scorer = {key: combine([(rows, stats[key]) for rows, stats in parts], samples) for key, _ in scorers}
    return FullPass(
        stats=by_scorer[scorers[0][0]], states=tuple(states), images=tuple(images), stats_by_scorer=by_scorer,
        query_stats=query_stats,
    )


def _scored_by(method: MethodSettings, scorer: MethodSettings) -> MethodSettings:
    """`method` (sinks, recent window) with `scorer`'s scorer, window, pool and window share."""
    return dataclasses.replace(
        method, scorer=scorer.scorer, window=scorer.window, pool=scorer.pool, window_share=scorer.window_share
    )


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
    steps = StageCounter(stage, total, progress).start()
    handle = attach(model, profile)
    try:
        with torch.inference_mode():
            for state in states:
                cache = compress_recorded_prompt(handle.bare_cache(), state.full_cache, state.batch.attention_mask)
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


STAGE_RECIPES = "recipes"
STAGE_CONFIRM = "held-out"


def recipe_ppls(
    model: Any, profiles: Sequence[Profile], states: Sequence[PromptState], on_step: Callable[[int], None] | None = None
) -> list[float]:
    """Calibration PPL of each profile's recipe: each batch's recorded prompt compressed with its
    plans, then its references teacher-forced through that cache; exp of the mean over prompts of
    each prompt's mean NLL (`PromptMeanNll`: every prompt counts the same).

    The recipes run side by side: one batch holds each prompt batch once per recipe, every block of
    rows decoded through its recipe's own cache (`runtime.grouped`). A decode step of a small model
    on a CPU costs little more for three blocks than for one (reading the weights dominates), so a
    search stage costs about one recipe's pass, not one per recipe; recipes that share a generation
    rule also share each layer's attention and eviction bookkeeping (`GroupedCache(merge=True)`)."""
    totals = [PromptMeanNll() for _ in profiles]
    handle = attach(model, profiles[0])
    try:
        with torch.inference_mode():
            for state in states:
                rows = state.batch.attention_mask.shape[0]
                caches = [
                    compress_recorded_prompt(handle.cache_for(p), state.full_cache, state.batch.attention_mask)
                    for p in profiles
                ]
                times = len(profiles)
                cache = caches[0] if times == 1 else GroupedCache(caches, rows, merge=True)
                nll = teacher_forced_nll(
                    model, cache, state.first_logits.repeat(times, 1), state.batch.repeated(times),
                    state.references.repeated(times), on_step,
                )
                for i, total in enumerate(totals):
                    total.add(nll[i * rows : (i + 1) * rows], state.references.scored)
    finally:
        handle.detach()
    return [total.ppl() for total in totals]


def drafted_ppls(
    model: Any, profiles: Sequence[Profile], states: Sequence[PromptState], on_step: Callable[[int], None] | None = None
) -> list[float]:
    """Calibration PPL of each profile as it runs with its draft (`MethodSettings.draft`): each
    batch's prompt forward again into a fresh cache, drafted and scored again round by round
    (`runtime.draft.prepare`, as `kvtool eval` and `generate` run it), then the references
    teacher-forced through the cache the last round left; the same measure as `recipe_ppls`.

    The recorded prompt state cannot stand in here: the draft's rows are new queries whose attention
    joins the prompt's scores, so every recipe pays its own prompt forwards and drafts, one profile
    after another (each cache freed before the next fills)."""
    totals = [PromptMeanNll() for _ in profiles]
    handle = attach(model, profiles[0])
    try:
        with torch.inference_mode():
            for state in states:
                for profile, total in zip(profiles, totals):
                    ready = prepare(model, state.batch, lambda: handle.cache_for(profile), profile.method.draft)
                    nll = teacher_forced_nll(model, ready.cache, ready.first_logits, state.batch, state.references, on_step)
                    total.add(nll, state.references.scored)
                    del ready
    finally:
        handle.detach()
    return [total.ppl() for total in totals]


def full_ppl(states: Sequence[PromptState]) -> PromptMeanNll:
    """The full cache's NLL on the same references (measured while they were generated), in the
    recipe search's measure."""
    total = PromptMeanNll()
    for state in states:
        total.add(state.references.nll_full, state.references.scored)
    return total


def reference_steps(states: Sequence[PromptState]) -> int:
    """Teacher-forced steps one recipe takes over `states` (the progress unit)."""
    return sum(max(state.references.steps - 1, 0) for state in states)
