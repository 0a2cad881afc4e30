"""The OpenMP wait policy of long commands: spin on an idle CPU, sleep when something else runs."""

from __future__ import annotations

import sys

import pytest

from kvtool.cli import openmp


@pytest.fixture
def fresh(monkeypatch):
    """An environment with no OpenMP settings (a copy, restored after the test), and torch not yet
    loaded as far as the choice knows."""
    env = {k: v for k, v in openmp.os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    monkeypatch.setattr(openmp.os, "environ", env)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    return monkeypatch


def test_idle_cpu_keeps_the_default_spin(fresh):
    assert openmp.choose_openmp_wait(lambda: 0.1) == "spin"
    assert "OMP_WAIT_POLICY" not in openmp.os.environ


@pytest.mark.parametrize("busy", [0.25, 1.0, None])
def test_busy_or_unknown_cpu_sleeps(fresh, busy):
    assert openmp.choose_openmp_wait(lambda: busy) == "passive"
    assert openmp.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "1000")])
def test_an_explicit_setting_wins_without_measuring(fresh, name, value):
    openmp.os.environ[name] = value
    assert openmp.choose_openmp_wait(lambda: pytest.fail("measured")) == "as set"
    assert openmp.os.environ.get("OMP_WAIT_POLICY", "") == ("ACTIVE" if name == "OMP_WAIT_POLICY" else "")


def test_nothing_is_chosen_once_torch_is_loaded(monkeypatch):
    import torch  # noqa: F401

    env = {k: v for k, v in openmp.os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    monkeypatch.setattr(openmp.os, "environ", env)
    assert openmp.choose_openmp_wait(lambda: pytest.fail("measured")) == "too late"
    assert "OMP_WAIT_POLICY" not in openmp.os.environ


def test_cores_in_use_is_the_busy_share_of_every_cpu(monkeypatch):
    readings = iter([(100, 1000), (150, 1200)])  # 50 of 200 jiffies busy: a quarter of the CPUs
    monkeypatch.setattr(openmp, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(openmp.os, "cpu_count", lambda: 4)
    assert openmp.cores_in_use(0.0) == pytest.approx(1.0)
    monkeypatch.setattr(openmp, "_cpu_times", lambda: None)
    assert openmp.cores_in_use(0.0) is None


def test_proc_stat_reads_as_busy_and_total_jiffies():
    times = openmp._cpu_times()
    if times is None:
        pytest.skip("no /proc/stat here")
    busy, total = times
    assert 0 <= busy <= total
