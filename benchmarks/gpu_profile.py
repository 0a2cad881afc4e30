"""Where the time goes, for benchmarks/gpu_bench.py: the recipe's prompt phase by part (j), profiler tables (g).

`prompt_parts` times each part of the recipe's prompt phase (`kvtool.runtime.draft.PARTS`) beside the
full cache's prompt forward; `profile_steps` gives torch.profiler tables of decode steps, prompt phases
or each part of the prompt phase: what to cut next, not a result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # the gpu_* modules beside this one (not a package)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import without_draft  # noqa: E402
from gpu_timing import WARMUP_TOKENS, log, release, sync_device  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvtool.bench import measure  # noqa: E402
from kvtool.runtime import attach, uniform_profile  # noqa: E402
from kvtool.runtime import draft as drafting  # noqa: E402
from kvtool.runtime.graphed import Decoder  # noqa: E402
from kvtool.runtime.importance import tune_blocks  # noqa: E402
from kvtool.runtime.steps import Prompt, prompt_forward  # noqa: E402


def prompt_parts(model, ids: torch.Tensor, args, method) -> dict[str, Any]:
    """(j) The recipe's prompt phase by part (`drafting.PARTS`, each ended by a device sync, which
    takes away what the parts overlap) and the full cache's prompt forward, `args.repeats` times
    interleaved, each repeat starting with the other; the median seconds of each, and of the whole
    prompt phase."""
    device = ids.device
    recipe = uniform_profile(model, args.kv_budget, method)
    draft = measure.capped(recipe.method.draft, args.new_tokens)
    prompt = Prompt.of({"input_ids": ids})

    def full() -> float:
        sync_device(device)
        started = time.perf_counter()
        prompt_forward(model, prompt, DynamicCache(config=model.config))
        sync_device(device)
        return time.perf_counter() - started

    def kvtool() -> dict[str, float]:
        seconds = dict.fromkeys(drafting.PARTS, 0.0)

        @contextlib.contextmanager
        def part(name: str):
            sync_device(device)
            started = time.perf_counter()
            yield
            sync_device(device)
            seconds[name] += time.perf_counter() - started

        with attach(model, recipe) as handle:
            sync_device(device)
            started = time.perf_counter()
            drafting.prepare(model, prompt, handle.bare_cache, draft, part=part)
            sync_device(device)
            seconds["kvtool prompt phase"] = time.perf_counter() - started
        return seconds

    if device.type == "cpu":  # the CPU path's block size, measured before the timed runs (as kvtool bench does)
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        tune_blocks(config.num_attention_heads, config.num_key_value_heads, head_dim, ids.shape[1], next(model.parameters()).dtype)
    with attach(model, recipe) as handle:  # warm-up: kernels, allocator caches
        drafting.prepare(model, Prompt.of({"input_ids": ids[:, :WARMUP_TOKENS]}), handle.bare_cache, draft)
    runs = []
    for repeat in range(args.repeats):
        # Each repeat starts with the other one: a process's first wide forward runs slower (docs/results.md).
        if repeat % 2:
            parts = kvtool()
            runs.append({"full prompt forward": full(), **parts})
        else:
            runs.append({"full prompt forward": full(), **kvtool()})
        release(device)
        log(f"parts: {json.dumps({k: round(v, 3) for k, v in runs[-1].items()})}")
    median = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    return {"prompt_tokens": ids.shape[1], "batch": ids.shape[0], "draft": dataclasses.asdict(draft) if draft else None,
            "runs": runs, "median": median}


def profile_steps(model, ids: torch.Tensor, args, method, report: dict[str, Any], steps: int = 8) -> dict[str, Any]:
    """torch.profiler over `steps` decode steps of the full cache and of kvtool without a draft, and
    over kvtool's prompt phase without and with the draft: the top ops by device time (self CPU time
    on a CPU) and kernel launches per decode step. What to cut next, not a result."""
    from torch.profiler import ProfilerActivity, profile

    device = ids.device
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    report.update(steps=steps, prompt_tokens=ids.shape[1], batch=ids.shape[0])

    def tables(prof) -> dict[str, Any]:
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        return {
            "by_device_time": events.table(sort_by=key, row_limit=25, max_name_column_width=70),
            "by_host_time": events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
            "launches": launches,
        }

    recipe = uniform_profile(model, args.kv_budget, method)
    no_draft = uniform_profile(model, args.kv_budget, without_draft(method))
    # A graph replay's kernels may not show one by one: the same kernels run eagerly ("fixed" slots)
    # show what each costs on the device.
    caches = {
        "full": (None, lambda: DynamicCache(config=model.config), "auto"),
        "kvtool, no draft": (no_draft, None, "auto"),
        "kvtool, no draft, the graph's kernels run eagerly": (no_draft, None, "fixed"),
    }
    for name, (prof_profile, make, mode) in caches.items() if args.profile in ("all", "decode") else ():
        context = attach(model, prof_profile) if prof_profile is not None else contextlib.nullcontext(None)
        with _recorded(report, f"decode: {name}"), context as handle:
            state = measure.prompt_phase(model, ids, make or handle.bare_cache)
            state.planned = steps + 2
            if mode != "auto":
                state.decoder = Decoder(model, state.cache, state.planned, mode)
            measure.decode_steps(model, state, 2)
            sync_device(device)
            started = time.perf_counter()
            with profile(activities=activities) as prof:
                measure.decode_steps(model, state, steps)
                sync_device(device)
            entry = tables(prof)
            entry["step_ms_profiled"] = (time.perf_counter() - started) / steps * 1e3
            entry["launches_per_step"] = entry["launches"] / steps
            report[f"decode: {name}"] = entry
            del state
            log(f"profile decode {name}: {entry['launches_per_step']:.0f} launches a step, {entry['step_ms_profiled']:.1f} ms a step profiled")
        release(device)
    for name, prof_profile in (("kvtool, no draft", no_draft), ("kvtool recipe", recipe)) if args.profile == "all" else ():
        with _recorded(report, f"prompt phase: {name}"), attach(model, prof_profile) as handle:
            draft = measure.capped(prof_profile.method.draft, args.new_tokens)
            measure.prompt_phase(model, ids[:, :WARMUP_TOKENS], handle.bare_cache, draft=draft)
            sync_device(device)
            started = time.perf_counter()
            with profile(activities=activities) as prof:
                state = measure.prompt_phase(model, ids, handle.bare_cache, draft=draft)
                sync_device(device)
            entry = tables(prof)
            entry["seconds_profiled"] = time.perf_counter() - started
            report[f"prompt phase: {name}"] = entry
            del state
            log(f"profile prompt phase {name}: {entry['seconds_profiled']:.2f} s profiled, {entry['launches']} launches")
        release(device)
    if args.profile == "parts":
        with _recorded(report, "prompt phase by part"), attach(model, recipe) as handle:
            draft = measure.capped(recipe.method.draft, args.new_tokens)
            prompt = Prompt.of({"input_ids": ids})
            drafting.prepare(model, prompt, handle.bare_cache, draft)  # warm-up at full size (pinned pool)
            release(device)

            @contextlib.contextmanager
            def part(name: str):
                # Each part's first time (round 1) only: round 2 runs the same ops.
                if f"part: {name}" in report:
                    yield
                    return
                sync_device(device)
                started = time.perf_counter()
                with profile(activities=activities) as prof:
                    yield
                    sync_device(device)
                entry = tables(prof)
                entry["seconds_profiled"] = time.perf_counter() - started
                report[f"part: {name}"] = entry
                log(f"profile part {name}: {entry['seconds_profiled']:.2f} s profiled, {entry['launches']} launches")

            drafting.prepare(model, prompt, handle.bare_cache, draft, part=part)
        release(device)
    return report


@contextlib.contextmanager
def _recorded(report: dict[str, Any], name: str):
    """A failure inside is written into report[name] instead of ending the profile."""
    try:
        yield
    except Exception:  # noqa: BLE001
        report[name] = {"error": traceback.format_exc(limit=6)}
        log(f"profile {name} failed: {report[name]['error'].strip().splitlines()[-1]}")
