"""Priority curves, Lorenz curves and Gini coefficients (kvtool.profiles.lorenz)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvtool.profiles.lorenz import (
    check_curve,
    downsample,
    gini_from_curve,
    gini_from_importance,
    grid,
    lorenz_curve,
    mean_curve,
    priority_curve,
)

FAST = settings(max_examples=100, deadline=None)

importances = hnp.arrays(
    np.float64,
    st.integers(1, 60),
    elements=st.one_of(st.just(0.0), st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)),
)


def gini_mad(x: np.ndarray) -> float:
    """Independent reference: mean absolute difference over all pairs, G = sum|xi-xj| / (2 n^2 mean)."""
    x = np.asarray(x, dtype=np.float64)
    if x.max() == 0:
        return 0.0
    x = x / x.max()  # scale-free; keeps subnormal inputs from underflowing the mean
    n = x.size
    return float(np.abs(x[:, None] - x[None, :]).sum() / (2.0 * n * n * x.mean()))


# --- closed forms -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 1000])
def test_uniform_importance_has_gini_zero(n: int) -> None:
    assert gini_from_importance(np.full(n, 3.5)) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 1000])
def test_all_mass_on_one_token_has_gini_n_minus_1_over_n(n: int) -> None:
    x = np.zeros(n)
    x[n // 2] = 42.0
    assert gini_from_importance(x) == pytest.approx((n - 1) / n, abs=1e-12)


def test_all_zero_importance_is_treated_as_uniform() -> None:
    zeros = np.zeros(8)
    np.testing.assert_allclose(priority_curve(zeros, 11), grid(11), atol=1e-15)
    assert gini_from_importance(zeros) == 0.0


def test_uniform_priority_curve_is_the_diagonal() -> None:
    np.testing.assert_allclose(priority_curve(np.ones(13), 101), grid(101), atol=1e-14)


def test_knot_values_match_sorted_cumulative_shares() -> None:
    x = np.array([1.0, 5.0, 0.0, 2.0, 2.0])
    curve = priority_curve(x, points=11)  # grid step 0.1, knots every 0.2
    expected = np.array([0.0, 0.5, 0.7, 0.9, 1.0, 1.0])
    np.testing.assert_allclose(curve[::2], expected, atol=1e-15)
    # Between knots the curve is linear: halfway between 0 and 0.5.
    assert curve[1] == pytest.approx(0.25)


@FAST
@given(importances)
def test_gini_matches_mean_absolute_difference_formula(x: np.ndarray) -> None:
    assert gini_from_importance(x) == pytest.approx(gini_mad(x), abs=1e-9)


normal_importances = hnp.arrays(
    np.float64, st.integers(1, 60), elements=st.one_of(st.just(0.0), st.floats(1e-6, 1e6))
)


@FAST
@given(normal_importances, st.floats(1e-3, 1e3), st.randoms())  # scaling subnormals would underflow
def test_gini_is_scale_and_permutation_invariant(x: np.ndarray, scale: float, rnd) -> None:
    y = x * scale
    rnd.shuffle(y)
    assert gini_from_importance(y) == pytest.approx(gini_from_importance(x), abs=1e-9)


# --- curve shape --------------------------------------------------------------------------------


@FAST
@given(importances, st.integers(2, 300))
def test_priority_curve_is_monotone_concave_from_0_to_1(x: np.ndarray, points: int) -> None:
    curve = priority_curve(x, points)
    assert curve.shape == (points,)
    assert curve[0] == 0.0 and curve[-1] == 1.0
    steps = np.diff(curve)
    assert np.all(steps >= 0.0)
    assert np.all(np.diff(steps) <= 1e-12)  # concave: sorted descending
    assert np.all(curve >= grid(points) - 1e-12)  # never below the diagonal


@FAST
@given(importances)
def test_lorenz_curve_is_ascending_mirror(x: np.ndarray) -> None:
    curve = priority_curve(x, 51)
    lz = lorenz_curve(curve)
    assert lz[0] == 0.0 and lz[-1] == 1.0
    assert np.all(np.diff(lz) >= 0.0)
    assert np.all(lz <= grid(51) + 1e-12)  # below the equality line
    np.testing.assert_allclose(lz, 1.0 - curve[::-1])
    # Gini as the paper defines it, 1 - 2 * area under the Lorenz curve.
    g = 1.0 - 2.0 * float(np.sum((lz[1:] + lz[:-1]) / 2.0) / 50)
    assert gini_from_curve(curve) == pytest.approx(g, abs=1e-12)


@FAST
@given(st.integers(1, 20), st.integers(1, 10), st.data())
def test_gini_from_curve_is_exact_when_grid_holds_the_knots(n: int, mult: int, data) -> None:
    x = data.draw(hnp.arrays(np.float64, n, elements=st.floats(0.0, 100.0)))
    curve = priority_curve(x, points=n * mult + 1)
    assert gini_from_curve(curve) == pytest.approx(gini_from_importance(x), abs=1e-12)


@FAST
@given(importances, st.integers(2, 40))
def test_gini_from_coarse_curve_never_overestimates(x: np.ndarray, points: int) -> None:
    assert gini_from_curve(priority_curve(x, points)) <= gini_from_importance(x) + 1e-12


def test_more_concentrated_importance_has_higher_gini() -> None:
    ranks = np.arange(1, 200, dtype=np.float64)
    ginis = [gini_from_importance(ranks**-a) for a in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)]
    assert ginis[0] == pytest.approx(0.0, abs=1e-12)
    assert np.all(np.diff(ginis) > 0)


def test_batched_rows_match_single_rows() -> None:
    rng = np.random.default_rng(0)
    batch = rng.exponential(size=(3, 4, 17)) ** 3
    curves = priority_curve(batch, 33)
    ginis = gini_from_importance(batch)
    assert curves.shape == (3, 4, 33) and ginis.shape == (3, 4)
    for idx in np.ndindex(3, 4):
        np.testing.assert_array_equal(curves[idx], priority_curve(batch[idx], 33))
        assert ginis[idx] == pytest.approx(gini_from_importance(batch[idx]), abs=1e-15)


# --- downsample / mean ----------------------------------------------------------------------------


@FAST
@given(importances)
def test_downsample_matches_direct_coarse_sampling(x: np.ndarray) -> None:
    # The 11-point grid is a subset of the 101-point grid, so both read the same exact values.
    np.testing.assert_allclose(downsample(priority_curve(x, 101), 11), priority_curve(x, 11), atol=1e-12)


def test_mean_curve_averages_samples_and_stays_valid() -> None:
    a = priority_curve([1.0, 0.0, 0.0, 0.0], 5)
    b = priority_curve([1.0, 1.0, 1.0, 1.0], 5)
    m = mean_curve(np.stack([a, b]))
    np.testing.assert_allclose(m, [0.0, 0.625, 0.75, 0.875, 1.0])
    assert mean_curve([[a, b], [b, a]]).shape == (2, 5)


def test_check_curve_repairs_rounding_from_storage() -> None:
    stored = [1e-8, 0.5, 0.4999999, 1.0000004]
    clean = check_curve(stored)
    assert clean[0] == 0.0 and clean[-1] == 1.0
    assert np.all(np.diff(clean) >= 0.0)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [[], np.zeros((3, 0)), [1.0, -0.5], [1.0, np.nan], [np.inf, 1.0], 3.0],
)
def test_bad_importance_raises(bad) -> None:
    with pytest.raises(ValueError):
        priority_curve(bad)
    with pytest.raises(ValueError):
        gini_from_importance(bad)


@pytest.mark.parametrize("points", [0, 1, -3, 2.5, True])
def test_bad_points_raise(points) -> None:
    with pytest.raises(ValueError):
        priority_curve([1.0, 2.0], points)


@pytest.mark.parametrize(
    "bad",
    [[0.0], [0.1, 1.0], [0.0, 0.9], [0.0, 0.7, 0.3, 1.0], [0.0, np.nan, 1.0], [0.0, 1.5, 1.0]],
)
def test_bad_curves_raise(bad) -> None:
    with pytest.raises(ValueError):
        gini_from_curve(bad)
    with pytest.raises(ValueError):
        lorenz_curve(bad)


def test_mean_curve_needs_a_stack() -> None:
    with pytest.raises(ValueError):
        mean_curve([0.0, 0.5, 1.0])
