"""The cells of benchmarks/gpu_bench.py's report: each cache at one shape, `generate`, and the largest batch.

`shape_cells` runs (a)-(d) at one prompt x batch: the full cache under each SDPA choice, the ceiling,
kvtool without and with its draft, and on a GPU the variants that time one runtime setting against its
default (`kvtool.runtime.settings`). `generate_cells` times `generate` (i), `capacity` the largest
batch that runs (e).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # the gpu_* modules beside this one (not a package)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import jacobi_rounds, without_draft  # noqa: E402
from gpu_timing import (  # noqa: E402
    GIB, LAST_RUN, WARMUP_TOKENS, Budget, add_ratios, cudnn_sdp, is_oom, log, measure_cells, release, run_ceiling,
    run_full, run_kvtool, spread, sync_device,
)
from transformers import DynamicCache  # noqa: E402

from kvtool.bench.measure import RunResult  # noqa: E402
from kvtool.runtime import attach, uniform_profile, use_settings  # noqa: E402

CAPACITY_PROBE_STEPS = 8  # decode steps of a capacity probe; the rest of the KV growth is projected

# Cell names (JSON keys).
FULL_DEFAULT, FULL_NO_CUDNN, CEILING, KVTOOL_NO_DRAFT, KVTOOL, KVTOOL_HELD_ON_GPU = (
    "full (sdpa default)", "full (cuDNN off)", "ceiling", "kvtool, no draft", "kvtool recipe",
    "kvtool recipe, prompt held on the GPU",
)
# The decode steps in eager ops instead of kernels/triton_step.py's four kernels a layer (`fused_decode_step` off).
KVTOOL_EAGER_NO_DRAFT = "kvtool, no draft, eager step"
KVTOOL_ONE_PROGRAM = "kvtool, no draft, victim search in one program"  # `split_victim_search` off
# The recipe's draft with its second round taken from the first's predictions (`Draft.jacobi`): what
# that saves on a GPU (calibration's cost ladder tries it before it drops a round).
KVTOOL_JACOBI = "kvtool recipe, Jacobi second round"
GPU_ONLY_CELLS = (KVTOOL_HELD_ON_GPU, KVTOOL_EAGER_NO_DRAFT, KVTOOL_ONE_PROGRAM, KVTOOL_JACOBI)


def shape_cells(model, ids: torch.Tensor, args, method, entry: dict[str, Any], checkpoint: Callable[[], None]) -> None:
    """(a)-(d) at one prompt x batch, into `entry` (updated after every run)."""
    device = ids.device
    label = f"{ids.shape[1]}x{ids.shape[0]}"
    budget: Budget = args.budget_guard
    recipe = uniform_profile(model, args.kv_budget, method)
    no_draft = uniform_profile(model, args.kv_budget, without_draft(method))
    jacobi = uniform_profile(model, args.kv_budget, jacobi_rounds(method))
    # (a) the full cache under each SDPA backend choice; the fastest prompt phase is the baseline.
    backends = {FULL_DEFAULT: contextlib.nullcontext}
    if device.type == "cuda":
        backends[FULL_NO_CUDNN] = lambda: cudnn_sdp(False)

    def full_under(context):
        def cell(prompt, new_tokens):
            with context():
                return run_full(model, prompt, new_tokens)
        return cell

    live = entry.setdefault("cells", {})
    entry.update(prompt_tokens=ids.shape[1], batch=ids.shape[0], baseline=FULL_DEFAULT)
    full = measure_cells(
        {name: full_under(ctx) for name, ctx in backends.items()}, ids, args.new_tokens, args.repeats, budget, label, live, checkpoint,
    )
    timed = {name: entry["prefill_s"]["median"] for name, entry in full.items() if entry.get("prefill_s")}
    baseline = min(timed, key=timed.get) if timed else FULL_DEFAULT
    context = backends[baseline]
    entry["baseline"] = baseline
    log(f"{label}: baseline is {baseline}")

    # (b)-(d) under the baseline's backend choice, interleaved.
    def under(run, profile):
        def cell(prompt, new_tokens):
            with context():
                return run(model, prompt, new_tokens, profile)
        return cell

    def held_on_gpu(model, prompt, new_tokens, profile):
        with use_settings(hold_prompt_on_host=False):  # the whole batch at once: what holding on the GPU costs
            return run_kvtool(model, prompt, new_tokens, profile, rows_at_once=len(prompt))

    def eager_step(model, prompt, new_tokens, profile):
        with use_settings(fused_decode_step=False):
            return run_kvtool(model, prompt, new_tokens, profile)

    def one_program(model, prompt, new_tokens, profile):
        with use_settings(split_victim_search=False):
            return run_kvtool(model, prompt, new_tokens, profile)

    others = {
        CEILING: under(run_ceiling, no_draft), KVTOOL_NO_DRAFT: under(run_kvtool, no_draft), KVTOOL: under(run_kvtool, recipe),
        KVTOOL_HELD_ON_GPU: under(held_on_gpu, recipe),
        KVTOOL_EAGER_NO_DRAFT: under(eager_step, no_draft), KVTOOL_ONE_PROGRAM: under(one_program, no_draft),
        KVTOOL_JACOBI: under(run_kvtool, jacobi),
    }
    if jacobi.method.draft == recipe.method.draft:
        del others[KVTOOL_JACOBI]
    if not args.ceiling:
        del others[CEILING]
    if device.type != "cuda":  # the same cells as the recipe's and kvtool's without a draft off a GPU
        for name in GPU_ONLY_CELLS:
            del others[name]
    rest = measure_cells(
        others,
        ids, args.new_tokens, args.repeats, budget, label, live, checkpoint,
    )
    live.clear()
    live.update({**full, **rest})
    entry["baselines"] = add_ratios(live, list(full))
    checkpoint()


# ----- (i) generate: what users call -----


def generate_cells(model, ids: torch.Tensor, args, method) -> dict[str, Any]:
    """Wall time of `--new-tokens` greedy tokens from `generate`: `model.generate` through a full cache
    (each SDPA choice) and `handle.generate` for kvtool without its draft, its decode steps replayed as
    a CUDA graph (runtime.graphed_generate) and through transformers' own loop; warmed up on a short
    prompt, then interleaved rounds, median (min-max) and tokens/s against the fastest full cache."""
    from kvtool.models.forward import with_cache

    no_draft = uniform_profile(model, args.kv_budget, without_draft(method))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    def full(context):
        def run(prompt):
            with context():
                return model.generate(input_ids=prompt, **with_cache(model, DynamicCache(config=model.config)), **kwargs)
        return run

    def kvtool(loop):
        def run(prompt):
            with use_settings(generate_loop=loop), attach(model, no_draft) as handle:
                return handle.generate(input_ids=prompt, **kwargs)
        return run

    cells = {FULL_DEFAULT: full(contextlib.nullcontext), "kvtool, no draft (CUDA graph)": kvtool("auto"),
             "kvtool, no draft (transformers' loop)": kvtool("off")}
    if ids.device.type == "cuda":
        cells[FULL_NO_CUDNN] = full(lambda: cudnn_sdp(False))
    seconds: dict[str, list[float]] = {name: [] for name in cells}
    for name, run in cells.items():
        run(ids[:, :WARMUP_TOKENS])
    for _ in range(args.repeats):
        for name, run in cells.items():
            if not args.budget_guard.allows(f"generate {name}", LAST_RUN.get(f"generate {name}", (0, 0, 0.0))[2]):
                continue
            release(ids.device)
            sync_device(ids.device)
            started = time.perf_counter()
            out = run(ids)
            sync_device(ids.device)
            seconds[name].append(time.perf_counter() - started)
            LAST_RUN[f"generate {name}"] = (ids.shape[1], ids.shape[0], seconds[name][-1])
            assert out.shape[1] == ids.shape[1] + args.new_tokens, out.shape
            log(f"generate {name}: {seconds[name][-1]:.2f} s")
    new = ids.shape[0] * args.new_tokens
    report = {"prompt_tokens": ids.shape[1], "batch": ids.shape[0], "new_tokens": args.new_tokens, "cells": {}}
    for name, values in seconds.items():
        if values:
            report["cells"][name] = {"seconds": spread(values), "tok_s": new / statistics.median(values)}
    fulls = [report["cells"][name]["tok_s"] for name in (FULL_DEFAULT, FULL_NO_CUDNN) if name in report["cells"]]
    for entry in report["cells"].values():
        entry["x"] = entry["tok_s"] / max(fulls) if fulls else None
    return report


# ----- (e) capacity -----


CAPACITY_CACHES = {
    "full": "the full cache",
    "kvtool-no-draft": "kvtool without its draft",
    "kvtool-no-draft-by-row": "kvtool without its draft, the prompt phase --capacity-rows rows at a time",
    "kvtool": "kvtool's recipe",
}
MEMORY_HEADROOM = 0.95  # the share of the device's memory a predicted batch may plan to use


def predicted_batch(small: RunResult, large: RunResult, memory: float, growth_steps: int, limit: int) -> int:
    """The largest batch whose peak, extrapolated linearly from probes at two batch sizes, plus each
    row's KV growth over `growth_steps` more decode steps, fits in MEMORY_HEADROOM of `memory`."""
    per_row = (large.peak_memory_bytes - small.peak_memory_bytes) / max(1, large.batch - small.batch)
    fixed = small.peak_memory_bytes - per_row * small.batch
    growth = large.kv_bytes / large.batch * growth_steps / max(1, sum(large.kv_slots) / len(large.kv_slots))
    if per_row + growth <= 0:
        return limit
    return max(0, min(limit, int((MEMORY_HEADROOM * memory - fixed) // (per_row + growth))))


def capacity(
    model, args, method, device: torch.device, report: dict[str, Any] | None = None, checkpoint: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """(e): for each of `--capacity-caches`, the largest batch at `--capacity-prompt` tokens that runs
    a prompt phase and `--capacity-new-tokens` decode steps, and its throughput there. Probes at batch
    1 and 2 (prompt phase and CAPACITY_PROBE_STEPS steps) give the peak memory per row; the batch that
    fits by that line (with each row's KV growth over the new tokens) is then run in full. If it runs
    out of memory, the next try is an eighth smaller (at least one less), and the batch reported is
    the one that ran. Without a GPU, `--capacity-memory-gb` stands for the device's memory."""
    budget: Budget = args.budget_guard
    tokens, new_tokens = args.capacity_prompt, args.capacity_new_tokens
    memory = args.capacity_memory_gb * GIB if getattr(args, "capacity_memory_gb", None) else None
    if memory is None and device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    recipe = uniform_profile(model, args.kv_budget, method)
    no_draft = uniform_profile(model, args.kv_budget, without_draft(method))
    runners = {
        "full": lambda ids, n: run_full(model, ids, n),
        "kvtool-no-draft": lambda ids, n: run_kvtool(model, ids, n, no_draft),
        "kvtool-no-draft-by-row": lambda ids, n: run_kvtool(model, ids, n, no_draft, args.capacity_rows),
        "kvtool": lambda ids, n: run_kvtool(model, ids, n, recipe),
    }
    generator = torch.Generator().manual_seed(2)
    report = {} if report is None else report
    report.update(prompt_tokens=tokens, new_tokens=new_tokens, device_memory_bytes=memory)

    def attempt(name: str, batch: int, steps: int, like: RunResult | None = None) -> RunResult | None:
        # A run's time, estimated from a probe `like`: the prompt phase grows with the rows, a step slowly.
        estimate = 0.0 if like is None else like.prefill_s * batch / like.batch + like.decode_s / like.new_tokens * steps * (batch / like.batch) ** 0.5
        if not budget.allows(f"capacity {name}: batch {batch}, {steps} new tokens", estimate):
            raise TimeoutError("time budget")
        ids = torch.randint(3, model.config.vocab_size, (batch, tokens), generator=generator).to(device)
        release(device)
        try:
            return runners[name](ids, steps)
        except Exception as error:  # noqa: BLE001
            if not is_oom(error):
                raise
        del ids
        release(device)
        log(f"capacity {name}: batch {batch} with {steps} new tokens ran out of memory")
        return None

    for name in args.capacity_caches:
        entry: dict[str, Any] = report.setdefault(name, {})
        try:
            probes = [attempt(name, batch, CAPACITY_PROBE_STEPS) for batch in (1, 2)]
            entry["probes"] = [None if p is None else dataclasses.asdict(p) for p in probes]
            if None in probes:
                entry.update(batch=int(probes[0] is not None), note="batch 2 does not fit" if probes[0] else "batch 1 does not fit")
                continue
            batch = args.capacity_max_batch if memory is None else predicted_batch(*probes, memory, new_tokens, args.capacity_max_batch)
            entry["predicted_batch"] = batch
            log(f"capacity {name}: predicted largest batch {batch}")
            while batch > 0:
                result = attempt(name, batch, new_tokens, probes[1])
                if result is not None:
                    entry.update(batch=batch, run=dataclasses.asdict(result), decode_tok_s=result.decode_tok_s,
                                 end_to_end_tok_s=result.end_to_end_tok_s)
                    log(f"capacity {name}: batch {batch} ran: peak {result.peak_memory_bytes / GIB:.1f} GiB, "
                        f"{result.end_to_end_tok_s:.1f} tok/s end to end")
                    break
                batch -= max(1, batch // 8)
            else:
                entry["batch"] = 0
            if batch == args.capacity_max_batch:
                entry["note"] = f"at the --capacity-max-batch limit ({batch}); more may fit"
        except TimeoutError:
            entry["note"] = "time budget"
        except Exception:  # noqa: BLE001
            entry["error"] = traceback.format_exc(limit=4)
        finally:
            release(device)
            checkpoint()
    return report
