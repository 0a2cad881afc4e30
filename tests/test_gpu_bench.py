"""benchmarks/gpu_bench.py and the gpu_*.py files beside it, on the CPU: the smoke configuration end to end
(in-process), the capacity search (gpu_cells.py), the kernel section in Triton's interpreter
(gpu_kernels.py), the tables (gpu_tables.py) and the time guard (gpu_timing.py) do what they say."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtool.runtime import draft as drafting

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PARTS = ("gpu_models", "gpu_timing", "gpu_cells", "gpu_kernels", "gpu_profile", "gpu_tables", "gpu_bench")


@pytest.fixture(scope="module")
def gpu():
    """The benchmark's modules (files beside each other, not a package), by their names without `gpu_`."""
    added = str(BENCHMARKS) not in sys.path
    if added:
        sys.path.insert(0, str(BENCHMARKS))
    try:
        modules = {name: importlib.import_module(name) for name in PARTS}
    finally:
        if added:
            sys.path.remove(str(BENCHMARKS))
        for name in PARTS:
            sys.modules.pop(name, None)
    return SimpleNamespace(**{name.removeprefix("gpu_"): module for name, module in modules.items()})


def test_every_part_imports_and_stays_short(gpu):
    for name in PARTS:
        lines = (BENCHMARKS / f"{name}.py").read_text().count("\n")
        assert lines <= 400, (name, lines)
    assert gpu.bench.main is not None and gpu.tables.markdown is not None


def test_smoke_run_on_cpu(gpu, tmp_path, capsys):
    """The smoke configuration, in-process (a subprocess would pay the imports again)."""
    report_path = tmp_path / "report.json"
    code = gpu.bench.main(["--shape", "tiny", "--shapes", "64x2", "--repeats", "1", "--no-capacity", "--json", str(report_path)])
    assert code == 0
    stdout = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    (shape,) = report["cells"]
    assert (shape["prompt_tokens"], shape["batch"]) == (64, 2)
    cells = shape["cells"]
    # No GPU: one SDPA backend choice, which is the baseline.
    assert list(cells) == ["full (sdpa default)", "ceiling", "kvtool, no draft", "kvtool recipe"]
    assert shape["baseline"] == "full (sdpa default)"
    for name, cell in cells.items():
        assert "note" not in cell, (name, cell.get("note"))
        assert len(cell["runs"]) == 1
        assert cell["prefill_s"]["median"] > 0 and cell["decode_tok_s"]["median"] > 0
        assert set(cell["ratio_to_baseline"]) == {"prefill_s", "decode_tok_s", "end_to_end_tok_s", "kv_bytes", "peak_memory_bytes", "prompt_peak_memory_bytes"}
    full_kv = cells["full (sdpa default)"]["kv_bytes"]["median"]
    assert cells["kvtool, no draft"]["kv_bytes"]["median"] < full_kv
    assert cells["ceiling"]["kv_bytes"]["median"] < full_kv
    assert report["skipped"] == [] and "capacity" not in report
    assert set(shape["baselines"].values()) == {"full (sdpa default)"}
    assert "| 64 x 2 | full (sdpa default) (baseline: decode, end to end, prompt) |" in stdout
    assert "| 64 x 2 | kvtool recipe |" in stdout


