"""Which calibrated profile a command runs with: one rule for `generate`, `bench` and `eval`.

The same budget must mean the same cache in every command, so all of them ask here:
1. `--profile PATH`: that profile (its ratios re-derived for the budget when another is asked);
2. else the model's built-in profile nearest the budget, re-derived for it when not exact;
3. else a calibration on the packaged calibration prompts, made now and announced.
Budget 1.0 keeps everything, so it needs no calibration: every layer keeps all its entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.calibration.runner import calibrate
from kvtool.profiles import Profile
from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.whole_cache import rebudget
from kvtool.profiles.builtin import builtin_profiles
from kvtool.runtime import load_profile, uniform_profile

Notify = Callable[[str], None]
Progress = Callable[[str, int, int], None]

# Without a built-in profile, calibrate once at the budget nearest this one and re-derive the rest
# (how the built-in profiles serve other budgets too).
CALIBRATION_ANCHOR = 0.2


@dataclass(frozen=True)
class ChosenProfile:
    profile: Profile  # at the budget asked for
    source: str  # one line saying where it came from, for the user


def choose_profiles(
    loaded: Any,
    budgets: Sequence[float],
    *,
    profile_path: str | Path | None = None,
    calibrate_missing: bool = True,
    progress: Progress | None = None,
    notify: Notify | None = None,
) -> dict[float, ChosenProfile]:
    """The calibrated profile for each budget, by the rule in this module's docstring.

    With `calibrate_missing` False, budgets that would need a calibration are left out instead.
    """
    budgets = [check_budget(b) for b in budgets]
    if profile_path is not None:
        base = load_profile(profile_path)
        return {b: _at(base, b, f"profile {profile_path}") for b in budgets}
    chosen: dict[float, ChosenProfile] = {}
    shipped = {path.name: load_profile(path) for path in builtin_profiles(loaded.name)}
    for budget in budgets:
        if budget >= 1.0:
            chosen[budget] = ChosenProfile(uniform_profile(loaded.model, 1.0), "budget 1: every entry kept")
        elif shipped:
            name, base = min(shipped.items(), key=lambda item: (abs(item[1].budget - budget), item[1].budget))
            chosen[budget] = _at(base, budget, f"built-in {name}")
    missing = [b for b in budgets if b not in chosen]
    if missing and calibrate_missing:
        anchor = min(missing, key=lambda b: (abs(b - CALIBRATION_ANCHOR), b))
        (notify or (lambda line: None))(
            f"no calibrated profile for {loaded.name}: calibrating on the packaged calibration prompts at budget "
            f"{anchor:g} first (save one with `kvtool calibrate {loaded.name} --budget {anchor:g}` and pass --profile)"
        )
        base = calibrate(loaded, anchor, progress=progress).profile
        for budget in missing:
            chosen[budget] = _at(base, budget, "calibrated now on the packaged prompts")
    return chosen


def choose_profile(loaded: Any, budget: float, **kwargs: Any) -> ChosenProfile:
    (chosen,) = choose_profiles(loaded, [budget], **kwargs).values()
    return chosen


def _at(base: Profile, budget: float, where: str) -> ChosenProfile:
    if budget == base.budget:
        return ChosenProfile(base, f"{where} (budget {budget:g})")
    profile, _ = rebudget(base, budget, source=where)
    return ChosenProfile(profile, f"{where} for budget {base.budget:g}, ratios re-derived for budget {budget:g}")
