"""From measured statistics to a profile: the per-layer ratios, then the profile that records them,
the searched D and merge mode, and what the calibration ran on."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.version import __version__
from kvtool.profiles.allocation import Allocation, solve_from_samples
from kvtool.profiles.budget import floor_for, solve_ratios, stored_p
from kvtool.profiles.lorenz import mean_curve
from kvtool.profiles.byte_budget import solve_by_bytes
from kvtool.profiles.loss_budget import clean_curves, solve_by_loss
from kvtool.profiles.schema import WINDOW_SCORERS
from kvtool.calibration.layer_loss import LayerLosses
from kvtool.calibration.statistics import ImportanceStats
from kvtool.calibration.recipes import recipe_key
from kvtool.calibration.search import ChosenRecipe
from kvtool.calibration.truncation import TruncationResult
from kvtool.data import Record, dataset_hash
from kvtool.profiles import CalibrationInfo, LayerProfile, MethodSettings, Profile, PromptStats, RecipeTrial


@dataclass(frozen=True)
class Allocated:
    """The ratios of the compressing layers (stats.layers) at one budget."""

    allocation: Allocation  # solved on the sample-mean curves
    spread: np.ndarray  # [Lc] std of the per-sample solutions
    per_sample: np.ndarray  # [S, Lc] each sample solved on its own at the same budget
    # Each layer's (keys, values) storage when the budget was spent in bytes (`by_bytes`); None: native.
    storages: tuple[tuple[str, str], ...] | None = None
    native_bytes: int | None = None


def allocate(stats: ImportanceStats, budget: float) -> Allocated:
    """PrefixKV's ratios on the sample-mean curves, with their spread across the samples."""
    # Same floor as budget.solve_ratios, so re-budgeting a profile reproduces this solution.
    allocation, spread = solve_from_samples(stats.curves, budget, min_ratio=floor_for(budget))
    per_sample = np.stack([solve_ratios(sample, budget).ratios for sample in stats.curves])
    return Allocated(allocation=allocation, spread=spread, per_sample=per_sample)


def uniform(allocated: Allocated, budget: float) -> Allocated:
    """The budget in every compressing layer (no spread): the `uniform` ratio source."""
    ratios = np.full_like(allocated.allocation.ratios, budget)
    return Allocated(
        allocation=dataclasses.replace(allocated.allocation, ratios=ratios),
        spread=np.zeros_like(allocated.spread),
        per_sample=np.full_like(allocated.per_sample, budget),
    )


def by_loss(losses: LayerLosses, budget: float) -> Allocated:
    """The `measured` ratio source: the ratios of least summed loss on the prompts' mean curves, with
    the spread of each prompt's own solution."""
    ratios = solve_by_loss(losses.curves, losses.ratios, budget)
    per_sample = np.stack([solve_by_loss(clean_curves(deltas), losses.ratios, budget) for deltas in losses.deltas])
    return Allocated(
        allocation=Allocation(p=float("nan"), ratios=ratios, iterations=0),
        spread=per_sample.std(axis=0), per_sample=per_sample,
    )


def by_bytes(losses: LayerLosses, budget: float, head_dim: int, native: int) -> Allocated:
    """The `measured` ratio source spending bytes: each layer's storage and ratio of least summed
    measured loss within `budget` of the full bytes (`profiles.byte_budget.solve_by_bytes`), over the
    storages whose losses were measured and the model's own."""
    floor = min(losses.ratios[0], budget)

    def solve(native_curve: np.ndarray, stored: dict) -> tuple[np.ndarray, list]:
        curves = {("native", "native"): native_curve, **stored}
        points = {("native", "native"): losses.ratios, **{s: losses.stored_ratios for s in stored}}
        return solve_by_bytes(curves, points, head_dim, native, budget, floor=floor)

    ratios, storages = solve(losses.curves, {s: losses.stored_curves(s) for s in losses.stored})
    per_sample = np.stack([
        solve(clean_curves(losses.deltas[i]), {s: clean_curves(d[i]) for s, d in losses.stored.items()})[0]
        for i in range(losses.deltas.shape[0])
    ])
    return Allocated(
        allocation=Allocation(p=float("nan"), ratios=ratios, iterations=0),
        spread=per_sample.std(axis=0), per_sample=per_sample, storages=tuple(storages), native_bytes=native,
    )


