"""Per-layer ratios from measured loss: the `measured` ratio source.

Calibration measures, for each compressing layer alone, how much the references' NLL per token
rises when that layer keeps only a fraction of its prompt entries (`kvtool.calibration.layer_loss`),
at a few fractions (`LOSS_RATIOS`). The layers' ratios are then those whose summed loss is least with
their mean at the budget: a "loss per byte" allocation, where PrefixKV's Lorenz curves only say
how concentrated a layer's attention is, not what losing it costs. The profile
stores each layer's curve (`LayerProfile.loss_curve`) and the fractions (`Profile.loss_ratios`), so
another budget re-solves them here, as Lorenz curves are re-solved.

On SmolLM2 at 0.2 this allocation halves the loss over the full cache against the same ratio
everywhere, by masking on 24 held-out calibration prompts, while PrefixKV's ratios tie it
(`benchmarks/layer_budgets.py smollm2`: NLL per token +0.201 over the full cache against uniform's
+0.411; PrefixKV's ratios -0.034 +- 0.040 against uniform).
"""

from __future__ import annotations

import numpy as np

# The fractions each layer's loss is measured at. Below the smallest the loss is taken as the
# smallest's (an underestimate; only budgets under it reach there), above the largest it falls
# linearly to 0 at 1 (a layer that keeps everything loses nothing).
LOSS_RATIOS = (0.05, 0.1, 0.2, 0.4)
# The allocation's grid: ratios move in steps of about this much.
STEP = 0.01


def clean_curves(deltas: np.ndarray) -> np.ndarray:
    """[L, R] measured NLL increases at ascending ratios -> the same never below 0 and non-increasing
    in the ratio (a larger ratio keeps a superset of the entries, so a rise there is noise)."""
    curves = np.maximum(np.asarray(deltas, dtype=np.float64), 0.0)
    return np.maximum.accumulate(curves[:, ::-1], axis=1)[:, ::-1]


def interpolate(curve: np.ndarray, ratios: tuple[float, ...], at: np.ndarray) -> np.ndarray:
    """One layer's loss at the fractions `at`: linear between the measured ratios, 0 at 1."""
    return np.interp(at, np.array([*ratios, 1.0]), np.array([*curve, 0.0]))


def solve_by_loss(curves: np.ndarray, ratios: tuple[float, ...], budget: float, step: float = STEP) -> np.ndarray:
    """The per-layer ratios, each in [min(smallest ratio, budget), 1], with mean exactly `budget` and
    the least summed interpolated loss: an exact dynamic programme over layers and grid steps (the
    step is adjusted a little so that the budget falls on the grid)."""
    curves = np.asarray(curves, dtype=np.float64)
    layers = curves.shape[0]
    if layers == 0:
        return np.zeros(0)
    lo = min(ratios[0], budget)
    spend = (budget - lo) * layers  # kept fraction above the floor, summed over layers
    total = int(round(spend / step))
    if total == 0:
        return np.full(layers, budget)
    step = spend / total
    grid = lo + step * np.arange(int(np.floor((1.0 - lo) / step + 1e-9)) + 1)
    costs = np.stack([interpolate(curve, ratios, grid) for curve in curves])  # [L, G]
    units = np.arange(len(grid))
    best = np.full(total + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((layers, total + 1), dtype=np.int64)
    for i in range(layers):
        nxt = np.full(total + 1, np.inf)
        for g in units[units <= total]:
            candidate = np.full(total + 1, np.inf)
            candidate[g:] = best[: total + 1 - g] + costs[i, g]
            better = candidate < nxt
            nxt[better] = candidate[better]
            choice[i, better] = g
        best = nxt
    if not np.isfinite(best[total]):  # every layer at 1 still under the budget cannot happen for budget <= 1
        raise ValueError(f"no allocation of {layers} layers reaches budget {budget}")
    out = np.zeros(layers)
    left = total
    for i in reversed(range(layers)):
        g = int(choice[i, left])
        out[i] = min(lo + step * g, 1.0)
        left -= g
    return out
