"""A budget in bytes over layers that keep their entries at different precisions.

A profile's `budget` is the share of the full cache's bytes it keeps. With every layer at the
model's own precision that is the mean kept ratio; a layer that stores its entries in a smaller
format (`profiles.entry_bytes`) pays `ratio x share` instead, so

    budget = mean over compressing layers of ratio_l x share(format_l).

Two things here spend such a budget:
- `solve_by_bytes`, calibration's allocation: for each layer a format and a ratio, the pair of least
  summed measured loss whose bytes stay within the budget (an exact dynamic programme over layers
  and byte steps, as `loss_budget.solve_by_loss` is over ratio steps). More entries at lower
  precision or fewer at higher is then a measured choice per layer, not a rule.
- `rebudget_bytes`, a profile at another budget: each layer keeps its formats and the profile's own
  rule (its curves, or one ratio everywhere) re-derives the entries at the level whose bytes are
  the new budget (a bisection on that level).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from kvtool.errors import KvtoolError
from kvtool.profiles.allocation import Allocation
from kvtool.profiles.budget import rebudget_ratios
from kvtool.profiles.entry_bytes import entry_share, layer_share, quantized
from kvtool.profiles.loss_budget import interpolate
from kvtool.profiles.schema import Profile

# Byte steps of the allocation, as a share of one layer's full bytes: fine enough that a float32
# model's int8 entry (0.266 of its bytes) moves in ratio steps of about 0.01.
BYTE_STEP = 0.0025
RATIO_STEP = 0.01


def is_quantized(profile: Profile) -> bool:
    return any(layer.compress and quantized(layer) for layer in profile.layers)


def native_of(profile: Profile, source: str = "profile") -> int:
    """Bytes of one value at the model's own precision; a quantized profile must say (`native_bytes`)."""
    if profile.native_bytes is None:
        if is_quantized(profile):
            raise KvtoolError(f"{source}: its layers store quantized entries but it does not say the model's native_bytes")
        return 2
    return profile.native_bytes


def byte_share(profile: Profile, source: str = "profile") -> float:
    """The share of the compressing layers' full bytes `profile` keeps (its ratios at their formats' cost)."""
    compressing = [layer for layer in profile.layers if layer.compress]
    if not compressing:
        return 1.0
    native, head_dim = native_of(profile, source), profile.model.head_dim
    return float(np.mean([layer_share(layer, head_dim, native) for layer in compressing]))


def rebudget_bytes(
    profile: Profile, budget: float, source: str = "profile", *, importance_curves: bool = False
) -> tuple[Profile, Allocation]:
    """`profile` (each layer's formats kept) at `budget` bytes: its entries re-derived by its own
    rule at the level whose byte share is `budget`, the most entries whose bytes do not pass it."""

    def at(level: float) -> tuple[Profile, Allocation]:
        return rebudget_ratios(profile, level, source, importance_curves=importance_curves)

    def spent(level: float) -> float:
        return byte_share(at(level)[0], source)

    lo, hi = 1e-4, 1.0
    if spent(hi) <= budget:  # every entry kept at these formats is within the budget
        lo = hi
    else:
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if spent(mid) <= budget else (lo, mid)
    shaped, allocation = at(lo)
    return dataclasses.replace(shaped, budget=budget), allocation


def solve_by_bytes(
    curves: Mapping[tuple[str, str], np.ndarray],
    ratios: Mapping[tuple[str, str], Sequence[float]],
    head_dim: int,
    native: int,
    budget: float,
    *,
    floor: float,
) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Each layer's kept ratio and (keys, values) formats, of least summed loss with the mean byte
    share at most `budget`.

    `curves[storage]` is [L, R] the measured loss of each layer keeping `ratios[storage]` of its
    entries at that storage (linear between, flat below the first point; a storage measured without
    the point 1.0 loses nothing there: native). Ratios are chosen on a grid from `floor` to 1."""
    options = []  # (storage, ratio, byte units, loss per layer [L])
    layers = next(iter(curves.values())).shape[0]
    grid = np.round(np.arange(floor, 1.0 + 1e-9, RATIO_STEP), 6)
    if grid[-1] < 1.0:
        grid = np.append(grid, 1.0)
    for storage, curve in curves.items():
        share = entry_share(*storage, head_dim, native)
        points = list(ratios[storage])
        for ratio in grid:
            units = int(np.ceil(ratio * share / BYTE_STEP - 1e-9))
            loss = np.array([_loss_at(curve[i], points, ratio) for i in range(layers)])
            options.append((storage, float(ratio), units, loss))
    total = int(np.floor(budget * layers / BYTE_STEP + 1e-9))
    cheapest = min(units for _, _, units, _ in options)
    if cheapest * layers > total:
        raise ValueError(f"budget {budget:g} is below the cheapest option ({cheapest * BYTE_STEP:.4f} of a layer)")
    best = np.full(total + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((layers, total + 1), dtype=np.int64)
    for i in range(layers):
        nxt = np.full(total + 1, np.inf)
        for k, (_, _, units, loss) in enumerate(options):
            if units > total:
                continue
            candidate = np.full(total + 1, np.inf)
            candidate[units:] = best[: total + 1 - units] + loss[i]
            better = candidate < nxt
            nxt[better] = candidate[better]
            choice[i, better] = k
        best = nxt
    # The least loss within the budget; among equal losses the most bytes spent: a measured loss of 0
    # on the calibration prompts is not a reason to keep less than the budget allows.
    left = int(np.flatnonzero(best <= best.min() + 1e-12)[-1])
    out_ratios, out_storage = np.zeros(layers), [("native", "native")] * layers
    for i in reversed(range(layers)):
        storage, ratio, units, _ = options[int(choice[i, left])]
        out_ratios[i], out_storage[i] = ratio, storage
        left -= units
    return out_ratios, out_storage


def _loss_at(curve: np.ndarray, points: list[float], ratio: float) -> float:
    if points[-1] >= 1.0:
        return float(np.interp(ratio, points, curve))
    return float(interpolate(np.asarray(curve), tuple(points), np.array([ratio]))[0])
