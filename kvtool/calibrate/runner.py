"""`calibrate()`: from a model and prompts to a profile (PrefixKV ratios + a tuned truncation distance).

The steps, in order: load the model and encode the drawn prompts; the full pass (importance and
references, `passes.full_pass`); the ratios (`build.allocate`) and the profile they make; the D x
merge-mode search on the recorded prompt states (`passes.search_truncation_and_merge`); the record
of the run; the file.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.profiles.allocation import Allocation
from kvtool.profiles.budget import check_budget
from kvtool.calibrate.build import allocate, build_profile, with_calibration, with_method
from kvtool.calibrate.config import CalibrateConfig
from kvtool.calibrate.passes import Progress, full_pass, no_progress, search_truncation_and_merge
from kvtool.calibrate.statistics import ImportanceStats, kept_image_share
from kvtool.calibrate.truncation import TruncationResult
from kvtool.data import Record, load_jsonl, select_samples
from kvtool.files import check_writable
from kvtool.models.loader import as_loaded
from kvtool.profiles import Profile, fingerprint_of, save_profile
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
    inputs and seed give the same profile, apart from `created` and the recorded
    `calibration.seconds`. Bad input is a one-line KvtoolError, found before the model is loaded.
    """
    started = time.perf_counter()
    budget = check_budget(budget)
    config = replace(config or CalibrateConfig(), **settings).checked()
    dest = check_writable(out) if out is not None else None
    records = tuple(data) if isinstance(data, Sequence) and not isinstance(data, str) else load_jsonl(data)
    chosen = select_samples(records, config.samples, config.seed)
    report = progress or no_progress

    loaded = as_loaded(model, "calibrate")
    method = config.method
    batches, answers = encode_batches(
        loaded, chosen, max_tokens=config.max_prompt_tokens, method=method, batch_size=config.batch_size
    )
    measured = full_pass(
        loaded.model, loaded.tokenizer, batches, answers, method,
        reference_tokens=config.reference_tokens, with_references=bool(config.candidates), progress=report,
    )
    allocated = allocate(measured.stats, budget)
    image_share = kept_image_share(measured.images, dict(zip(measured.stats.layers, allocated.allocation.ratios)), method)
    profile = build_profile(fingerprint_of(loaded.model, name=loaded.name), budget, method, measured.stats, allocated, image_share)

    truncation, merge_ppl = None, {}
    if config.candidates:
        search = search_truncation_and_merge(
            loaded.model, profile, measured.states, config.candidates, config.merge_modes, progress=report
        )
        truncation, merge_ppl = search.truncation, search.merge_ppl
        profile = with_method(profile, merge=search.merge, truncation_distance=truncation.best)
    seconds = time.perf_counter() - started
    profile = with_calibration(profile, chosen, measured.stats, allocated.allocation, truncation, config.seed, seconds)
    if dest is not None:
        save_profile(profile, dest)
    return CalibrationResult(
        profile=profile,
        stats=measured.stats,
        allocation=allocated.allocation,
        per_sample_ratios=allocated.per_sample,
        truncation=truncation,
        samples=chosen,
        seconds=seconds,
        path=dest,
        merge_ppl=merge_ppl,
    )
