"""`calibrate()`: from a model and prompts to a profile (the recipe, its per-layer ratios, D).

The steps, in order: draw the prompts (spread over their kinds) and split them into the half that
chooses and the half that confirms; the full pass (every scorer's statistics and the references,
`passes.full_pass`); the ratios of each scorer (`build.allocate`) and, when a recipe may take them,
of each layer's measured loss on the choosing half (`layer_loss`, `build.by_loss`); the recipe search on the
recorded prompt states and its confirmation (`search.choose_recipe`), or without a search the D x
merge-mode tuning of the given recipe; the record of the run; the file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.profiles.allocation import Allocation
from kvtool.profiles.kept_fraction import check_budget
from kvtool.calibration.build import allocate, build_profile, by_bytes, by_loss, uniform, with_calibration, with_method
from kvtool.calibration.config import (
    DEFAULT_LONG_PROMPT_TOKENS, DEFAULT_SAMPLES, HYBRID_SAMPLES, LONG_ANSWER_KIND, CalibrateConfig,
)
from kvtool.calibration.cost import affordable_draft
from kvtool.calibration.layer_loss import LayerLosses, measurable, measure_layer_losses
from kvtool.calibration.passes import (
    STAGE_QUERIES, Progress, StageCounter, full_pass, no_progress, scorer_key, search_truncation_and_merge,
)
from kvtool.calibration.queries import QueryRecorder, record_query_stats
from kvtool.calibration.recipes import seed_recipes, stage_options
from kvtool.calibration.statistics import ImportanceStats, kept_image_share
from kvtool.calibration.truncation import TruncationResult
from kvtool.calibration.search import ChosenRecipe, choose_recipe
from kvtool.calibration.storage import AS_SEARCHED, choose_storage, search_level
from kvtool.calibration.windows import WindowChoice, choose_windows
from kvtool.data import Record, load_jsonl, select_by_kind, select_samples, split_by_kind
from kvtool.data.long_prompts import long_prompts
from kvtool.errors import KvtoolError
from kvtool.files import check_writable
from kvtool.models.loader import as_loaded
from kvtool.models.queries import unsupported
from kvtool.profiles import MethodSettings, Profile, fingerprint_of, save_profile, whole_cache
from kvtool.profiles.schema import QUERY_SCORERS
from kvtool.runtime.eviction import EVICT_RULES
from kvtool.runtime.layer.latent import latent_expanders
from kvtool.runtime.layer.limits import draft_refusal
from kvtool.runtime.precision import KVStorage, check_storage, native_bytes
from kvtool.scoring import encode_batches


@dataclass(frozen=True)
class CalibrationResult:
    """Everything a calibration run measured; `profile` is what gets written."""

    profile: Profile
    stats: ImportanceStats
    allocation: Allocation  # over the compressing layers (stats.layers)
    per_sample_ratios: np.ndarray  # [S, Lc] each sample solved on its own at the same budget
    truncation: TruncationResult | None  # None when the search was skipped
    samples: tuple[Record, ...]
    seconds: float
    path: Path | None
    # Calibration PPL at the best D of every merge mode tried; the lowest one is the profile's.
    merge_ppl: dict[str, float] = field(default_factory=dict)
    # The recipe search and its confirmation; None when the run kept the given recipe.
    recipes: ChosenRecipe | None = None
    # Hybrid models: the sliding windows tried and the split shipped (calibrate.windows); None elsewhere.
    windows: WindowChoice | None = None
    # Each compressing layer's measured loss (calibration.layer_loss), when a recipe could take its
    # ratios from it; None otherwise.
    losses: LayerLosses | None = None
    # What the run changed of its settings because the model's layers cannot do it (one line each,
    # also logged): e.g. no draft on a model whose layers keep a draft's rows.
    notes: tuple[str, ...] = ()


def queried(settings: MethodSettings) -> bool:
    """Whether a recipe reads per-head query statistics (its scorer, or its generation rule)."""
    return settings.scorer in QUERY_SCORERS or EVICT_RULES[settings.eviction].needs_queries


def exact_answers(records: Sequence[Record]) -> tuple[Record, ...]:
    """Records whose exact `answers` (retrieval needles) become their reference, joined as a list
    and forced right after the prompt: the recipe search then measures whether those facts survive
    the prompt's compression, not the model's wording around them (records with an `answer`, or
    none, stay as they are)."""
    return tuple(
        replace(r, answer=", ".join(r.answers)) if r.answers and r.answer is None else r for r in records
    )


def draw(records: Sequence[Record], config: CalibrateConfig) -> tuple[tuple[Record, ...], tuple[Record, ...], tuple[Record, ...]]:
    """The prompts a run with `config` draws from `records`: (all of them as drawn, in order; the
    half that chooses the recipe; the half that confirms it). With a recipe search they split by kind
    (one prompt cannot be split) and the halves' retrieval needles become their references; without,
    all are in the first half."""
    space = config.search if config.candidates else None
    samples = config.samples or DEFAULT_SAMPLES
    chosen = select_by_kind(records, samples, config.seed) if space else select_samples(records, samples, config.seed)
    choosing, confirming = split_by_kind(chosen) if space and len(chosen) > 1 else (chosen, ())
    chosen = choosing + confirming
    if space is not None:
        return chosen, exact_answers(choosing), exact_answers(confirming)
    return chosen, choosing, confirming


def encode_halves(
    loaded: Any, choosing: Sequence[Record], confirming: Sequence[Record], config: CalibrateConfig
) -> tuple[list, list, list[int]]:
    """The batches of both halves in order, rows numbered across them, their answers, and each
    batch's reference length. The confirming half's long-answer prompts come first, in batches of
    their own with `long_reference_tokens`-long references: the finalists are judged on answers that
    outlive the compressed prompt. The choosing half scores every prompt on `reference_tokens`: a
    256-token batch there makes every search stage pay its steps (SmolLM2's search took 447 s
    instead of 127 s). The last batch is the confirming half's other prompts, where the prompt
    phase's cost is measured."""
    batches, answers, lengths = [], [], []
    for offset, part, held_out in ((0, choosing, False), (len(choosing), confirming, True)):
        long = [i for i, r in enumerate(part) if held_out and r.kind == LONG_ANSWER_KIND]
        short = [i for i in range(len(part)) if i not in long]
        for group, length in ((long, config.long_reference_tokens), (short, config.reference_tokens)):
            if not group:
                continue
            part_batches, part_answers = encode_batches(
                loaded, [part[i] for i in group], max_tokens=config.max_prompt_tokens, method=config.method,
                batch_size=config.batch_size,
            )
            batches += [replace(b, rows=tuple(offset + group[r] for r in b.rows)) for b in part_batches]
            answers += part_answers
            lengths += [length] * len(part_batches)
    return batches, answers, lengths