def build_profile(
    fingerprint: Any,
    budget: float,
    method: MethodSettings,
    stats: ImportanceStats,
    allocated: Allocated,
    image_share: dict[int, float] | None = None,
    *,
    scorer_stats: ImportanceStats | None = None,
    losses: LayerLosses | None = None,
) -> Profile:
    """The profile of `allocated`'s ratios with `method`'s settings (D and merge mode as given).

    `stats` are the attention-sum statistics (PrefixKV's curves and Gini, always recorded);
    `scorer_stats` those of `method.scorer` when it is another, whose curves the ratios were solved
    on (stored as each layer's `scorer_curve`, so re-budgeting solves on them too); `losses` the
    measured layer losses the ratios were solved on (each layer's `loss_curve`, likewise)."""
    curves = mean_curve(stats.curves)
    scorer_curves = None if scorer_stats is None else mean_curve(scorer_stats.curves)
    gini = stats.layer_gini()
    loss_curves = None if losses is None else losses.curves
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
                ratio=float(allocated.allocation.ratios[j]),
                compress=True,
                gini=float(gini[j]),
                ratio_std=float(allocated.spread[j]),
                priority_curve=tuple(float(v) for v in curves[j]),
                image_share=None if image_share is None else image_share[index],
                scorer_curve=None if scorer_curves is None else tuple(float(v) for v in scorer_curves[j]),
                loss_curve=None if losses is None else tuple(float(v) for v in loss_curves[losses.layers.index(index)]),
                keys_format=allocated.storages[j][0] if allocated.storages else "native",
                values_format=allocated.storages[j][1] if allocated.storages else "native",
            )
        )
    quantized = bool(allocated.storages) and any(s != ("native", "native") for s in allocated.storages)
    return Profile(
        budget=budget,
        model=fingerprint,
        method=method,
        layers=tuple(layers),
        kvtool_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        loss_ratios=None if losses is None else losses.ratios,
        native_bytes=allocated.native_bytes if quantized else None,
    )


def with_method(profile: Profile, *, merge: str, truncation_distance: int) -> Profile:
    """`profile` with the merge mode and D the search chose."""
    method = dataclasses.replace(profile.method, merge=merge, truncation_distance=truncation_distance)
    return dataclasses.replace(profile, method=method)


def with_calibration(
    profile: Profile,
    samples: Sequence[Record],
    stats: ImportanceStats,
    allocation: Allocation,
    truncation: TruncationResult | None,
    seed: int,
    seconds: float,
    recipes: ChosenRecipe | None = None,
) -> Profile:
    """`profile` with the record of its calibration: data, retention p, the D search's PPLs, and
    the recipe search's table."""
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
    if recipes is not None:
        drafted = recipes.drafted
        info = dataclasses.replace(
            info,
            ppl_full=recipes.ppl_full,
            ppl_compressed=recipes.search.ppl_of(recipes.shipped),
            fell_back=True if recipes.fell_back else None,
            chosen_on=recipes.chosen_on,
            confirmed_on=recipes.confirmed_on or None,
            held_out_ppl_full=recipes.held_out_ppl_full,
            recipes=tuple(
                RecipeTrial(
                    stage=t.stage, scorer=t.settings.scorer, heads=t.settings.heads, eviction=t.settings.eviction,
                    recent_share=t.settings.recent_share, merge=t.settings.merge,
                    truncation_distance=t.settings.truncation_distance, ppl=t.ppl, ratios=t.settings.ratios,
                    window=t.settings.window if t.settings.scorer in WINDOW_SCORERS else None,
                    pool=t.settings.pool if t.settings.scorer in WINDOW_SCORERS else None,
                    window_share=t.settings.window_share if t.settings.scorer == "union" else None,
                    selection=t.settings.selection,
                    held_out_ppl=recipes.held_out.get(recipe_key(t.settings)),
                    drafted_ppl=drafted.choosing.get(recipe_key(t.settings)) if drafted else None,
                    drafted_held_out_ppl=drafted.held_out.get(recipe_key(t.settings)) if drafted else None,
                )
                for t in recipes.search.trials
            ),
        )
    return dataclasses.replace(profile, calibration=info)