def test_predicted_batch_extrapolates_the_peak_per_row(gpu):
    def run(batch, peak, kv):
        return gpu.timing.RunResult(prefill_s=1, decode_s=1, batch=batch, new_tokens=8, kv_bytes=kv * batch, kv_slots=(100, 100), peak_memory_bytes=peak,
                               prompt_peak_memory_bytes=peak)

    # 10 GiB fixed, 2 GiB a row, KV 100 slots of 1 MiB a row growing by 100 slots: 3 GiB more a row... of 95 GiB
    gib = gpu.timing.GIB
    small, large = run(1, 12 * gib, 100 * 2**20), run(2, 14 * gib, 100 * 2**20)
    memory = 100 * gib
    per_row = 2 * gib + 100 * 2**20 * 1000 / 100
    assert gpu.cells.predicted_batch(small, large, memory, 1000, 256) == int((0.95 * memory - 10 * gib) // per_row)
    assert gpu.cells.predicted_batch(small, large, memory, 1000, 5) == 5  # the limit


def test_capacity_backs_off_on_out_of_memory(gpu, monkeypatch):
    """Fake runs that run out of memory above a batch size: probes at 1 and 2 predict a batch from the
    memory line, a run there that runs out of memory backs off, and the batch that ran is reported
    with its throughput."""
    model = gpu.models.build_model("tiny", torch.device("cpu"))
    limits = {"full": 5, "kvtool-no-draft": 11, "kvtool": 3}
    gib = gpu.timing.GIB

    def fake(name):
        def run(model, ids, new_tokens, *profile):
            batch = ids.shape[0]
            if batch > limits[name]:
                raise torch.OutOfMemoryError("CUDA out of memory (fake)")
            return gpu.timing.RunResult(
                prefill_s=0.5, decode_s=1.0, batch=batch, new_tokens=new_tokens, kv_bytes=1000 * batch,
                kv_slots=(1,), peak_memory_bytes=gib * batch, prompt_peak_memory_bytes=gib * batch,
            )
        return run

    monkeypatch.setattr(gpu.cells, "release", lambda device: None)  # a gc.collect per probe costs seconds here
    monkeypatch.setattr(gpu.cells, "run_full", fake("full"))
    monkeypatch.setattr(gpu.cells, "run_kvtool", lambda model, ids, n, profile: fake("kvtool" if profile.method.draft else "kvtool-no-draft")(model, ids, n))
    args = argparse.Namespace(
        budget_guard=gpu.timing.Budget(60), capacity_prompt=32, capacity_new_tokens=16, capacity_max_batch=64, kv_budget=0.2,
        capacity_caches=list(gpu.cells.CAPACITY_CACHES), capacity_memory_gb=12.0,
    )
    report = gpu.cells.capacity(model, args, gpu.models.recipe_method(), torch.device("cpu"))
    # 1 GiB a row and 0.95 of 12 GiB: 11 predicted; full backs off 11 -> 10 -> ... -> 5.
    assert [report[name]["predicted_batch"] for name in ("full", "kvtool-no-draft")] == [11, 11]
    assert report["full"]["batch"] == 5 and report["kvtool-no-draft"]["batch"] == 11 and report["kvtool"]["batch"] == 3
    assert report["full"]["decode_tok_s"] == 5 * 16 / 1.0
    assert report["kvtool-no-draft"]["run"]["batch"] == 11
    table = gpu.tables.markdown({
        "device": "cpu", "shape": "tiny", "dtype": "float32", "torch": "x", "transformers": "x", "kv_budget": 0.2,
        "new_tokens": 8, "repeats": 1, "cells": [], "capacity": report, "skipped": [],
    })
    assert "| full | 5 | 1.00x | 80.0 |" in table and "| kvtool-no-draft | 11 | 2.20x |" in table


def test_time_budget_skips_and_says_so(gpu, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    code = gpu.bench.main(["--shape", "tiny", "--shapes", "32x1", "--repeats", "1", "--no-capacity", "--budget-s", "0",
                       "--json", str(report_path)])
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["skipped"] and all("budget-s 0" in line for line in report["skipped"])
    assert all(cell["note"] == "skipped (time budget)" for cell in report["cells"][0]["cells"].values())
    assert "Skipped for the time budget" in capsys.readouterr().out


def test_kernel_section_in_the_interpreter(gpu, monkeypatch):
    """(f) on the CPU through Triton's interpreter: exactness against float64 and the timing table."""
    pytest.importorskip("triton")  # a dev dependency on Linux (tests/test_triton_scores.py needs it there)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = gpu.models.build_model("tiny", torch.device("cpu"))
    monkeypatch.setattr(gpu.kernels, "FWD_CHOICES", ((32, 16, 4), (64, 512, 4)))  # the second is invalid: reported, not raised
    monkeypatch.setattr(gpu.kernels, "SUM_CHOICES", ((16, 32, 4),))
    report = gpu.kernels.kernel_check(model, [(40, 1)], torch.device("cpu"), check_tokens=48, repeats=1, sweep=True)
    assert report["available"]
    ex = report["exactness"]
    assert ex["output_max_abs"] < 1e-4 and ex["importance_max_rel"] < 1e-4 and ex["window_max_rel"] < 1e-4
    cell = report["one_layer_s"]["40x1"]
    assert "error" not in cell and set(cell["ratio_to_sdpa"]) == {
        "triton fwd + column sums (heads, window 32)", "triton fwd + column sums (importance only)",
        gpu.kernels.SDPA_FWD_SUMS, gpu.kernels.SDPA_FWD_ALONE}
    fused = report["exactness_sdpa_forward"]  # the fused forward's log-sum-exp feeding the column sums
    assert fused["output_max_abs"] < 1e-4 and fused["importance_max_rel"] < 1e-4 and fused["window_max_rel"] < 1e-4
    table = gpu.tables.markdown({
        "device": "cpu", "shape": "tiny", "dtype": "float32", "torch": "x", "transformers": "x", "kv_budget": 0.2,
        "new_tokens": 8, "repeats": 1, "cells": [], "kernels": report, "skipped": [],
    })
    assert "| 40x1 |" in table
    sweep = report["sweep"]
    assert isinstance(sweep["forward_tiles_s"]["32x16/4"], float) and "failed" in table
    assert isinstance(sweep["column_sum_tiles_s"]["16x32/4"], float)


def test_prompt_phase_by_part(gpu, tmp_path, capsys):
    """(j): every part of the draft's prompt phase is timed, the parts add up to the whole (nothing
    outside them), and the table shows each against the full cache's prompt forward."""
    report_path = tmp_path / "report.json"
    code = gpu.bench.main(["--shape", "tiny", "--shapes", "64x2", "--repeats", "2", "--no-capacity", "--parts",
                       "--budget-s", "0", "--json", str(report_path)])
    assert code == 0
    parts = json.loads(report_path.read_text())["parts"]
    assert "error" not in parts, parts.get("error")
    assert parts["draft"] == {"tokens": 8, "rounds": 2, "verify": True, "jacobi": False}
    assert len(parts["runs"]) == 2
    for run in parts["runs"]:
        assert set(run) == {"full prompt forward", "kvtool prompt phase", *drafting.PARTS}
        assert all(run[name] > 0 for name in drafting.PARTS)
        assert sum(run[name] for name in drafting.PARTS) == pytest.approx(run["kvtool prompt phase"], rel=0.1)
    assert "| draft steps |" in capsys.readouterr().out


def test_profile_of_each_part(gpu, tmp_path):
    """`--profile parts`: one profiler table per part of the draft's prompt phase (its first round),
    and no decode or whole-phase profile."""
    report_path = tmp_path / "report.json"
    code = gpu.bench.main(["--shape", "tiny", "--shapes", "64x2", "--repeats", "1", "--no-capacity", "--profile", "parts",
                       "--budget-s", "0", "--json", str(report_path)])
    assert code == 0
    profile = json.loads(report_path.read_text())["profile"]
    tables = {name: entry for name, entry in profile.items() if isinstance(entry, dict)}
    assert set(tables) == {f"part: {name}" for name in drafting.PARTS}
    for entry in tables.values():
        assert "error" not in entry, entry.get("error")
        assert entry["seconds_profiled"] > 0 and "aten::" in entry["by_host_time"]
