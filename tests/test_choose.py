"""One rule turns --budget / --profile into a calibrated profile, for generate, bench and eval alike."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import kvtool.calibration.choose as choose_module
from kvtool.calibration.choose import choose_profile, choose_profiles
from kvtool.profiles import save_profile
from kvtool.profiles.whole_cache import rebudget
from kvtool.profiles.builtin import builtin_dir
from kvtool.runtime import load_profile
from tiny_models import tiny_llama

SMOLLM2 = SimpleNamespace(name="smollm2", model=None)  # built-in profiles need no model


def test_exact_builtin_profile_is_used_as_shipped() -> None:
    chosen = choose_profile(SMOLLM2, 0.2)
    assert chosen.profile == load_profile(builtin_dir() / "smollm2-b0.2.yaml")
    assert chosen.source == "built-in smollm2-b0.2.yaml (budget 0.2)"


@pytest.mark.parametrize(("budget", "nearest"), [(0.05, 0.1), (0.12, 0.1), (0.18, 0.2), (0.3, 0.2), (0.4, 0.5), (0.7, 0.5)])
def test_other_budgets_rederive_the_nearest_builtin(budget: float, nearest: float) -> None:
    chosen = choose_profile(SMOLLM2, budget)
    base = load_profile(builtin_dir() / f"smollm2-b{nearest:g}.yaml")
    assert chosen.profile == rebudget(base, budget)[0]
    assert chosen.profile.budget == budget
    assert f"smollm2-b{nearest:g}.yaml" in chosen.source and f"re-derived for budget {budget:g}" in chosen.source


def test_a_profile_file_wins_over_builtins(tmp_path: Path) -> None:
    base = load_profile(builtin_dir() / "smollm2-b0.5.yaml")
    path = save_profile(base, tmp_path / "mine.yaml")
    chosen = choose_profiles(SMOLLM2, [0.2, 0.5], profile_path=path)
    assert chosen[0.5].profile == base
    assert chosen[0.2].profile == rebudget(base, 0.2)[0]
    assert all(str(path) in c.source for c in chosen.values())


def test_without_a_profile_one_calibration_serves_every_budget(monkeypatch) -> None:
    made = []

    def fake_calibrate(loaded, budget, progress=None):
        made.append(budget)
        return SimpleNamespace(profile=load_profile(builtin_dir() / "smollm2-b0.2.yaml"))

    monkeypatch.setattr(choose_module, "calibrate", fake_calibrate)
    said = []
    loaded = SimpleNamespace(name="not-shipped", model=tiny_llama())
    chosen = choose_profiles(loaded, [0.1, 0.5, 1.0], notify=said.append)
    assert made == [0.1]  # the budget nearest 0.2 among those that need one; 1.0 needs none
    assert len(said) == 1 and "not-shipped" in said[0]
    assert chosen[0.5].profile.budget == 0.5 and "calibrated now" in chosen[0.5].source
    assert all(layer.ratio == 1.0 for layer in chosen[1.0].profile.layers)


def test_calibration_can_be_declined(monkeypatch) -> None:
    monkeypatch.setattr(choose_module, "calibrate", lambda *a, **k: pytest.fail("must not calibrate"))
    assert choose_profiles(SimpleNamespace(name="not-shipped", model=None), [0.2], calibrate_missing=False) == {}
