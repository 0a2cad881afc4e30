"""kvtool's timing loop as benchmarks/gpu_bench.py uses it: runs of one cache, cells measured in turn, ratios.

Every call into kvtool.bench.measure's `run_once` is in `run_full`, `run_ceiling` and `run_kvtool`;
`measure_cells` warms each cell up, runs them interleaved `--repeats` times within the time guard
(`Budget`) and summarises each metric as its median and min-max; `add_ratios` divides each by the
fastest full cache's. `device_time` times one call on the device (CUDA events on a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from kvtool.models import use_offline_defaults

use_offline_defaults()  # before transformers is imported: it reads them once

from transformers import DynamicCache  # noqa: E402

from kvtool.bench import measure  # noqa: E402
from kvtool.bench.measure import RunResult, run_once, truncate_like  # noqa: E402
from kvtool.runtime import attach  # noqa: E402
from kvtool.runtime.attach import layer_plans  # noqa: E402

GIB = 2**30
WARMUP_TOKENS = 256  # the warm-up run's prompt (compiles kernels, fills allocator caches)
WARMUP_NEW = 4
# cell name -> (prompt tokens, batch, seconds) of its latest full-size run (the time guard's estimate).
LAST_RUN: dict[str, tuple[int, int, float]] = {}


class Budget:
    """The whole run's time guard: `allows(estimate)` is False once starting would pass the limit."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.perf_counter()
        self.skipped: list[str] = []

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def allows(self, what: str, estimate: float = 0.0) -> bool:
        if self.elapsed + estimate <= self.seconds:
            return True
        self.skipped.append(f"{what} (at {self.elapsed:.0f} s, estimated {estimate:.0f} s more; --budget-s {self.seconds:g})")
        log(f"skipped: {self.skipped[-1]}")
        return False


def log(message: str) -> None:
    print(f"[gpu_bench] {message}", file=sys.stderr, flush=True)


# ----- kvtool's timing loop: every call into kvtool.bench.measure is in these three functions -----


def run_full(model, ids: torch.Tensor, new_tokens: int) -> RunResult:
    return run_once(model, ids, new_tokens, lambda: DynamicCache(config=model.config))


def run_ceiling(model, ids: torch.Tensor, new_tokens: int, profile) -> RunResult:
    plans = layer_plans(profile)
    return run_once(model, ids, new_tokens, lambda: DynamicCache(config=model.config), lambda cache: truncate_like(cache, plans))


def run_kvtool(model, ids: torch.Tensor, new_tokens: int, profile, rows_at_once: int | None = None) -> RunResult:
    """`run_bench`'s kvtool run: the bare cache, the profile's draft capped at the answer's length
    (`rows_at_once`: the prompt phase that many rows at a time; None, as `prepare` chooses:
    `kvtool.runtime.row_groups`)."""
    with attach(model, profile) as handle:
        draft = measure.capped(profile.method.draft, new_tokens)
        return run_once(model, ids, new_tokens, handle.bare_cache, draft=draft, rows_at_once=rows_at_once)



@contextlib.contextmanager
def cudnn_sdp(enabled: bool):
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


METRICS = {
    "prefill_s": lambda r: r.prefill_s,
    "decode_tok_s": lambda r: r.decode_tok_s,
    "end_to_end_tok_s": lambda r: r.end_to_end_tok_s,
    "kv_bytes": lambda r: float(r.kv_bytes),
    "peak_memory_bytes": lambda r: float(r.peak_memory_bytes),
    "prompt_peak_memory_bytes": lambda r: float(r.prompt_peak_memory_bytes),
}


def summarise(runs: list[RunResult]) -> dict[str, Any]:
    return {name: spread([get(r) for r in runs]) for name, get in METRICS.items()}