def calibrate(
    model: Any,
    budget: float,
    *,
    data: str | Path | Sequence[Record] | None = None,
    out: str | Path | None = None,
    config: CalibrateConfig | None = None,
    progress: Progress | None = None,
    **settings: Any,
) -> CalibrationResult:
    """Calibrate `model` (a spec such as "smollm2", or a LoadedModel) for `budget` (kept fraction).

    `data` is a JSONL path or records (default: the shipped calibration prompts). The run follows
    `config`, with any of its fields given as keywords instead (`samples=3, candidates=()`). With
    `out` the profile is written atomically there (checked writable before any model work). Same
    inputs and seed give the same profile, apart from `created` and the measured
    `calibration.seconds` and `prompt_overhead` (and the draft, if two runs' overheads fall on
    either side of `max_prompt_overhead`). Bad input is a one-line KvtoolError, found before the model is loaded.
    """
    started = time.perf_counter()
    budget = check_budget(budget)
    config = replace(config or CalibrateConfig(), **settings).checked()
    dest = check_writable(out) if out is not None else None
    records = tuple(data) if isinstance(data, Sequence) and not isinstance(data, str) else load_jsonl(data)
    space = config.search if config.candidates else None
    report = progress or no_progress

    loaded = as_loaded(model, "calibrate")
    hybrid = whole_cache.is_hybrid(fingerprint_of(loaded.model))
    config = replace(config, samples=config.samples or (HYBRID_SAMPLES if hybrid else DEFAULT_SAMPLES))
    chosen, choosing, confirming = draw(records, config)
    if hybrid:
        least = whole_cache.floor(fingerprint_of(loaded.model), config.budget_tokens)
        if budget < least:  # before any model work: no split reaches it
            raise KvtoolError(
                f"budget {budget:g} is below what kvtool keeps of this model's cache at {config.budget_tokens} tokens "
                f"(floor {least:.3f}: the shortest sliding windows, full-attention layers at 2%)"
            )
    # Sliding windows matter only past their length: on a hybrid model each drawn prompt sits amid
    # others of the set by default; elsewhere when asked (prompts as long as those users compress).
    tokens = config.long_prompt_tokens or (DEFAULT_LONG_PROMPT_TOKENS if hybrid else None)
    if tokens is not None:
        long = lambda part: long_prompts(part, records, tokens, config.seed)  # noqa: E731
        chosen, choosing, confirming = long(chosen), long(choosing), long(confirming)
        config = replace(config, max_prompt_tokens=max(config.max_prompt_tokens, 2 * tokens))
    method = config.method
    reason = unsupported(loaded.model)
    runnable = () if space is None else tuple(s for s in space.scorers if s not in QUERY_SCORERS)
    if reason is not None and (queried(method) or (space is not None and not runnable)):
        raise KvtoolError(reason)
    if reason is not None and space is not None:  # the search tries every rule this model can run
        space = replace(space, scorers=runnable, evictions=tuple(e for e in space.evictions if not EVICT_RULES[e].needs_queries))
    # Ratios from measured loss: measured on the choosing prompts when the method or the search may use them.
    why_not = measurable(loaded.model)
    if why_not is not None and method.ratios == "measured":
        raise KvtoolError(why_not)
    if space is not None and (why_not is not None or not config.candidates):
        space = replace(space, ratio_sources=tuple(r for r in space.ratio_sources if r != "measured") or (method.ratios,))
    by_measured_loss = method.ratios == "measured" or (space is not None and "measured" in space.ratio_sources)
    storages = [KVStorage.parse(f) for f in config.kv_formats if KVStorage.parse(f).quantized]
    if storages and not config.candidates:
        raise KvtoolError("--kv-formats: the storage stage measures the recipe on references, and this run makes none")
    # Each layer's storage by its measured loss, where asked (`layer_storage`): layer losses are
    # measured on models without sliding layers only. Every model gets the storage stage
    # (`calibration.storage`).
    if config.layer_storage and (hybrid or not by_measured_loss):
        raise KvtoolError(
            "a storage per layer is chosen by each layer's measured loss: "
            + ("models with sliding-window layers get one storage everywhere" if hybrid else "this run measures none (ratios from measured loss)")
        )
    notes = []
    if storages and latent_expanders(loaded.model):
        # MLA caches one latent for every head, which kvtool keeps as the model computes it: a
        # profile with stored entries would be refused at attach, so it keeps the model's own, said in one line.
        notes.append(f"{loaded.model.config.model_type}: latent entries are kept at the model's precision; "
                     f"--kv-formats {','.join(s.name for s in storages)} is not measured")
        storages = []
    per_layer = storages if config.layer_storage else []
    for storage in storages:
        check_storage(storage, fingerprint_of(loaded.model).head_dim, "--kv-formats")
    no_draft = draft_refusal(loaded.model, fingerprint_of(loaded.model).layer_types) if config.draft is not None else None
    if no_draft is not None:  # a profile with it would be refused at attach: it goes without, said in one line
        config = replace(config, draft=None, draft_stage=False)
        notes.append(f"{loaded.model.config.model_type}: {no_draft}; the profile has none")
    if space is not None and latent_expanders(loaded.model):
        # MLA caches one latent for every head: per-head entries are refused at attach.
        space = replace(space, heads=("shared",))
    for note in notes:
        logging.getLogger("kvtool").warning(note)
    if space is not None and fingerprint_of(loaded.model).num_kv_heads == 1:
        # One KV head: per-head entries are the shared ones (Gemma 3 270M's per-head trials measured
        # the shared ones' PPLs to the last digit), so the heads stage would measure them again.
        space = replace(space, heads=(method.heads,))
    batches, answers, lengths = encode_halves(loaded, choosing, confirming, config)
    split = len([b for b in batches if b.rows[0] < len(choosing)])  # the batches that choose

    # Statistics under every scorer the search may reach (window: each window and pool width, the
    # seeds' own, e.g. TOVA's one row), and always attention-sum's: PrefixKV's ratios and the
    # profile's stored curves come from those.
    scorers = (
        replace(method, scorer="attention-sum"), method,
        *((*stage_options("scorer", method, space), *seed_recipes(space, method)) if space else ()),
    )
    # The expected-attention rules read per-head query statistics: learned in the full pass's own
    # prompt forwards, which then scores the prompt states it keeps; a run that keeps none (no
    # references) records them first in a forward of their own.
    queries, recorder = None, None
    with_references = bool(config.candidates)
    if any(queried(s) for s in scorers) or (space is not None and any(EVICT_RULES[e].needs_queries for e in space.evictions)):
        if with_references:
            recorder = QueryRecorder(loaded.model)
        else:
            counter = StageCounter(STAGE_QUERIES, sum(len(b.rows) for b in batches), report).start()
            queries = record_query_stats(loaded.model, batches, on_batch=counter.step)
    measured = full_pass(
        loaded.model, loaded.tokenizer, batches, answers, method,
        reference_tokens=lengths, with_references=with_references, progress=report,
        scorers=scorers, query_stats=queries, queries=recorder,
    )
    queries = measured.query_stats
    fingerprint = fingerprint_of(loaded.model, name=loaded.name)
    importance = measured.stats_by_scorer["attention-sum"]
    # The search runs at the entries the profile will keep (`calibration.storage.search_level`);
    # the storage stage brings its recipe back to the budget's bytes.
    level = search_level(budget, storages, loaded.model, per_layer=bool(per_layer), hybrid=hybrid)
    allocated = {key: allocate(stats, level) for key, stats in measured.stats_by_scorer.items()}
    losses = None
    if by_measured_loss:
        losses = measure_layer_losses(
            loaded.model, measured.states[:split], method, importance.layers, tokens=config.layer_loss_tokens, progress=report,
            storages=[(s.keys, s.values) for s in per_layer],
        )
        allocated["measured"] = (
            by_bytes(losses, budget, fingerprint.head_dim, native_bytes(loaded.model)) if per_layer else by_loss(losses, level)
        )

    def curves_of(settings: MethodSettings) -> str:
        """Whose Lorenz curves give `settings`' ratios (uniform ratios report attention-sum's)."""
        return scorer_key(settings) if settings.ratios == "scorer" else "attention-sum"

    draft = config.draft

    def ratios_of(settings: MethodSettings):
        """The `Allocated` ratios `settings`' ratio source gives."""
        if settings.ratios == "uniform":
            return uniform(allocated["attention-sum"], level)
        return allocated["measured" if settings.ratios == "measured" else curves_of(settings)]

    def profile_for(settings: MethodSettings) -> Profile:
        """The profile of `settings` with the ratios its `ratios` source gives (and the run's draft)."""
        settings = replace(settings, draft=draft)
        source = curves_of(settings)
        ratios = ratios_of(settings)
        kept = dict(zip(importance.layers, ratios.allocation.ratios))
        built = build_profile(
            fingerprint, level, settings, importance, ratios,
            kept_image_share(measured.images, kept, settings),
            scorer_stats=measured.stats_by_scorer[source] if source != "attention-sum" else None,
            losses=losses if settings.ratios == "measured" else None,
        )
        return replace(built, query_stats=queries)

    truncation, merge_ppl, recipes = None, {}, None
    if space is not None:
        recipes = choose_recipe(
            loaded.model, method, space, profile_for, measured.states[:split], measured.states[split:], report,
            with_draft=config.draft_stage,
        )
        profile = profile_for(recipes.shipped)
        truncation = recipes.truncation
    elif config.candidates:
        profile = profile_for(method)
        search = search_truncation_and_merge(
            loaded.model, profile, measured.states, config.candidates, config.merge_modes, progress=report
        )
        truncation, merge_ppl = search.truncation, search.merge_ppl
        profile = with_method(profile, merge=search.merge, truncation_distance=truncation.best)
    else:
        profile = profile_for(method)
    windows = None
    if hybrid:
        windows = choose_windows(
            loaded.model, profile, budget, config.budget_tokens, measured.states[:split], measured.states[split:], report
        )
        profile = windows.profile
    stored = None
    if storages:  # the bytes spent on every layer at one format, against the search's own profile
        stored = choose_storage(loaded.model, profile, storages, budget, measured.states[:split], measured.states[split:], report)
        profile = stored.profile
    # The prompt phase the profile will cost, on the last batch (the held-out prompts where there are
    # two halves); a draft over the limit gives way to the next cheaper one that fits.
    costs = affordable_draft(loaded.model, profile, batches[-1:], config.max_prompt_overhead, progress=report)
    profile = replace(profile, method=replace(profile.method, draft=costs[-1].draft))
    seconds = time.perf_counter() - started
    source = curves_of(profile.method)
    chosen_stats = measured.stats_by_scorer[source]
    shipped = allocated["measured" if profile.method.ratios == "measured" else source]
    allocation = shipped.allocation
    profile = with_calibration(profile, chosen, importance, allocation, truncation, config.seed, seconds, recipes)
    if stored is not None:
        picked = stored.shipped
        # A format's entries were re-derived to the bytes (`precision.at_storage`): the search's level is not theirs.
        switched = picked.storage != AS_SEARCHED
        profile = replace(profile, calibration=replace(
            profile.calibration, storages=stored.trials, ppl_compressed=picked.ppl,
            retention_p=None if switched else profile.calibration.retention_p,
        ))
    profile = replace(profile, calibration=replace(
        profile.calibration, prompt_overhead=round(costs[-1].ratio, 3), max_prompt_overhead=config.max_prompt_overhead,
        window_ppl=windows.ppl if windows is not None and windows.ppl else None,
    ))
    if not queried(profile.method):
        profile = replace(profile, query_stats=None)  # nothing reads them: no sidecar
    if dest is not None:
        save_profile(profile, dest)
    return CalibrationResult(
        profile=profile,
        stats=chosen_stats,
        allocation=allocation,
        per_sample_ratios=shipped.per_sample,
        truncation=truncation,
        samples=chosen,
        seconds=seconds,
        path=dest,
        merge_ppl=merge_ppl,
        recipes=recipes,
        windows=windows,
        losses=losses,
        notes=tuple(notes),
    )
