"""Cumulative-priority curves, Lorenz curves and Gini coefficients of per-layer token importance.

Conventions (docs: docs/methods.md, "Per-layer ratios (PrefixKV)"):

* The priority curve ``P(o)`` is the share of total importance kept when a layer keeps the top
  fraction ``o`` of its tokens. For ``n`` tokens it is the piecewise-linear curve through the knots
  ``(j/n, C_j)``, ``C_j`` the cumulative sum of the ``j`` largest normalized importances: token ``j``
  (0-based, by rank) covers ``o`` in ``[j/n, (j+1)/n]``. Keeping the curve piecewise linear rather
  than a step makes ``R(p) = min{o : P(o) >= p}`` continuous in ``p``, which the bisection needs.
* Curves are stored sampled on the uniform grid ``o_i = i/(points-1)``; every function taking a
  curve reads its last axis that way, so a ``[L, points]`` array is a stack of per-layer curves.
* The Lorenz curve is the ascending view of the same data, ``Lz(x) = 1 - P(1 - x)``; the Gini
  coefficient is ``1 - 2 * integral(Lz) = 2 * integral(P) - 1``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "check_curve",
    "downsample",
    "gini_from_curve",
    "gini_from_importance",
    "grid",
    "lorenz_curve",
    "mean_curve",
    "priority_curve",
]

# Stored curves go through YAML with rounded floats; this much slack is accepted and repaired.
_CURVE_ATOL = 1e-6


def grid(points: int) -> np.ndarray:
    """The sampling grid ``o_i = i/(points-1)`` shared by every stored curve."""
    _check_points(points)
    return np.linspace(0.0, 1.0, points)


def _check_points(points: int) -> None:
    if isinstance(points, bool) or not isinstance(points, (int, np.integer)) or points < 2:
        raise ValueError(f"points must be an integer >= 2, got {points!r}")


def _sorted_shares(importance: np.ndarray | list[float]) -> np.ndarray:
    """Normalized importances sorted descending along the last axis (each row sums to 1)."""
    x = np.asarray(importance, dtype=np.float64)
    if x.ndim == 0:
        raise ValueError("importance must be an array of per-token scores, got a scalar")
    if x.shape[-1] == 0:
        raise ValueError("importance is empty: a layer needs at least one compressible token")
    if not np.all(np.isfinite(x)):
        raise ValueError("importance contains NaN or infinite values")
    if np.any(x < 0):
        raise ValueError("importance must be nonnegative")
    n = x.shape[-1]
    # Divide by the row maximum first so that huge scores cannot overflow the sum.
    peak = x.max(axis=-1, keepdims=True)
    dead = peak == 0.0
    # A layer that gave no token any weight carries no preference: treat it as evenly spread.
    scaled = np.where(dead, 1.0, x / np.where(dead, 1.0, peak))
    shares = scaled / scaled.sum(axis=-1, keepdims=True)
    return -np.sort(-shares, axis=-1)


def _knots(importance: np.ndarray | list[float]) -> np.ndarray:
    """Cumulative priority at the knots ``o = j/n``, j = 0..n: ``C_0 = 0``, ``C_n = 1`` exactly."""
    shares = _sorted_shares(importance)
    cum = np.cumsum(shares, axis=-1)
    zero = np.zeros(cum.shape[:-1] + (1,))
    knots = np.concatenate([zero, np.minimum(cum, 1.0)], axis=-1)
    # Rounding in the cumsum can leave it at 1 - 1e-16. Once the remaining tokens carry nothing the
    # curve must be exactly 1, or R(1) would count the zero-importance tail as needed.
    n = shares.shape[-1]
    last_useful = n - np.argmax(shares[..., ::-1] > 0.0, axis=-1)  # knot where the mass is complete
    knots[np.arange(n + 1) >= last_useful[..., None]] = 1.0
    return knots


def priority_curve(importance: np.ndarray | list[float], points: int = 101) -> np.ndarray:
    """Cumulative-priority curve ``P(o)`` of one layer's token importance, sampled at ``points``.

    ``importance`` has the tokens on its last axis (``[n]`` or a stack ``[..., n]``); the result has
    ``points`` samples there, with ``P(0) = 0`` and ``P(1) = 1``, nondecreasing and concave. An
    all-zero row is treated as uniform. Empty, negative, NaN or infinite input raises ValueError.
    With few points this is also the compact form stored in a profile.
    """
    _check_points(points)
    knots = _knots(importance)
    n = knots.shape[-1] - 1
    # Sample o_i = i/(points-1), i.e. position i*n/(points-1) on the knot axis. Integer division
    # lands exactly on knots (float o_i * n could give 5.999... and interpolate 1 - 1e-16).
    # Same knots and grid for every row, so the indices are computed once.
    scaled = np.arange(points, dtype=np.int64) * n
    left = np.minimum(scaled // (points - 1), n - 1)
    frac = (scaled - left * (points - 1)) / (points - 1)
    lo = knots[..., left]
    hi = knots[..., left + 1]
    curve = lo + frac * (hi - lo)
    curve[..., 0] = 0.0
    curve[..., -1] = 1.0
    return curve


def check_curve(curve: np.ndarray | list[float]) -> np.ndarray:
    """Validate sampled priority curve(s) on the last axis and return a cleaned float copy.

    Accepts small rounding (``1e-6``, e.g. after a YAML round trip) and repairs it: clips to
    ``[0, 1]``, pins the endpoints to 0 and 1 and makes the curve nondecreasing. Anything else
    (wrong endpoints, decreasing, non-finite, fewer than 2 points) raises ValueError.
    """
    c = np.array(curve, dtype=np.float64)
    if c.ndim == 0 or c.shape[-1] < 2:
        raise ValueError("a priority curve needs at least 2 samples on its last axis")
    if c.size == 0:
        raise ValueError("no priority curves given")
    if not np.all(np.isfinite(c)):
        raise ValueError("priority curve contains NaN or infinite values")
    if np.any(np.abs(c[..., 0]) > _CURVE_ATOL) or np.any(np.abs(c[..., -1] - 1.0) > _CURVE_ATOL):
        raise ValueError("priority curve must start at P(0)=0 and end at P(1)=1")
    if np.any(np.diff(c, axis=-1) < -_CURVE_ATOL):
        raise ValueError("priority curve must be nondecreasing")
    if np.any(c < -_CURVE_ATOL) or np.any(c > 1.0 + _CURVE_ATOL):
        raise ValueError("priority curve values must lie in [0, 1]")
    c = np.maximum.accumulate(np.clip(c, 0.0, 1.0), axis=-1)
    c[..., 0] = 0.0
    c[..., -1] = 1.0
    return c


def lorenz_curve(curve: np.ndarray | list[float]) -> np.ndarray:
    """Ascending Lorenz curve ``Lz(x) = 1 - P(1 - x)`` on the same (symmetric) grid as ``curve``."""
    c = check_curve(curve)
    return 1.0 - c[..., ::-1]


def gini_from_importance(importance: np.ndarray | list[float]) -> float | np.ndarray:
    """Exact Gini coefficient ``1 - 2 * integral(Lz)`` of the importance on the last axis.

    The piecewise-linear curve through the knots makes the integral a trapezoid sum over them:
    ``integral(P) = (2 * sum_{j=1}^{n-1} C_j + 1) / (2n)``. This equals the mean-absolute-difference
    Gini ``sum_ij |x_i - x_j| / (2 n^2 mean)``: 0 for uniform importance, ``(n-1)/n`` when one of
    ``n`` tokens holds everything. Returns a float for one layer, an array for a stack.
    """
    knots = _knots(importance)
    n = knots.shape[-1] - 1
    g = (2.0 * knots[..., 1:-1].sum(axis=-1) + 1.0) / n - 1.0
    g = np.clip(g, 0.0, 1.0)  # only rounding can leave [0, 1]
    return float(g) if g.ndim == 0 else g


def gini_from_curve(curve: np.ndarray | list[float]) -> float | np.ndarray:
    """Gini coefficient from a sampled curve, trapezoid rule on its grid.

    Exact when the grid contains every knot ``j/n`` (``points - 1`` a multiple of ``n``); otherwise
    the chords of the concave curve lie below it, so this slightly underestimates the exact value.
    """
    c = check_curve(curve)
    h = 1.0 / (c.shape[-1] - 1)
    area = h * (c.sum(axis=-1) - 0.5 * (c[..., 0] + c[..., -1]))
    g = np.clip(2.0 * area - 1.0, 0.0, 1.0)
    return float(g) if g.ndim == 0 else g


def downsample(curve: np.ndarray | list[float], points: int) -> np.ndarray:
    """Resample a sampled curve onto a coarser ``points`` grid (linear interpolation).

    To go straight from importance to a coarse curve, call ``priority_curve(importance, points)``;
    this is for curves already sampled, e.g. a fine mean curve shrunk for the profile. The result
    keeps ``P(0)=0``, ``P(1)=1``, monotonicity and concavity.
    """
    _check_points(points)
    c = check_curve(curve)
    src = grid(c.shape[-1])
    dst = grid(points)
    flat = c.reshape(-1, c.shape[-1])
    out = np.stack([np.interp(dst, src, row) for row in flat])
    return out.reshape(c.shape[:-1] + (points,))


def mean_curve(curves: np.ndarray | list[np.ndarray]) -> np.ndarray:
    """Mean over the first axis (calibration samples) of curves ``[S, ..., points]``.

    A mean of priority curves is again a valid one (monotone, concave, 0 to 1), which is why
    offline estimation can average curves across samples and solve once.
    """
    c = check_curve(curves)
    if c.ndim < 2:
        raise ValueError("mean_curve needs a stack of curves [S, ..., points]")
    m = c.mean(axis=0)
    m[..., 0] = 0.0
    m[..., -1] = 1.0
    return m