def measure_cells(
    cells: dict[str, Callable[[torch.Tensor, int], RunResult]],
    ids: torch.Tensor,
    new_tokens: int,
    repeats: int,
    budget: Budget,
    label: str,
    live: dict[str, Any] | None = None,
    checkpoint: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, Any]]:
    """Warm each cell up once on a short prompt, then `repeats` rounds running every cell in turn
    (interleaved, as `run_bench` does, so drift hits all alike). A cell that runs out of memory is
    reported as such; one the time budget leaves out keeps the runs it has. After every run the
    cells so far are written into `live` and `checkpoint()` is called (the JSON survives a kill).
    The time guard knows a cell's run time only from its previous run: the first full-size run of
    a slow cell can pass `--budget-s` by that run's length."""
    device = ids.device
    runs: dict[str, list[RunResult]] = {name: [] for name in cells}
    errors: dict[str, str] = {}
    tokens, batch = ids.shape[1], ids.shape[0]
    # Before its first run here, a cell's estimate is its last run at an earlier shape, scaled as
    # attention grows (tokens^2 x batch): a slow cell at 8k must not start an hour at 32k.
    last: dict[str, float] = {
        name: seconds * (tokens**2 * batch) / (t0**2 * b0) for name, (t0, b0, seconds) in LAST_RUN.items() if name in cells
    }
    for name, cell in cells.items():
        if not budget.allows(f"{label} {name}: warm-up"):
            errors[name] = "skipped (time budget)"
            continue
        started = time.perf_counter()
        try:
            cell(ids[:, : min(WARMUP_TOKENS, ids.shape[1])], min(WARMUP_NEW, new_tokens))
        except Exception as error:  # noqa: BLE001 - reported in the cell, the others still run
            errors[name] = "out of memory" if is_oom(error) else traceback.format_exc(limit=4)
            log(f"{label} {name}: warm-up failed: {errors[name].splitlines()[-1]}")
        release(device)  # outside the handler: the traceback's frames hold the failed run's tensors
        log(f"{label} {name}: warm-up {time.perf_counter() - started:.1f} s")
    for round_index in range(repeats):
        for name, cell in cells.items():
            if name in errors:
                continue
            if not budget.allows(f"{label} {name}: run {round_index + 1}/{repeats}", last.get(name, 0.0)):
                errors[name] = f"time budget: {len(runs[name])} of {repeats} runs"
                continue
            started = time.perf_counter()
            try:
                result = cell(ids, new_tokens)
            except Exception as error:  # noqa: BLE001
                errors[name] = "out of memory" if is_oom(error) else traceback.format_exc(limit=4)
                log(f"{label} {name}: failed: {errors[name].splitlines()[-1]}")
            if name in errors:
                release(device)
                continue
            last[name] = time.perf_counter() - started
            LAST_RUN[name] = (tokens, batch, last[name])
            runs[name].append(result)
            log(
                f"{label} {name}: run {round_index + 1}: prompt {result.prefill_s:.3f} s, "
                f"decode {result.decode_tok_s:.1f} tok/s, peak {result.peak_memory_bytes / GIB:.2f} GiB ({last[name]:.1f} s)"
            )
            if live is not None:
                live.update(_entries(runs, errors))
                checkpoint()
    return _entries(runs, errors)


def _entries(runs: dict[str, list[RunResult]], errors: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in runs:
        entry: dict[str, Any] = {"runs": [dataclasses.asdict(r) for r in runs[name]], **summarise(runs[name])}
        if name in errors:
            entry["note"] = errors[name]
        out[name] = entry
    return out


# Lower is better for these; tok/s are higher-is-better.
LOWER_IS_BETTER = ("prefill_s", "kv_bytes", "peak_memory_bytes", "prompt_peak_memory_bytes")


def add_ratios(cells: dict[str, dict[str, Any]], fulls: list[str]) -> dict[str, str]:
    """Each cell's medians over the fastest full cache's for that metric (the full cells `fulls`
    under each SDPA choice: the fastest prompt phase may come from one, the fastest decode from
    another). Returns which full cell each metric divides by."""
    bases: dict[str, str] = {}
    for key in METRICS:
        timed = {name: cells[name][key]["median"] for name in fulls if cells.get(name, {}).get(key)}
        if timed:
            pick = min if key in LOWER_IS_BETTER else max
            bases[key] = pick(timed, key=timed.get)
    for entry in cells.values():
        ratios = {}
        for key, base in bases.items():
            mine, theirs = entry.get(key), cells[base][key]
            if mine and theirs["median"]:
                ratios[key] = mine["median"] / theirs["median"]
        entry["ratio_to_baseline"] = ratios
    return bases


def device_time(fn: Callable[[], Any], device: torch.device, repeats: int = 10) -> float:
    """Median seconds of `fn` (CUDA events on a GPU, the wall clock elsewhere), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)



def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
