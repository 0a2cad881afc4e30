"""Per-layer kept ratios from cumulative-priority curves (PrefixKV's global prefix configuration).

For a retention level ``p`` each layer keeps ``R_l(p) = min{o : P_l(o) >= p}``; ``p`` is found by
bisection so that ``mean_l R_l(p) = budget`` (budget = kept fraction, docs/methods.md "Terms").

Exact budget. ``mean_l R_l(p)`` is nondecreasing in ``p`` but need not hit the budget: it jumps where
a curve is flat, stalls at ``min_ratio``, and tops out below 1 when some tokens carry no importance.
The paper stops near the target and rescales. Here the bisection keeps a bracket
``p_lo < p_hi`` with ``mean R(p_lo) <= budget <= mean R(p_hi)`` and returns the convex combination
of the two ratio vectors whose mean is the budget. Both endpoints lie in ``[min_ratio, 1]`` and are
ordered the same way across layers, so the blend stays in bounds, keeps the Gini ordering, and
its mean equals the budget to rounding (~1e-15). If even ``p = 1`` keeps less than the budget, the
all-ones vector serves as the upper end, i.e. every layer below 1 is raised by the same fraction of
its headroom.

Samples. The recommended aggregation is PrefixKV's offline estimation: average the curves over the
calibration samples and solve once on the mean curve (one ``p`` for the model); the per-sample
solutions at the same budget only serve to report the spread. Averaging per-sample ratios instead
would also meet the budget (every sample's ratios average to it) but mixes different ``p`` levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.lorenz import check_curve, mean_curve

__all__ = [
    "Allocation",
    "aggregate",
    "integer_allocation",
    "kept_ratio",
    "ratios_for_budget",
    "solve_from_samples",
    "solve_retention",
]


@dataclass(frozen=True, eq=False)
class Allocation:
    """Result of the retention search: level ``p``, per-layer kept ratios, bisection steps used."""

    p: float
    ratios: np.ndarray  # [L], read-only, mean == budget
    iterations: int


def _check_p(p: float) -> float:
    q = float(p)
    if not (0.0 <= q <= 1.0):
        raise ValueError(f"retention level p must be in [0, 1], got {p!r}")
    return q


def _ratios_at(curves: np.ndarray, p: float) -> np.ndarray:
    """``R_l(p)`` for clean curves ``[..., points]``: first sample reaching ``p``, then interpolate.

    Inside the segment ``[o_{i-1}, o_i]`` with ``P_{i-1} < p <= P_i`` the slope is positive, so the
    inverse interpolation is well defined; ``P(1) = 1 >= p`` guarantees such a segment exists.
    """
    if p <= 0.0:
        return np.zeros(curves.shape[:-1])
    m = curves.shape[-1]
    i = np.argmax(curves >= p, axis=-1)[..., None]  # >= 1 because P(0) = 0 < p
    hi = np.take_along_axis(curves, i, axis=-1)[..., 0]
    lo = np.take_along_axis(curves, i - 1, axis=-1)[..., 0]
    step = 1.0 / (m - 1)
    o = (i[..., 0] - 1 + (p - lo) / (hi - lo)) * step
    return np.clip(o, 0.0, 1.0)


def kept_ratio(curve: np.ndarray | list[float], p: float) -> float:
    """``R(p) = min{o : P(o) >= p}`` on the piecewise-linear sampled curve; ``R(0) = 0``, ``R(1) <= 1``."""
    c = check_curve(curve)
    if c.ndim != 1:
        raise ValueError("kept_ratio takes one curve [points]; use solve_retention for a stack")
    return float(_ratios_at(c, _check_p(p)))


def _check_stack(curves: np.ndarray | list[list[float]]) -> np.ndarray:
    c = check_curve(curves)
    if c.ndim != 2 or c.shape[0] == 0:
        raise ValueError(f"curves must be [L, points] with L >= 1, got shape {c.shape}")
    return c


def solve_retention(
    curves: np.ndarray | list[list[float]],
    budget: float,
    *,
    min_ratio: float = 0.0,
    max_iter: int = 60,
    tol: float = 1e-9,
) -> Allocation:
    """Bisect the retention level ``p`` so that ``mean_l clip(R_l(p), min_ratio, 1) == budget``.

    ``curves`` is ``[L, points]``. The bisection stops once ``|mean - budget| <= tol`` or after
    ``max_iter`` halvings; the remaining gap is then closed exactly by blending the bracketing ratio
    vectors (module docstring), so ``ratios.mean() == budget`` to floating-point precision and every
    ratio lies in ``[min_ratio, 1]``. Budget 1.0 returns all ones. Raises ValueError for a budget
    outside ``(0, 1]``, a budget below ``min_ratio``, or malformed curves.
    """
    c = _check_stack(curves)
    b = check_budget(budget)
    floor = float(min_ratio)
    if not (0.0 <= floor <= 1.0):
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio!r}")
    if b < floor:
        raise ValueError(f"budget {b} is below min_ratio {floor}: no layer may go under the floor")
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)) or max_iter < 0:
        raise ValueError(f"max_iter must be a nonnegative integer, got {max_iter!r}")
    if not (tol >= 0.0):
        raise ValueError(f"tol must be >= 0, got {tol!r}")

    n_layers = c.shape[0]
    if b == 1.0:
        return _frozen(1.0, np.ones(n_layers), 0)

    def ratios(p: float) -> np.ndarray:
        return np.clip(_ratios_at(c, p), floor, 1.0)

    r_hi = ratios(1.0)
    m_hi = float(r_hi.mean())
    if m_hi <= b:
        # Even full retention needs fewer entries than the budget (zero-importance tail): spend
        # the rest by raising every layer by the same share of its headroom.
        ones = np.ones(n_layers)
        return _frozen(1.0, _blend(r_hi, m_hi, ones, 1.0, b), 0)

    # Invariant: mean R(p_lo) <= budget < mean R(p_hi). At p = 0 every layer sits at the floor.
    p_lo, p_hi = 0.0, 1.0
    r_lo = ratios(0.0)
    m_lo = float(r_lo.mean())
    iterations = 0
    while iterations < max_iter and m_hi - m_lo > tol:
        mid = 0.5 * (p_lo + p_hi)
        if not (p_lo < mid < p_hi):  # the bracket cannot shrink further in floating point
            break
        iterations += 1
        r_mid = ratios(mid)
        m_mid = float(r_mid.mean())
        if m_mid <= b:
            p_lo, r_lo, m_lo = mid, r_mid, m_mid
        else:
            p_hi, r_hi, m_hi = mid, r_mid, m_mid
        if abs(m_mid - b) <= tol:
            break

    p = p_lo + _weight(m_lo, m_hi, b) * (p_hi - p_lo)
    return _frozen(p, _blend(r_lo, m_lo, r_hi, m_hi, b), iterations)


def _weight(m_lo: float, m_hi: float, target: float) -> float:
    """Blend weight that puts the mean on ``target``; clamped, as means carry rounding noise."""
    if m_hi == m_lo:
        return 0.0
    return min(max((target - m_lo) / (m_hi - m_lo), 0.0), 1.0)


def _blend(r_lo: np.ndarray, m_lo: float, r_hi: np.ndarray, m_hi: float, target: float) -> np.ndarray:
    """Convex combination of two in-bound ratio vectors whose mean is ``target``."""
    t = _weight(m_lo, m_hi, target)
    r = r_lo + t * (r_hi - r_lo)
    # Both ends are within bounds, so clipping only removes a last-ulp overshoot.
    return np.clip(r, np.minimum(r_lo, r_hi), np.maximum(r_lo, r_hi))


def _frozen(p: float, ratios: np.ndarray, iterations: int) -> Allocation:
    ratios = np.array(ratios, dtype=np.float64)
    ratios.setflags(write=False)
    return Allocation(p=float(p), ratios=ratios, iterations=int(iterations))


def ratios_for_budget(
    curves: np.ndarray | list[list[float]],
    budget: float,
    *,
    min_ratio: float = 0.0,
    max_iter: int = 60,
    tol: float = 1e-9,
) -> np.ndarray:
    """Per-layer ratios for another budget, re-derived from stored (mean) curves ``[L, points]``."""
    return solve_retention(curves, budget, min_ratio=min_ratio, max_iter=max_iter, tol=tol).ratios


def integer_allocation(ratios: np.ndarray | list[float], n_tokens: int, budget: float) -> np.ndarray:
    """Per-layer kept counts ``k_l`` for a prompt of ``n_tokens``, by largest remainder.

    Rounding rule: the total is ``ceil(budget * L * n)`` (a 1e-9 slack absorbs float noise such as
    ``0.3 * 10 * 10 = 30.000000000000004``), capped at ``L * n`` and raised to ``L`` because every
    layer keeps at least one entry. Quotas are ``ratios * n`` rescaled to sum to that total (a no-op
    up to rounding when ``mean(ratios) == budget``); each layer gets the floor of its quota clipped
    to ``[1, n]``, then the remaining units go one by one to the layers with the largest remainders
    (or, if the floor of 1 overshot, are taken from those with the smallest), ties to the lower
    layer index. Guarantees ``sum(k) == total`` and ``1 <= k_l <= n``.
    """
    r = np.asarray(ratios, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError("ratios must be a nonempty 1-D array [L]")
    if not np.all(np.isfinite(r)) or np.any(r < 0.0) or np.any(r > 1.0):
        raise ValueError("ratios must be finite and within [0, 1]")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}")
    b = check_budget(budget)

    n_layers = r.size
    n = int(n_tokens)
    capacity = n_layers * n
    total = min(max(math.ceil(b * capacity - 1e-9), n_layers), capacity)

    # Quotas are proportional to ratios * n; dividing by the max first keeps tiny (subnormal) ratios
    # from overflowing the rescale. All-zero ratios carry no preference: split evenly.
    peak = float(r.max())
    weights = r / peak if peak > 0.0 else np.ones(n_layers)
    quota = weights * (total / float(weights.sum()))
    k = np.clip(np.floor(quota), 1, n).astype(np.int64)
    order_idx = np.arange(n_layers)
    while (gap := total - int(k.sum())) != 0:
        remainder = quota - k
        if gap > 0:
            free = np.flatnonzero(k < n)
            # lexsort: last key is primary; -remainder gives largest first, index breaks ties.
            pick = free[np.lexsort((order_idx[free], -remainder[free]))][:gap]
            k[pick] += 1
        else:
            free = np.flatnonzero(k > 1)
            pick = free[np.lexsort((order_idx[free], remainder[free]))][:-gap]
            k[pick] -= 1
    return k


def aggregate(per_sample_ratios: np.ndarray | list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer mean and spread (population std, ddof=0) of per-sample ratios ``[S, L]``."""
    r = np.asarray(per_sample_ratios, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] == 0 or r.shape[1] == 0:
        raise ValueError(f"per-sample ratios must be [S, L] with S, L >= 1, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("per-sample ratios contain NaN or infinite values")
    return r.mean(axis=0), r.std(axis=0)


def solve_from_samples(
    curves_per_sample: np.ndarray | list[np.ndarray],
    budget: float,
    *,
    min_ratio: float = 0.0,
    max_iter: int = 60,
    tol: float = 1e-9,
) -> tuple[Allocation, np.ndarray]:
    """Offline estimation: solve on the sample-mean curves ``[S, L, points]``, report the spread.

    Returns the allocation on the mean curve (the profile's ratios) and, per layer, the std of the
    ratios obtained by solving each sample on its own at the same budget.
    """
    c = check_curve(curves_per_sample)
    if c.ndim != 3 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"curves_per_sample must be [S, L, points], got shape {c.shape}")

    def solve(curves: np.ndarray) -> Allocation:
        return solve_retention(curves, budget, min_ratio=min_ratio, max_iter=max_iter, tol=tol)

    allocation = solve(mean_curve(c))
    per_sample = np.stack([solve(sample).ratios for sample in c])
    _, spread = aggregate(per_sample)
    return allocation, spread
