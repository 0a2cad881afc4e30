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


# ----- glibc's mmap threshold (kvtool/cli/allocator.py) -----


def test_the_cli_fixes_glibcs_mmap_threshold(monkeypatch) -> None:
    from kvtool.cli import allocator

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    assert allocator.return_large_frees(lambda name: Libc()) == "set"
    assert calls == [(-3, 1 << 20)]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.return_large_frees(lambda name: Libc()) == "as set" and len(calls) == 1
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")

    def missing(name):
        raise OSError("no libc")

    assert allocator.return_large_frees(missing) == "unavailable"
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.return_large_frees(lambda name: Libc()) == "unavailable" and len(calls) == 1


def test_the_threshold_takes_on_a_glibc_linux(monkeypatch) -> None:
    """The real mallopt accepts the call (skipped off glibc)."""
    import ctypes
    import sys

    from kvtool.cli.allocator import return_large_frees

    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    if not sys.platform.startswith("linux"):
        pytest.skip("not Linux")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert return_large_frees() == "set"
