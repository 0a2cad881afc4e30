"""Calibration PPL of per-layer ratios from `mean` and `sum` curves vs the same ratio everywhere.

    .venv/bin/python benchmarks/calibration_curves.py --model smollm2 --budget 0.2

Same prompts (the packaged calibration set, 10 samples, seed 0), same full-cache references, same
D candidates and merge modes: the teacher-forced PPL of each candidate D and the best one, per
allocation. In-sample calibration figures, not an evaluation on held-out prompts.

`mean` curves are what `kvtool calibrate` uses (each token's column sum divided by the rows that
see it). The other two are ablations built here from calibration's steps, on the same full pass:
`sum` curves from the plain column sums the full pass recorded, and `uniform` (Elastic Cache's
setting) the budget as every layer's ratio.

Feeds docs/methods.md "Per-layer ratios (PrefixKV)": why the curves use the per-row mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.models import load_model, use_offline_defaults

use_offline_defaults()  # before the imports below load transformers, which reads them once

from kvtool.calibration.build import Allocated, allocate, build_profile, with_method  # noqa: E402
from kvtool.calibration.config import DEFAULT_SAMPLES, CalibrateConfig  # noqa: E402
from kvtool.calibration.passes import FullPass, full_pass, recorded_importance, search_truncation_and_merge  # noqa: E402
from kvtool.calibration.statistics import ImportanceStats, batch_stats, combine, kept_image_share  # noqa: E402
from kvtool.data import load_jsonl, select_samples  # noqa: E402
from kvtool.profiles import fingerprint_of  # noqa: E402
from kvtool.scoring import encode_batches  # noqa: E402


def sum_curve_stats(measured: FullPass, config: CalibrateConfig) -> ImportanceStats:
    """The full pass's statistics again, from plain column sums (no division by the rows that see a token)."""
    method = config.method
    parts = [
        (
            state.batch.rows,
            batch_stats(
                recorded_importance(state.full_cache),
                sink_tokens=method.sink_tokens, recent_window=method.recent_window, per_row_mean=False,
            ),
        )
        for state in measured.states
    ]
    return combine(parts, len(measured.stats.prompt_tokens))


def uniform(allocated: Allocated, budget: float) -> Allocated:
    ratios = np.full(len(allocated.allocation.ratios), budget)
    return Allocated(
        allocation=dataclasses.replace(allocated.allocation, ratios=ratios, iterations=0),
        spread=np.zeros_like(allocated.spread),
        per_sample=allocated.per_sample,
    )


def compare(loaded: Any, budget: float, config: CalibrateConfig, data: Path | None = None) -> dict[str, dict]:
    """Per allocation: calibration PPL by D, the best D and merge mode, and the ratios."""
    config = config.checked()
    chosen = select_samples(load_jsonl(data), config.samples or DEFAULT_SAMPLES, config.seed)
    batches, answers = encode_batches(
        loaded, chosen, max_tokens=config.max_prompt_tokens, method=config.method, batch_size=config.batch_size
    )
    measured = full_pass(
        loaded.model, loaded.tokenizer, batches, answers, config.method,
        reference_tokens=config.reference_tokens, with_references=True,
    )
    mean_stats = measured.stats
    sum_stats = sum_curve_stats(measured, config)
    runs = {
        "prefixkv-mean-curves": (mean_stats, allocate(mean_stats, budget)),
        "prefixkv-sum-curves": (sum_stats, allocate(sum_stats, budget)),
        "uniform": (mean_stats, uniform(allocate(mean_stats, budget), budget)),
    }
    fingerprint = fingerprint_of(loaded.model, name=loaded.name)
    report = {}
    for name, (stats, allocated) in runs.items():
        image_share = kept_image_share(measured.images, dict(zip(stats.layers, allocated.allocation.ratios)), config.method)
        profile = build_profile(fingerprint, budget, config.method, stats, allocated, image_share)
        search = search_truncation_and_merge(loaded.model, profile, measured.states, config.candidates, config.merge_modes)
        t = search.truncation
        profile = with_method(profile, merge=search.merge, truncation_distance=t.best)
        report[name] = {
            "ppl_by_D": {d: round(p, 4) for d, p in t.ppl.items()},
            "best_D": t.best,
            "merge": search.merge,
            "ppl": round(t.ppl_compressed, 4),
            "ppl_full": round(t.ppl_full, 4),
            "ratios": [round(r, 3) for r in profile.ratios],
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    args = parser.parse_args()
    print(json.dumps(compare(load_model(args.model), args.budget, CalibrateConfig()), indent=2))


if __name__ == "__main__":
    main()
