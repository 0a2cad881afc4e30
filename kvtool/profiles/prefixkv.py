"""PrefixKV's per-layer ratios for a profile, whatever its own ratios came from.

PrefixKV gives each compressing layer the kept fraction ``R_l(p)`` its attention-sum priority curve
reaches at one retention level ``p``, with ``p`` bisected so that the ratios average to the budget
(docs/methods.md, "Per-layer ratios (PrefixKV)"). A profile stores those curves whatever its ratio
source, so its PrefixKV ratios at its own budget come from the rule every re-budget uses
(`whole_cache.rebudget` with the attention-sum curves): on a model of full-attention layers the
compressing layers' mean is the budget; on a hybrid model the sliding layers keep the profile's
windows and the full-attention layers share what those leave of the whole cache's budget. Numpy
only, no torch: `inspect gini` reads it without loading a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtool.profiles import whole_cache
from kvtool.profiles.schema import Profile


@dataclass(frozen=True)
class PrefixKV:
    """A profile's PrefixKV allocation at its budget: the profile with those ratios, and the level."""

    profile: Profile  # same windows and method; each compressing layer's ratio is PrefixKV's
    # The retention level; None where the floor, not a level, sets every ratio (or, on a hybrid
    # profile without a calibration record, where the whole-cache solve does not report it).
    p: float | None


def missing_curve(profile: Profile) -> int | None:
    """The first compressing layer without an attention-sum priority curve (None: every one has it)."""
    return next((i for i, layer in enumerate(profile.layers) if layer.compress and not layer.priority_curve), None)


def prefixkv(profile: Profile, source: str = "profile") -> PrefixKV | None:
    """PrefixKV's ratios at `profile`'s budget from its stored attention-sum curves; None where a
    compressing layer stores no curve (a uniform profile made on the fly) or no layer compresses.
    Unusable curves are a one-line KvtoolError naming `source`."""
    if missing_curve(profile) is not None or not any(layer.compress for layer in profile.layers):
        return None
    updated, allocation = whole_cache.rebudget(profile, profile.budget, source, importance_curves=True)
    level = allocation.p
    return PrefixKV(profile=updated, p=float(level) if math.isfinite(level) and level > 0.0 else None)
