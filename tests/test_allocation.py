"""Retention search, exact budgets and integer rounding (kvtool.profiles.allocation)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvtool.errors import KvtoolError
from kvtool.profiles.allocation import (
    Allocation,
    aggregate,
    integer_allocation,
    kept_ratio,
    ratios_for_budget,
    solve_from_samples,
    solve_retention,
)
from kvtool.profiles.lorenz import gini_from_importance, grid, priority_curve

FAST = settings(max_examples=100, deadline=None)
EXACT = 1e-12  # the brief asks for < 1e-9; the blend gets to rounding level

token_scores = st.one_of(st.just(0.0), st.floats(0.0, 1e4, allow_nan=False, allow_infinity=False))


@st.composite
def importance_curves(draw, max_layers: int = 12, positive: bool = False) -> np.ndarray:
    """Stacks [L, points] of real priority curves (concave), zero-importance tails unless positive."""
    n_layers = draw(st.integers(1, max_layers))
    n_tokens = draw(st.integers(1, 40))
    points = draw(st.integers(2, 60))
    elements = st.floats(1e-3, 1e4) if positive else token_scores
    x = draw(hnp.arrays(np.float64, (n_layers, n_tokens), elements=elements))
    return priority_curve(x, points)


@st.composite
def monotone_curves(draw, max_layers: int = 12) -> np.ndarray:
    """Arbitrary nondecreasing 0-to-1 curves: flat stretches make mean R(p) jump."""
    n_layers = draw(st.integers(1, max_layers))
    points = draw(st.integers(2, 30))
    steps = draw(hnp.arrays(np.float64, (n_layers, points - 1), elements=st.one_of(st.just(0.0), st.floats(0.0, 1.0))))
    steps[:, 0] += 1e-3  # each row needs some mass to normalize
    cum = np.cumsum(steps, axis=1) / steps.sum(axis=1, keepdims=True)
    return np.concatenate([np.zeros((n_layers, 1)), cum], axis=1)


any_curves = st.one_of(importance_curves(), monotone_curves())


def power_law_layers(exponents, n_tokens: int = 300, points: int = 101) -> tuple[np.ndarray, np.ndarray]:
    ranks = np.arange(1, n_tokens + 1, dtype=np.float64)
    importance = np.stack([ranks**-a for a in exponents])
    return priority_curve(importance, points), gini_from_importance(importance)


# --- kept_ratio ----------------------------------------------------------------------------------


def test_kept_ratio_on_uniform_curve_is_identity() -> None:
    diagonal = grid(101)
    for p in (0.0, 0.013, 0.25, 0.5, 0.999, 1.0):
        assert kept_ratio(diagonal, p) == pytest.approx(p, abs=1e-14)


def test_kept_ratio_endpoints() -> None:
    curve = priority_curve([5.0, 3.0, 0.0, 0.0], 101)  # all importance in half the tokens
    assert kept_ratio(curve, 0.0) == 0.0
    assert kept_ratio(curve, 1.0) == pytest.approx(0.5)
    assert kept_ratio(curve, 5 / 8) == pytest.approx(0.25)


@FAST
@given(importance_curves(max_layers=1), st.floats(0.0, 1.0))
def test_kept_ratio_is_the_minimal_prefix_reaching_p(curves: np.ndarray, p: float) -> None:
    curve = curves[0]
    o = grid(curve.size)
    r = kept_ratio(curve, p)
    assert 0.0 <= r <= 1.0
    assert np.interp(r, o, curve) == pytest.approx(p, abs=1e-9)  # reaches p ...
    if p == 0.0:
        assert r == 0.0
        return
    # ... and nothing shorter does: r lies in the segment of the first sample reaching p.
    i = int(np.argmax(curve >= p))
    assert np.all(curve[:i] < p)
    assert o[i - 1] <= r <= o[i] + 1e-12
    if curve[i] - curve[i - 1] > 1e-6:  # a visible rise, so a shorter prefix is visibly short
        assert np.interp(r - 1e-6, o, curve) < p


@FAST
@given(importance_curves(max_layers=1), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_kept_ratio_is_monotone_in_p(curves: np.ndarray, p: float, q: float) -> None:
    lo, hi = sorted((p, q))
    assert kept_ratio(curves[0], lo) <= kept_ratio(curves[0], hi)


@pytest.mark.parametrize("p", [-0.1, 1.1, float("nan")])
def test_kept_ratio_rejects_bad_p(p: float) -> None:
    with pytest.raises(ValueError):
        kept_ratio(grid(11), p)


# --- solve_retention -----------------------------------------------------------------------------


@FAST
@given(any_curves, st.floats(0.0, 1.0), st.floats(0.0, 0.5))
def test_bisection_meets_the_budget_exactly_and_respects_bounds(
    curves: np.ndarray, budget_frac: float, min_ratio: float
) -> None:
    # Budgets span (min_ratio, 1]; the lower end is exclusive because budget 0 is invalid.
    budget = min_ratio + budget_frac * (1.0 - min_ratio)
    assume(budget > 0.0)
    alloc = solve_retention(curves, budget, min_ratio=min_ratio)
    assert alloc.ratios.shape == (curves.shape[0],)
    assert abs(alloc.ratios.mean() - budget) < EXACT
    assert np.all(alloc.ratios >= min_ratio) and np.all(alloc.ratios <= 1.0)
    assert 0.0 <= alloc.p <= 1.0
    assert 0 <= alloc.iterations <= 60


@FAST
@given(importance_curves(positive=True), st.floats(0.01, 0.99))
def test_ratios_follow_the_retention_level(curves: np.ndarray, budget: float) -> None:
    # On strictly increasing curves the mean is continuous: the ratios are R_l(p) at the found p.
    assume(np.all(np.diff(curves, axis=1) > 1e-9))
    alloc = solve_retention(curves, budget)
    expected = [kept_ratio(c, alloc.p) for c in curves]
    np.testing.assert_allclose(alloc.ratios, expected, atol=1e-7)


def test_higher_gini_layers_get_smaller_ratios() -> None:
    exponents = [0.0, 0.2, 0.5, 0.8, 1.2, 2.0, 3.0]
    curves, ginis = power_law_layers(exponents)
    assert np.all(np.diff(ginis) > 0)
    for budget in (0.05, 0.2, 0.5, 0.8):
        ratios = solve_retention(curves, budget).ratios
        assert np.all(np.diff(ratios) <= 1e-12), (budget, ratios)
        assert ratios[0] > ratios[-1]


@FAST
@given(st.lists(st.floats(0.0, 4.0), min_size=1, max_size=10), st.floats(0.01, 1.0), st.randoms())
def test_ratio_order_is_the_reverse_of_gini_order(exponents, budget: float, rnd) -> None:
    rnd.shuffle(exponents)
    curves, ginis = power_law_layers(exponents, n_tokens=64, points=65)
    ratios = solve_retention(curves, budget).ratios
    order = np.argsort(ginis, kind="stable")
    assert np.all(np.diff(ratios[order]) <= 1e-9)


def test_budget_one_keeps_everything() -> None:
    curves, _ = power_law_layers([0.0, 1.0, 3.0])
    alloc = solve_retention(curves, 1.0, min_ratio=0.1)
    assert np.array_equal(alloc.ratios, np.ones(3))
    assert alloc.p == 1.0


def test_uniform_layers_all_get_the_budget() -> None:
    curves = np.tile(grid(21), (5, 1))
    np.testing.assert_allclose(solve_retention(curves, 0.37).ratios, 0.37, atol=1e-12)


def test_budget_above_full_retention_spreads_the_rest() -> None:
    # Layer 0 needs only 1/4 of its tokens to keep everything; the budget asks for more.
    curves = np.stack([priority_curve([1.0, 0.0, 0.0, 0.0], 5), priority_curve([1.0, 1.0, 1.0, 1.0], 5)])
    alloc = solve_retention(curves, 0.9)
    assert alloc.p == 1.0
    assert alloc.ratios.mean() == pytest.approx(0.9, abs=EXACT)
    np.testing.assert_allclose(alloc.ratios, [0.8, 1.0], atol=1e-12)


def test_budget_at_the_floor_puts_every_layer_on_it() -> None:
    curves, _ = power_law_layers([0.0, 1.0, 3.0])
    np.testing.assert_allclose(solve_retention(curves, 0.1, min_ratio=0.1).ratios, 0.1, atol=1e-12)


def test_floor_lifts_concentrated_layers() -> None:
    curves, _ = power_law_layers([0.0, 1.0, 4.0])
    free = solve_retention(curves, 0.2).ratios
    floored = solve_retention(curves, 0.2, min_ratio=0.1).ratios
    assert free[-1] < 0.1 and floored[-1] == pytest.approx(0.1)
    assert floored.mean() == pytest.approx(0.2, abs=EXACT)


@pytest.mark.parametrize("max_iter", [0, 1, 3])
def test_few_iterations_still_meet_the_budget(max_iter: int) -> None:
    curves, _ = power_law_layers([0.0, 0.5, 1.0, 2.0])
    alloc = solve_retention(curves, 0.3, max_iter=max_iter)
    assert alloc.iterations <= max_iter
    assert abs(alloc.ratios.mean() - 0.3) < EXACT


def test_allocation_is_frozen() -> None:
    alloc = solve_retention(grid(11)[None, :], 0.5)
    assert isinstance(alloc, Allocation)
    with pytest.raises(dataclasses.FrozenInstanceError):
        alloc.p = 0.1  # type: ignore[misc]
    with pytest.raises(ValueError):
        alloc.ratios[0] = 0.9


@pytest.mark.parametrize("budget", [0.0, -0.2, 1.0000001, 2.0, float("nan")])
def test_bad_budget_raises(budget: float) -> None:
    with pytest.raises(KvtoolError, match="budget must be a kept fraction"):
        solve_retention(np.tile(grid(11), (2, 1)), budget)


@pytest.mark.parametrize(
    "kwargs",
    [{"min_ratio": 0.5}, {"min_ratio": -0.1}, {"min_ratio": 1.5}, {"max_iter": -1}, {"tol": -1.0}],
)
def test_bad_options_raise(kwargs) -> None:
    with pytest.raises(ValueError):
        solve_retention(np.tile(grid(11), (2, 1)), 0.3, **kwargs)


@pytest.mark.parametrize(
    "curves",
    [grid(11), np.zeros((0, 11)), np.tile(grid(11), (2, 3, 1)), [[0.0, 0.8, 0.6, 1.0]], [[0.2, 1.0]]],
)
def test_bad_curves_raise(curves) -> None:
    with pytest.raises(ValueError):
        solve_retention(curves, 0.3)


# --- ratios_for_budget / samples -----------------------------------------------------------------


def test_ratios_for_budget_rederives_from_stored_curves() -> None:
    curves, _ = power_law_layers([0.0, 0.7, 1.5, 2.5], points=21)
    stored = np.round(curves, 6).tolist()  # as written to a YAML profile
    for budget in (0.1, 0.3, 0.6):
        ratios = ratios_for_budget(stored, budget)
        assert abs(ratios.mean() - budget) < EXACT
        np.testing.assert_allclose(ratios, solve_retention(curves, budget).ratios, atol=1e-5)


def test_aggregate_mean_and_population_std() -> None:
    mean, std = aggregate([[0.2, 0.5], [0.4, 0.5]])
    np.testing.assert_allclose(mean, [0.3, 0.5])
    np.testing.assert_allclose(std, [0.1, 0.0])
    with pytest.raises(ValueError):
        aggregate([0.2, 0.3])
    with pytest.raises(ValueError):
        aggregate([[0.2, np.nan]])


def test_solve_from_samples_uses_the_mean_curve() -> None:
    rng = np.random.default_rng(1)
    ranks = np.arange(1, 101, dtype=np.float64)
    exponents = np.array([0.1, 0.6, 1.5, 2.5])
    samples = np.stack(
        [priority_curve(ranks[None, :] ** -(exponents[:, None] + rng.normal(0, 0.05, (4, 1))), 51) for _ in range(10)]
    )
    alloc, spread = solve_from_samples(samples, 0.25)
    assert abs(alloc.ratios.mean() - 0.25) < EXACT
    np.testing.assert_allclose(alloc.ratios, solve_retention(samples.mean(axis=0), 0.25).ratios, atol=1e-12)
    assert spread.shape == (4,) and np.all(spread >= 0) and np.all(spread < 0.05)


def test_identical_samples_have_no_spread() -> None:
    curves, _ = power_law_layers([0.0, 1.0, 2.0], points=41)
    alloc, spread = solve_from_samples(np.stack([curves] * 3), 0.4)
    np.testing.assert_allclose(alloc.ratios, solve_retention(curves, 0.4).ratios, atol=1e-12)
    np.testing.assert_allclose(spread, 0.0, atol=1e-12)


def test_solve_from_samples_needs_three_axes() -> None:
    with pytest.raises(ValueError):
        solve_from_samples(np.tile(grid(11), (2, 1)), 0.3)


# --- integer_allocation --------------------------------------------------------------------------


def expected_total(budget: float, n_layers: int, n_tokens: int) -> int:
    return min(max(math.ceil(budget * n_layers * n_tokens - 1e-9), n_layers), n_layers * n_tokens)


@FAST
@given(any_curves, st.floats(0.001, 1.0), st.integers(1, 5000))
def test_integer_allocation_sums_exactly_within_bounds(curves: np.ndarray, budget: float, n: int) -> None:
    ratios = solve_retention(curves, budget).ratios
    k = integer_allocation(ratios, n, budget)
    assert k.dtype.kind == "i" and k.shape == ratios.shape
    assert int(k.sum()) == expected_total(budget, ratios.size, n)
    assert np.all(k >= 1) and np.all(k <= n)


@FAST
@given(
    hnp.arrays(np.float64, st.integers(1, 16), elements=st.floats(0.0, 1.0)),
    st.floats(0.001, 1.0),
    st.integers(1, 500),
)
def test_integer_allocation_accepts_any_ratios(ratios: np.ndarray, budget: float, n: int) -> None:
    # Ratios stored for another budget are rescaled to this one.
    k = integer_allocation(ratios, n, budget)
    assert int(k.sum()) == expected_total(budget, ratios.size, n)
    assert np.all(k >= 1) and np.all(k <= n)


@FAST
@given(importance_curves(), st.floats(0.05, 1.0), st.integers(50, 4000))
def test_integer_allocation_rounds_each_layer_to_a_neighbour(curves, budget: float, n: int) -> None:
    ratios = solve_retention(curves, budget).ratios
    quota = ratios * n * expected_total(budget, ratios.size, n) / (ratios * n).sum()
    assume(np.all(quota >= 1.0) and np.all(quota <= n))
    k = integer_allocation(ratios, n, budget)
    assert np.all(np.abs(k - quota) < 1.0)


def test_integer_allocation_rounding_rule() -> None:
    # 0.3 * 10 * 10 is 30.000000000000004 in floating point: still 30, not 31.
    assert integer_allocation(np.full(10, 0.3), 10, 0.3).sum() == 30
    # 0.25 * 3 * 10 = 7.5 -> ceil 8; the largest remainders win, ties to the lower layer.
    k = integer_allocation(np.array([0.25, 0.25, 0.25]), 10, 0.25)
    assert k.tolist() == [3, 3, 2]
    # The floor of one entry per layer can exceed the budget.
    assert integer_allocation(np.array([0.0, 0.0, 1.0]), 100, 0.001).tolist() == [1, 1, 1]
    # One token: every layer keeps it.
    assert integer_allocation(np.array([0.1, 0.9]), 1, 0.5).tolist() == [1, 1]
    # Budget 1 keeps everything.
    assert integer_allocation(np.ones(4), 7, 1.0).tolist() == [7] * 4


def test_integer_allocation_follows_largest_remainders() -> None:
    ratios = np.array([0.52, 0.18, 0.30])  # mean 1/3; quotas 5.2, 1.8, 3.0 for n = 10
    assert integer_allocation(ratios, 10, 1 / 3).tolist() == [5, 2, 3]


def test_integer_allocation_redistributes_capped_layers() -> None:
    # Quotas above n are capped and the excess goes to the other layers.
    k = integer_allocation(np.array([1.0, 0.05, 0.05]), 10, 0.6)
    assert k.sum() == 18 and k.max() <= 10 and k[0] == 10


@pytest.mark.parametrize(
    ("ratios", "n", "budget"),
    [
        ([], 10, 0.5),
        ([[0.5]], 10, 0.5),
        ([0.5, 1.2], 10, 0.5),
        ([0.5, -0.1], 10, 0.5),
        ([0.5, np.nan], 10, 0.5),
        ([0.5], 0, 0.5),
        ([0.5], 2.5, 0.5),
        ([0.5], 10, 0.0),
        ([0.5], 10, 1.5),
    ],
)
def test_integer_allocation_bad_input_raises(ratios, n, budget) -> None:
    with pytest.raises(KvtoolError if not 0 < budget <= 1 else ValueError):
        integer_allocation(np.asarray(ratios, dtype=np.float64), n, budget)
