"""`calibrate()`: from a model and prompts to a profile (PrefixKV ratios + a tuned truncation distance).

Per batch of prompts, one prompt forward through a budget-1.0 kvtool cache (exactly the full cache)
records every compressing layer's importance and leaves the full cache behind, from which the
reference continuations and their full-cache NLL are generated. The curves of all samples give
the ratios (solved on the sample-mean curves, spread from per-sample solutions). The truncation
search then compresses each batch's recorded prompt state with the calibrated plans (no second
prompt forward) and teacher-forces the references through copies of it, one per candidate D.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.profiles.allocation import Allocation, solve_from_samples
from kvtool.calibrate.batches import Batch, Encoded, encode_prompt, make_batches
from kvtool.profiles.budget import check_budget, floor_for, solve_ratios, stored_p
from kvtool.calibrate.data import Record, dataset_hash, load_jsonl, select_samples
from kvtool.profiles.lorenz import mean_curve
from kvtool.calibrate.statistics import (
    ImportanceStats,
    LayerImportance,
    PromptImages,
    batch_stats,
    combine,
    kept_image_share,
)
from kvtool.calibrate.truncation import (
    DEFAULT_CANDIDATES,
    REFERENCE_TOKENS,
    References,
    TruncationResult,
    TruncationScores,
    compress_recorded_prompt,
    reference_continuations,
    score_candidates,
)
from kvtool.errors import KvtoolError
from kvtool.files import check_writable
from kvtool.models.loader import eos_token_ids
from kvtool.profiles import (
    MERGE_MODES,
    CalibrationInfo,
    LayerProfile,
    MethodSettings,
    Profile,
    PromptStats,
    fingerprint_of,
    save_profile,
)

# Stage names reported to `progress(stage, done, total)`.
STAGE_IMPORTANCE = "importance"
STAGE_REFERENCES = "references"
STAGE_TRUNCATION = "truncation"

Progress = Callable[[str, int, int], None]

DEFAULT_SAMPLES = 10
DEFAULT_MAX_PROMPT_TOKENS = 1024
# All default samples in one batch: per-token steps cost about the same for 1 row as for 10.
DEFAULT_BATCH_SIZE = 10
# Merge modes the D search also tries: Elastic Cache's bucket mean and plain eviction (PrefixKV).
DEFAULT_MERGE_MODES = ("position", "none")


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


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def default_out_path(model_name: str, budget: float) -> Path:
    """`profiles/<model>-b<budget>.yaml`, the model reduced to a file-name-safe last component."""
    base = model_name.rstrip("/\\")
    stem = Path(base).stem if base.lower().endswith(".gguf") else Path(base).name
    stem = stem.replace(os.sep, "-").replace("/", "-") or "model"
    return Path("profiles") / f"{stem}-b{budget:g}.yaml"


def _validate_options(samples: int, max_prompt_tokens: int, method: MethodSettings, candidates: Sequence[int]) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise KvtoolError(f"samples must be a positive integer, got {samples!r}")
    protected = method.sink_tokens + method.recent_window
    if max_prompt_tokens <= protected:
        raise KvtoolError(
            f"max-prompt-tokens must exceed the {protected} protected tokens "
            f"({method.sink_tokens} sink + {method.recent_window} recent), got {max_prompt_tokens}"
        )
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in candidates):
        raise KvtoolError(f"truncation distances must be integers >= 0, got {list(candidates)}")


def encode_samples(
    tokenizer: Any,
    samples: Sequence[Record],
    max_tokens: int,
    method: MethodSettings,
    *,
    processor: Any = None,
    model: Any = None,
    name: str = "the model",
) -> list[Encoded]:
    """Each sample's prompt as the model sees it; samples with images go through `processor`.

    Text prompts over `max_tokens` are cut in the middle; prompts with images are not cut (an
    image's tokens cannot be split) and are an error instead.
    """
    protected = method.sink_tokens + method.recent_window
    encoded = []
    for index, record in enumerate(samples):
        if record.images:
            item = _encode_with_images(processor, model, name, record, index, max_tokens)
        else:
            item = Encoded(encode_prompt(tokenizer, record.prompt, max_tokens))
        ids = item.ids
        if len(ids) <= protected:
            raise KvtoolError(
                f"{record.describe(index)} is {len(ids)} tokens long as the model sees it, not more than the "
                f"{protected} protected tokens ({method.sink_tokens} sink + {method.recent_window} recent) that "
                "are always kept: nothing to compress; use longer prompts"
            )
        encoded.append(item)
    return encoded


def _encode_with_images(processor: Any, model: Any, name: str, record: Record, index: int, max_tokens: int) -> Encoded:
    from kvtool.models.images import encode_image_prompt, no_image_support

    where = record.where or record.describe(index)
    if processor is None:
        if model is None:
            raise KvtoolError(f"{where}: has \"images\" but no processor was given to encode them")
        raise no_image_support(model.config, name, where)
    ids, extras = encode_image_prompt(processor, record.prompt, record.images, where)
    if len(ids) > max_tokens:
        raise KvtoolError(
            f"{where}: is {len(ids)} tokens with its images, over the {max_tokens}-token prompt limit; prompts with "
            "images are not cut (an image's tokens cannot be split): raise --max-prompt-tokens or shorten the prompt"
        )
    return Encoded(ids, extras)


def encode_answers(tokenizer: Any, samples: Sequence[Record], rows: Sequence[int]) -> list[list[int] | None]:
    return [
        None if samples[r].answer is None else list(tokenizer(samples[r].answer, add_special_tokens=False)["input_ids"])
        for r in rows
    ]


def prompt_forward(model: Any, batch: Batch, cache: Any) -> Any:
    device = model.device
    # Pixel inputs (vision-language prompts) in the model's dtype; index tensors as they are.
    extras = {
        key: value.to(device=device, dtype=model.dtype) if value.is_floating_point() else value.to(device)
        for key, value in batch.extras.items()
    }
    # Only the last position's logits are needed; the full [B, W, vocab] tensor is most of a
    # small model's prompt cost.
    out = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **extras,
    )
    return out.logits[:, -1]


def _recorded(cache: Any) -> dict[int, LayerImportance]:
    return {
        index: LayerImportance(
            importance=layer.prompt_importance.detach().cpu().double().numpy(),
            valid=layer.prompt_valid.detach().cpu().numpy().astype(bool),
        )
        for index, layer in cache.compressing_layers().items()
    }


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


def calibrate(
    model: Any,
    budget: float,
    *,
    data: str | Path | Sequence[Record] | None = None,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    out: str | Path | None = None,
    method: MethodSettings | None = None,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    reference_tokens: int = REFERENCE_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    curve_importance: str = "mean",
    uniform_ratios: bool = False,
    merge_modes: Sequence[str] = DEFAULT_MERGE_MODES,
    progress: Progress | None = None,
) -> CalibrationResult:
    """Calibrate `model` (a spec such as "smollm2", or a LoadedModel) for `budget` (kept fraction).

    `data` is a JSONL path or records (default: the shipped calibration prompts); `samples` of them
    are drawn with `seed`. With `out` the profile is written atomically there (checked writable
    before any model work). An empty `candidates` skips the truncation search (the profile keeps
    the method's D). Same inputs and seed give the same profile, apart from `created` and the
    recorded `calibration.seconds`. `curve_importance` picks the per-token score the Lorenz
    curves are built from ("mean": column sum per row that sees the token, the default; "sum").
    `uniform_ratios` keeps the budget as every layer's ratio (the Elastic Cache baseline).
    `merge_modes` are tried together with every D and the lowest calibration PPL picks the
    profile's merge mode (an empty list, or no D search, keeps `method.merge`).
    """
    started = time.perf_counter()
    budget = check_budget(budget)
    method = method or MethodSettings()
    candidates = tuple(candidates)
    merge_modes = tuple(dict.fromkeys(merge_modes)) or (method.merge,)
    _validate_options(samples, max_prompt_tokens, method, candidates)
    unknown = [m for m in merge_modes if m not in MERGE_MODES]
    if unknown:
        raise KvtoolError(f"unknown merge mode {unknown[0]!r} (known: {', '.join(MERGE_MODES)})")
    if curve_importance not in ("mean", "sum"):
        raise KvtoolError(f"curve importance must be one of mean, sum, got {curve_importance!r}")
    if reference_tokens < 1 or batch_size < 1:
        raise KvtoolError("reference tokens and batch size must be at least 1")
    dest = check_writable(out) if out is not None else None
    records = tuple(data) if isinstance(data, Sequence) and not isinstance(data, str) else load_jsonl(data)
    chosen = select_samples(records, samples, seed)
    report = progress or _no_progress

    loaded = _load(model)
    tokenizer = loaded.tokenizer
    encoded = encode_samples(
        tokenizer, chosen, max_prompt_tokens, method,
        processor=getattr(loaded, "processor", None), model=loaded.model, name=loaded.name,
    )
    batches = make_batches(encoded, batch_size, tokenizer.pad_token_id, model=loaded.model)
    answers = [encode_answers(tokenizer, chosen, batch.rows) for batch in batches]
    measure = _Measurement(loaded.model, tokenizer, method, reference_tokens, report, curve_importance == "mean")

    stats, states = measure.full_pass(batches, answers, with_references=bool(candidates))
    # Same floor as budget.solve_ratios, so re-budgeting a profile reproduces this solution.
    allocation, spread = solve_from_samples(stats.curves, budget, min_ratio=floor_for(budget))
    if uniform_ratios:
        # Elastic Cache's setting: the same ratio everywhere; only D is tuned. A baseline for PrefixKV.
        allocation = Allocation(p=allocation.p, ratios=np.full(len(allocation.ratios), budget), iterations=0)
        spread = np.zeros_like(spread)
    per_sample = np.stack([solve_ratios(sample, budget).ratios for sample in stats.curves])

    fingerprint = fingerprint_of(loaded.model, name=loaded.name)
    image_share = kept_image_share(measure.images, dict(zip(stats.layers, allocation.ratios)), method)
    profile = _build_profile(fingerprint, budget, method, stats, allocation, spread, image_share)
    truncation = None
    merge_ppl: dict[str, float] = {}
    if candidates:
        tried = {}
        for mode in merge_modes:
            trial = dataclasses.replace(profile, method=dataclasses.replace(profile.method, merge=mode))
            stage = STAGE_TRUNCATION if len(merge_modes) == 1 else f"{STAGE_TRUNCATION} ({mode})"
            tried[mode] = measure.truncation_pass(trial, states, candidates, stage=stage)
        merge_ppl = {mode: result.ppl_compressed for mode, result in tried.items()}
        # Ties (nothing ever merged) keep the requested mode.
        best = min(tried, key=lambda mode: (merge_ppl[mode], mode != method.merge))
        truncation = tried[best]
        profile = dataclasses.replace(profile, method=dataclasses.replace(profile.method, merge=best))
        profile = _with_truncation(profile, truncation)
    seconds = time.perf_counter() - started
    profile = _with_calibration(profile, chosen, stats, allocation, truncation, seed, seconds)
    if dest is not None:
        save_profile(profile, dest)
    return CalibrationResult(
        profile=profile,
        stats=stats,
        allocation=allocation,
        per_sample_ratios=per_sample,
        truncation=truncation,
        samples=chosen,
        seconds=seconds,
        path=dest,
        merge_ppl=merge_ppl,
    )


def _load(model: Any) -> Any:
    if isinstance(model, (str, Path)):
        from kvtool.models import load_model

        return load_model(str(model))
    if not all(hasattr(model, attr) for attr in ("model", "tokenizer", "name")):
        raise KvtoolError(f"calibrate needs a model spec or a LoadedModel, got {type(model).__name__}")
    return model


@dataclass(frozen=True)
class _PromptState:
    """What the truncation search needs from a batch's full pass."""

    batch: Batch
    first_logits: Any  # [B, V] logits of the prompt's last position
    full_cache: Any  # deep copy of the budget-1.0 cache right after the prompt forward
    references: References


@dataclass
class _Measurement:
    """The full pass over the batches and the truncation search; holds what both need."""

    model: Any
    tokenizer: Any
    method: MethodSettings
    reference_tokens: int
    progress: Progress
    per_row_mean: bool = True
    # Prompt importance and image mask of each batch with image tokens (for the kept image share).
    images: list[PromptImages] = dataclasses.field(default_factory=list)

    def full_pass(
        self, batches: list[Batch], answers: list[list[list[int] | None]], *, with_references: bool
    ) -> tuple[ImportanceStats, list[_PromptState]]:
        import torch

        from kvtool.runtime import attach, uniform_profile

        samples = sum(len(b.rows) for b in batches)
        importance = _Counter(STAGE_IMPORTANCE, samples, self.progress).start()
        steps = _Counter(STAGE_REFERENCES, len(batches) * (self.reference_tokens - 1), self.progress)
        parts, states = [], []
        eos = eos_token_ids(self.model, self.tokenizer)
        handle = attach(self.model, uniform_profile(self.model, 1.0, self.method))
        try:
            with torch.inference_mode():
                for batch, batch_answers in zip(batches, answers):
                    cache = handle.new_cache(record_importance=True)
                    first_logits = prompt_forward(self.model, batch, cache)
                    parts.append((batch.rows, self._stats(cache)))
                    if cache.image_mask is not None and bool(cache.image_mask.any()):
                        self.images.append(PromptImages.of(cache))
                    importance.step(len(batch.rows))
                    if not with_references:
                        continue
                    # Kept before the references grow the cache: the truncation search compresses
                    # this prompt state instead of running the prompt forward again.
                    snapshot = copy.deepcopy(cache)
                    steps.start()
                    references = reference_continuations(
                        self.model, cache, first_logits, batch,
                        length=self.reference_tokens, eos_ids=eos,
                        pad_id=self.tokenizer.pad_token_id, answers=batch_answers, on_step=steps.step,
                    )
                    states.append(_PromptState(batch, first_logits, snapshot, references))
        finally:
            handle.detach()
        if with_references:
            steps.finish()
        return combine(parts, samples), states

    def _stats(self, cache: Any) -> ImportanceStats:
        return batch_stats(
            _recorded(cache),
            sink_tokens=self.method.sink_tokens,
            recent_window=self.method.recent_window,
            per_row_mean=self.per_row_mean,
        )

    def truncation_pass(
        self, profile: Profile, states: list[_PromptState], candidates: tuple[int, ...], stage: str = STAGE_TRUNCATION
    ) -> TruncationResult:
        import torch

        from kvtool.runtime import attach

        scores = TruncationScores(candidates)
        total = sum(max(state.references.steps - 1, 0) for state in states) * len(candidates)
        steps = _Counter(stage, total, self.progress).start()
        handle = attach(self.model, profile)
        try:
            with torch.inference_mode():
                for state in states:
                    cache = compress_recorded_prompt(handle.new_cache(), state.full_cache, state.batch.attention_mask)
                    scores.full.add(state.references.nll_full, state.references.scored)
                    score_candidates(
                        self.model, cache, state.first_logits, state.batch, state.references, scores, on_step=steps.step
                    )
        finally:
            handle.detach()
        steps.finish()
        return scores.result(default=self.method.truncation_distance)


def _build_profile(
    fingerprint: Any,
    budget: float,
    method: MethodSettings,
    stats: ImportanceStats,
    allocation: Allocation,
    spread: np.ndarray,
    image_share: dict[int, float] | None = None,
) -> Profile:
    from kvtool import __version__

    curves = mean_curve(stats.curves)
    gini = stats.layer_gini()
    position = {layer: j for j, layer in enumerate(stats.layers)}
    layers = []
    for index in range(fingerprint.num_layers):
        j = position.get(index)
        if j is None:
            # Sliding-window layers hold a bounded window already; kvtool leaves them alone.
            layers.append(LayerProfile(ratio=1.0, compress=False))
            continue
        layers.append(
            LayerProfile(
                ratio=float(allocation.ratios[j]),
                compress=True,
                gini=float(gini[j]),
                ratio_std=float(spread[j]),
                priority_curve=tuple(float(v) for v in curves[j]),
                image_share=None if image_share is None else image_share[index],
            )
        )
    return Profile(
        budget=budget,
        model=fingerprint,
        method=method,
        layers=tuple(layers),
        kvtool_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def _with_truncation(profile: Profile, truncation: TruncationResult) -> Profile:
    import dataclasses

    method = dataclasses.replace(profile.method, truncation_distance=truncation.best)
    return dataclasses.replace(profile, method=method)


def _with_calibration(
    profile: Profile,
    samples: Sequence[Record],
    stats: ImportanceStats,
    allocation: Allocation,
    truncation: TruncationResult | None,
    seed: int,
    seconds: float,
) -> Profile:
    import dataclasses

    tokens = stats.prompt_tokens
    info = CalibrationInfo(
        dataset_hash=dataset_hash(samples),
        samples=len(samples),
        prompt_tokens=PromptStats(min=int(tokens.min()), mean=float(tokens.mean()), max=int(tokens.max())),
        retention_p=stored_p(allocation.p),
        truncation_ppl=dict(truncation.ppl) if truncation else {},
        ppl_full=truncation.ppl_full if truncation else None,
        ppl_compressed=truncation.ppl_compressed if truncation else None,
        seed=seed,
        seconds=round(seconds, 1),
    )
    return dataclasses.replace(profile, calibration=info)
