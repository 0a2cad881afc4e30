"""Per-layer ratios for a budget from priority curves: the one rule calibration and re-budgeting share.

A profile re-derived for another budget (``load_profile(path, budget=0.3)``) must come out as if it
had been calibrated at that budget from the same samples, so both paths go through
``solve_ratios`` with the same floor.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvtool.profiles.allocation import Allocation, solve_retention
from kvtool.errors import KvtoolError
from kvtool.profiles.loss_budget import solve_by_loss
from kvtool.profiles.schema import Profile

# No layer goes below this kept fraction (or the budget, if smaller): a layer whose importance
# looks concentrated still needs room for its sinks and recent window, which sit inside its share.
MIN_RATIO = 0.02


def floor_for(budget: float) -> float:
    return min(MIN_RATIO, budget)


def stored_p(p: float) -> float | None:
    """The retention level as a profile stores it: a budget at the floor reaches no level at all."""
    return p if p > 0.0 else None


def solve_ratios(curves: np.ndarray, budget: float) -> Allocation:
    """Retention level and per-layer ratios (mean == budget) for mean curves ``[Lc, points]``."""
    return solve_retention(curves, budget, min_ratio=floor_for(budget))


def rebudget_ratios(
    profile: Profile, budget: float, source: str = "profile", *, importance_curves: bool = False
) -> tuple[Profile, Allocation]:
    """The profile with its compressing layers' ratios re-derived for `budget` from its stored priority
    curves (their mean ratio is `budget`), sliding layers untouched. Callers re-budget a profile with
    `whole_cache.rebudget`, which sends a hybrid profile's whole cache elsewhere and others here.

    The curves are the profile's scorer's (`scorer_curve` where the layers have one, else
    `priority_curve`), or for the `measured` ratio source each layer's `loss_curve`;
    `importance_curves` solves on the attention-sum curves (`priority_curve`, PrefixKV's) instead and
    drops the scorer's. Measurements tied to the old budget (spread across
    samples, PPLs) are dropped rather than carried over as if they held for the new one;
    `retention_p` is the new level.
    """
    new_budget = float(budget)  # checked once, by whole_cache.rebudget
    compress = [i for i, layer in enumerate(profile.layers) if layer.compress]
    if profile.method.ratios == "uniform" and not importance_curves:
        return _uniform(profile, new_budget, compress)
    if profile.method.ratios == "measured" and not importance_curves:
        return _measured(profile, new_budget, compress, source)
    use_scorer = not importance_curves and any(profile.layers[i].scorer_curve for i in compress)
    curve_of = (lambda layer: layer.scorer_curve) if use_scorer else (lambda layer: layer.priority_curve)
    missing = [i for i in compress if not curve_of(profile.layers[i])]
    if not compress:
        raise KvtoolError(f"{source}: no layer is compressed, so there is nothing to re-budget")
    if missing:
        raise KvtoolError(
            f"{source}: layer {missing[0]} has no priority curve, so its ratios cannot be re-derived "
            f"for budget {new_budget:g}; calibrate for that budget instead (kvtool calibrate MODEL --budget {new_budget:g})"
        )
    lengths = {len(curve_of(profile.layers[i])) for i in compress}
    if len(lengths) != 1:
        raise KvtoolError(f"{source}: the layers' priority curves have different lengths {sorted(lengths)}")
    curves = np.array([curve_of(profile.layers[i]) for i in compress], dtype=np.float64)
    try:
        allocation = solve_ratios(curves, new_budget)
    except ValueError as exc:
        raise KvtoolError(f"{source}: stored priority curves are unusable ({exc})") from None
    layers = list(profile.layers)
    for i, ratio in zip(compress, allocation.ratios):
        # The spread and the kept image share were measured at the old ratios: not carried over.
        layers[i] = dataclasses.replace(layers[i], ratio=float(ratio), ratio_std=None, image_share=None)
        if importance_curves:
            layers[i] = dataclasses.replace(layers[i], scorer_curve=None)
    calibration = _at_new_budget(profile.calibration, stored_p(allocation.p))
    updated = dataclasses.replace(profile, budget=new_budget, layers=tuple(layers), calibration=calibration)
    return updated, allocation


def _uniform(profile: Profile, budget: float, compress: list[int]) -> tuple[Profile, Allocation]:
    """A profile whose recipe takes the same ratio in every layer, at another budget."""
    if not compress:
        raise KvtoolError("profile: no layer is compressed, so there is nothing to re-budget")
    layers = list(profile.layers)
    for i in compress:
        layers[i] = dataclasses.replace(layers[i], ratio=budget, ratio_std=None, image_share=None)
    calibration = _at_new_budget(profile.calibration, None)
    allocation = Allocation(p=float("nan"), ratios=np.full(len(compress), budget), iterations=0)
    return dataclasses.replace(profile, budget=budget, layers=tuple(layers), calibration=calibration), allocation


def _measured(profile: Profile, budget: float, compress: list[int], source: str) -> tuple[Profile, Allocation]:
    """A profile whose ratios come from its layers' measured loss curves, at another budget."""
    if not compress:
        raise KvtoolError(f"{source}: no layer is compressed, so there is nothing to re-budget")
    points = profile.loss_ratios
    missing = [i for i in compress if not profile.layers[i].loss_curve]
    if not points or missing:
        raise KvtoolError(
            f"{source}: its ratios come from measured loss, but {'the measured fractions are' if not points else f'layer {missing[0]} has no loss curve'} "
            f"missing; calibrate for budget {budget:g} instead (kvtool calibrate MODEL --budget {budget:g})"
        )
    bad = [i for i in compress if len(profile.layers[i].loss_curve) != len(points)]
    if bad:
        raise KvtoolError(f"{source}: layer {bad[0]}'s loss curve has {len(profile.layers[bad[0]].loss_curve)} points, not one per measured fraction ({len(points)})")
    curves = np.array([profile.layers[i].loss_curve for i in compress], dtype=np.float64)
    ratios = solve_by_loss(curves, tuple(points), budget)
    layers = list(profile.layers)
    for i, ratio in zip(compress, ratios):
        layers[i] = dataclasses.replace(layers[i], ratio=float(ratio), ratio_std=None, image_share=None)
    calibration = _at_new_budget(profile.calibration, None)
    allocation = Allocation(p=float("nan"), ratios=ratios, iterations=0)
    return dataclasses.replace(profile, budget=budget, layers=tuple(layers), calibration=calibration), allocation


def _at_new_budget(calibration, retention_p):
    """The calibration record with what was measured at the old budget dropped (PPLs, the recipe
    table) and the new retention level."""
    if calibration is None:
        return None
    return dataclasses.replace(
        calibration, retention_p=retention_p, truncation_ppl={}, ppl_compressed=None,
        recipes=None, held_out_ppl_full=None, chosen_on=None, confirmed_on=None,
    )
