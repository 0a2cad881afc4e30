"""kvtool against the full cache on one GPU at a Llama-3.1-8B shape (random weights): issue 34.

What it measures, per `--shapes` cell (prompt tokens x batch), with kvtool's own timing loop
(`kvtool.bench.measure.run_once`: one prompt phase, then `--new-tokens` greedy one-token forwards):

(a) the full cache with each SDPA backend choice (torch's default; cuDNN attention off): each ratio
    divides by the fastest of them for that column (on an H100 the default's prompt phase, cuDNN
    off's decode), and the other caches run under the fastest prompt phase's choice;
(b) the ceiling: the dense cache cut to the entries kvtool keeps per layer (`truncate_like`);
(c) kvtool without a draft (the shipped smollm2 b0.2 recipe's rules at `--kv-budget` in every layer,
    the prompt compressed once by its own attention: the scoring pass is the whole extra cost);
(d) kvtool's default recipe (the same with the built-in profile's drafted answer, verified),
    its held prompts in pinned host memory (runtime.layer.held_prompt), and on a GPU once more with
    them held on the GPU;
(d') the same with the draft's second round taken from the first's predictions (`Draft.jacobi`);
(c') on a GPU, (c) with each decode step's kvtool work in about 40 eager ops a layer
    (`triton_step.FUSED` off) instead of the four Triton kernels of kernels/triton_step.py (the default);
(c'') on a GPU, (c) with the fused step's score and victim loop in one program per row and KV head
    (`triton_step.SPLIT_GAINS` off) instead of split as the attention is;
each as the median with min-max over `--repeats` runs of: prompt-phase seconds, decode tok/s,
end-to-end tok/s, KV bytes after the run, peak memory in the prompt phase and in the whole run
(torch.cuda.max_memory_allocated on a GPU).
(e) `--capacity`: for each of `--capacity-caches` (full, kvtool without its draft, kvtool), the
    largest batch at `--capacity-prompt` (32768) prompt tokens that runs `--capacity-new-tokens`
    (1024) new tokens, and its throughput: probes at 1 and 2 rows give the peak per row, the batch
    that fits by that line is run in full, and one that runs out of memory backs off.
(f) the prompt kernels alone (kvtool.runtime.kernels.triton_scores) on one layer's q/k/v of each cell:
    exactness against a float64 brute force at 1024 tokens, and time against torch's SDPA; also with
    the output and log-sum-exp from torch's fused kernel (`forward="sdpa"`, kernels/fused_forward.py).
(i) `--generate`: what `generate` users get at the first cell: wall time of `model.generate` (full
    cache) against `handle.generate` (kvtool without its draft; decode steps as a CUDA graph, and
    through transformers' own loop).
(g) `--profile`: torch.profiler tables (top ops by device and host time, kernel launches) of decode
    steps (the graph's kernels also run eagerly, to show each one's device time) and prompt phases at
    the first cell: what to cut next. Profiling the draft's prompt phase takes minutes on a GPU;
    `--profile decode` profiles the decode steps alone (with `--budget-s 0`, nothing else is timed);
    `--profile parts` each part of the recipe's prompt phase (its first round) alone.
(j) `--parts`: kvtool's prompt phase by part at the first cell (`runtime.draft.PARTS`: the prompt's
    forward, each round's draft steps and its draft rows' forward, each timed to the device's end),
    beside the full cache's prompt forward, `--repeats` times interleaved: where the recipe's prompt
    phase goes (`--shape smollm2 --device cpu` gives the CPU's picture at SmolLM2's shape).
It also runs the CUDA exactness checks of benchmarks/cuda_check.py (float64 tiny Llama) on a GPU.

The target (issue 34): kvtool's prompt phase without a draft at most 1.3x the baseline's at 8192x4
and 32768x2 on an H100. The Markdown table it prints is the Llama-3.1-8B-shape table of README.md's
"On a GPU" section and docs/results.md's "On a GPU" (prompt phase, decode, end-to-end, KV and peak
memory, each against the full cache); `--json PATH` keeps every run (docs/results/bench-gpu-*.json). `--budget-s` (default 420) bounds the whole run: cells
that would start after it are skipped and the report says which.

    python benchmarks/gpu_bench.py --shape llama3-8b --shapes 8192x4,32768x2 --repeats 2 --kernel-sweep --profile \
        --capacity-caches full,kvtool-no-draft --json llama3-8b.json   # 8.5 minutes on an H100
    python benchmarks/gpu_bench.py --shape tiny --shapes 64x2 --repeats 1 --no-capacity   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtool.models import use_offline_defaults

use_offline_defaults()  # before transformers is imported: it reads them once

from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtool.bench import measure  # noqa: E402
from kvtool.bench.measure import RunResult, run_once, truncate_like  # noqa: E402
from kvtool.profiles import read_profile  # noqa: E402
from kvtool.profiles.builtin import builtin_profile  # noqa: E402
from kvtool.runtime import attach, uniform_profile  # noqa: E402
from kvtool.runtime import draft as drafting  # noqa: E402
from kvtool.runtime.attach import layer_plans  # noqa: E402
from kvtool.runtime.graphed import Decoder  # noqa: E402
from kvtool.runtime.importance import tune_blocks  # noqa: E402
from kvtool.runtime.kernels import triton_step  # noqa: E402
from kvtool.runtime.layer import held_prompt  # noqa: E402
from kvtool.runtime.steps import Prompt, prompt_forward  # noqa: E402

GIB = 2**30
SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B: 32 layers, 32 query / 8 KV heads of dim 128.
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=5e5, max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    # SmolLM2-135M (the embedded default model), for the CPU's picture of `--parts`.
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # Gemma-3-12B: a hybrid, 5 sliding-window layers (window 1024) to each global one, 16 query / 8 KV
    # heads of dim 256; kvtool's uniform profile gives each sliding layer a window of the budget's share.
    "gemma3-12b": dict(
        family="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        max_position_embeddings=131072, rms_norm_eps=1e-6,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
    ),
    # A CPU smoke run of the hybrid path.
    "tiny-gemma3": dict(
        family="gemma3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64, max_position_embeddings=8192,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    # A CPU smoke run of the script itself.
    "tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    ),
}
WARMUP_TOKENS = 256  # the warm-up run's prompt (compiles kernels, fills allocator caches)
WARMUP_NEW = 4
CAPACITY_PROBE_STEPS = 8  # decode steps of a capacity probe; the rest of the KV growth is projected
# cell name -> (prompt tokens, batch, seconds) of its latest full-size run (the time guard's estimate).
LAST_RUN: dict[str, tuple[int, int, float]] = {}
RECIPE = ("smollm2", 0.2)  # the shipped recipe whose rules the kvtool cells apply uniformly

# Cell names (JSON keys).
FULL_DEFAULT, FULL_NO_CUDNN, CEILING, KVTOOL_NO_DRAFT, KVTOOL, KVTOOL_HELD_ON_GPU = (
    "full (sdpa default)", "full (cuDNN off)", "ceiling", "kvtool, no draft", "kvtool recipe",
    "kvtool recipe, prompt held on the GPU",
)
# The decode steps in eager ops instead of kernels/triton_step.py's four kernels a layer.
KVTOOL_EAGER_NO_DRAFT = "kvtool, no draft, eager step"
KVTOOL_ONE_PROGRAM = "kvtool, no draft, victim search in one program"  # `triton_step.SPLIT_GAINS` off
# The recipe's draft with its second round taken from the first's predictions (`Draft.jacobi`): what
# that saves on a GPU (calibration's cost ladder tries it before it drops a round).
KVTOOL_JACOBI = "kvtool recipe, Jacobi second round"
GPU_ONLY_CELLS = (KVTOOL_HELD_ON_GPU, KVTOOL_EAGER_NO_DRAFT, KVTOOL_ONE_PROGRAM, KVTOOL_JACOBI)


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


# ----- the model and the recipes -----


def build_model(shape: str, device: torch.device) -> LlamaForCausalLM:
    """A random-weight LlamaForCausalLM of `shape`, made on `device` (bf16 on a GPU, float32 on a CPU), sdpa attention."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fields = dict(SHAPES[shape])
    family = fields.pop("family", "llama")
    config_cls, model_cls = (Gemma3TextConfig, Gemma3ForCausalLM) if family == "gemma3" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def recipe_method():
    """The shipped recipe's rules (the kvtool cells apply them at one ratio in every layer, as
    benchmarks/cuda_check.py does: a random-weight model has no calibrated per-layer ratios)."""
    return read_profile(builtin_profile(*RECIPE)).method


def without_draft(method):
    return dataclasses.replace(method, draft=None)


def jacobi_rounds(method):
    """`method` with its draft's later rounds taken from the last one's predictions (`Draft.jacobi`)."""
    draft = method.draft
    return method if draft is None else dataclasses.replace(method, draft=dataclasses.replace(draft, jacobi=True))


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


# ----- cells -----


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
        with setting(held_prompt, "ON_HOST", False):  # the whole batch at once: what holding on the GPU costs
            return run_kvtool(model, prompt, new_tokens, profile, rows_at_once=len(prompt))

    def eager_step(model, prompt, new_tokens, profile):
        with setting(triton_step, "FUSED", False):
            return run_kvtool(model, prompt, new_tokens, profile)

    def one_program(model, prompt, new_tokens, profile):
        with setting(triton_step, "SPLIT_GAINS", False):
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


@contextlib.contextmanager
def setting(module, name: str, value):
    """`module.name` set to `value` for the runs inside: where a draft's held prompts go on a GPU
    (`held_prompt.ON_HOST`), how decode steps run (`triton_step.FUSED`, `triton_step.SPLIT_GAINS`)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


# ----- (i) generate: what users call -----


def generate_cells(model, ids: torch.Tensor, args, method) -> dict[str, Any]:
    """Wall time of `--new-tokens` greedy tokens from `generate`: `model.generate` through a full cache
    (each SDPA choice) and `handle.generate` for kvtool without its draft, its decode steps replayed as
    a CUDA graph (runtime.graphed_generate) and through transformers' own loop; warmed up on a short
    prompt, then interleaved rounds, median (min-max) and tokens/s against the fastest full cache."""
    from kvtool.models.forward import with_cache
    from kvtool.runtime import graphed_generate

    no_draft = uniform_profile(model, args.kv_budget, without_draft(method))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    def full(context):
        def run(prompt):
            with context():
                return model.generate(input_ids=prompt, **with_cache(model, DynamicCache(config=model.config)), **kwargs)
        return run

    def kvtool(mode):
        def run(prompt):
            saved, graphed_generate.MODE = graphed_generate.MODE, mode
            try:
                with attach(model, no_draft) as handle:
                    return handle.generate(input_ids=prompt, **kwargs)
            finally:
                graphed_generate.MODE = saved
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
            _sync_device(ids.device)
            started = time.perf_counter()
            out = run(ids)
            _sync_device(ids.device)
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


# ----- (f) the kernels alone -----


def kernel_check(
    model, shapes: list[tuple[int, int]], device: torch.device, check_tokens: int = 1024, repeats: int = 10,
    sweep: bool = False,
) -> dict[str, Any]:
    """One layer's prompt kernels at the model's head shape: exactness at `check_tokens` tokens (one
    row, 100 of them padding) against the float64 brute force, then the time of each cell against
    torch's causal SDPA on the same q/k/v. On a CPU (TRITON_INTERPRET=1) it only tries the code."""
    from kvtool.runtime.kernels import triton_scores as ts

    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // n_heads
    dtype = next(model.parameters()).dtype
    report: dict[str, Any] = {"available": ts.available(torch.zeros(1, device=device, dtype=dtype))}
    if not report["available"]:
        return report
    import triton

    report["triton"] = triton.__version__
    g = torch.Generator(device=device).manual_seed(3)

    def qkv(bsz, n):
        make = lambda h: torch.randn(bsz, h, n, head_dim, generator=g, device=device, dtype=dtype)  # noqa: E731
        return make(n_heads), make(n_kv), make(n_kv)

    q, k, v = qkv(1, check_tokens)
    starts = torch.tensor([min(100, check_tokens // 4)], device=device)
    out, scores = ts.attention_with_scores_triton(q, k, v, starts, head_dim**-0.5, heads=True, window=32, forward="triton")
    ref_out, ref = ts.reference_scores(q, k, v, starts, head_dim**-0.5, heads=True, window=32)
    report["exactness"] = {
        "tokens": check_tokens,
        "output_max_abs": (out.double() - ref_out).abs().max().item(),
        **{f"{name}_max_rel": ((getattr(scores, name).double() - getattr(ref, name)).abs().max() / getattr(ref, name).abs().max()).item()
           for name in ("importance", "heads", "window")},
    }
    # The fused forward (kernels/fused_forward.py) takes no padding: checked on an unpadded row.
    out, scores = ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, forward="sdpa")
    ref_out, ref = ts.reference_scores(q, k, v, None, head_dim**-0.5, heads=True, window=32)
    report["exactness_sdpa_forward"] = {
        "tokens": check_tokens,
        "output_max_abs": (out.double() - ref_out).abs().max().item(),
        **{f"{name}_max_rel": ((getattr(scores, name).double() - getattr(ref, name)).abs().max() / getattr(ref, name).abs().max()).item()
           for name in ("importance", "heads", "window")},
    }
    del q, k, v, out, scores, ref_out, ref
    from kvtool.runtime.kernels import fused_forward

    timings = {}
    for tokens, batch in shapes:
        try:
            q, k, v = qkv(batch, tokens)
            # What transformers' sdpa_attention_forward runs: K/V repeated per query head (outside the timing).
            k_rep, v_rep = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))
            runs = {
                "sdpa causal (K/V repeated)": lambda: torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True),
                "triton fwd + column sums (heads, window 32)": lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, forward="triton"),
                "triton fwd + column sums (importance only)": lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, forward="triton"),
                SDPA_FWD_SUMS: lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, forward="sdpa"),
                SDPA_FWD_ALONE: lambda: fused_forward.forward_with_lse(q, k, v, head_dim**-0.5),
            }
            cell = {name: device_time(fn, device, repeats) for name, fn in runs.items()}
            base = cell["sdpa causal (K/V repeated)"]
            cell["ratio_to_sdpa"] = {name: s / base for name, s in cell.items() if isinstance(s, float) and name != "sdpa causal (K/V repeated)"}
            fwd_flops, sum_flops = ts.prefill_flops(batch, n_heads, tokens, head_dim)
            cell["sdpa_tflops"] = fwd_flops / base / 1e12
            timings[f"{tokens}x{batch}"] = cell
            del q, k, v, k_rep, v_rep
        except Exception as error:  # noqa: BLE001
            timings[f"{tokens}x{batch}"] = {"error": "out of memory" if is_oom(error) else traceback.format_exc(limit=4)}
        release(device)
    report["one_layer_s"] = timings
    if sweep:
        report["sweep"] = block_sweep(qkv, shapes[0], head_dim, device)
    return report


# The fused-forward cells of (f): torch's fused forward (`triton_scores.FORWARD`'s default) against the Triton one.
SDPA_FWD_SUMS = "sdpa fwd with log-sum-exp + column sums (heads, window 32)"
SDPA_FWD_ALONE = "sdpa fwd with log-sum-exp alone"

# Tile choices `--kernel-sweep` times (fwd_m, fwd_n, warps) and (sum_m, sum_n, warps), 3 stages.
FWD_CHOICES = ((64, 64, 4), (128, 64, 8), (64, 32, 4), (64, 64, 8), (128, 64, 4))
SUM_CHOICES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (64, 128, 8), (64, 32, 4))


def block_sweep(qkv, shape: tuple[int, int], head_dim: int, device: torch.device) -> dict[str, Any]:
    """Both kernels' time (heads and a 32-row window requested) for each forward tile with the
    default column-sum tile, then each column-sum tile with the fastest forward tile: the numbers to
    set `triton_scores.GPU_BLOCKS` from."""
    from kvtool.runtime.kernels import triton_scores as ts

    tokens, batch = shape
    q, k, v = qkv(batch, tokens)
    default = ts.GPU_BLOCKS

    def timed(base: "ts.Blocks", **tiles: int) -> float | str:
        try:
            blocks = dataclasses.replace(base, **tiles)
            return device_time(lambda: ts.attention_with_scores_triton(q, k, v, None, head_dim**-0.5, heads=True, window=32, blocks=blocks, forward="triton"), device, 5)
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory for a tile
            return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"

    fwd = {f"{m}x{n}/{w}": timed(default, fwd_m=m, fwd_n=n, fwd_warps=w) for m, n, w in FWD_CHOICES}
    ok = {key: t for key, t in fwd.items() if isinstance(t, float)}
    best = FWD_CHOICES[list(fwd).index(min(ok, key=ok.get))] if ok else FWD_CHOICES[0]
    base = dataclasses.replace(default, fwd_m=best[0], fwd_n=best[1], fwd_warps=best[2])
    sums = {f"{m}x{n}/{w}": timed(base, sum_m=m, sum_n=n, sum_warps=w) for m, n, w in SUM_CHOICES}
    log(f"kernel sweep at {tokens}x{batch}: forward {fwd}; column sums {sums}")
    return {"shape": f"{tokens}x{batch}", "forward_tiles_s": fwd, "column_sum_tiles_s": sums, "default": dataclasses.asdict(default)}


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


# ----- (g) where the time goes -----


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
        _sync_device(device)
        started = time.perf_counter()
        prompt_forward(model, prompt, DynamicCache(config=model.config))
        _sync_device(device)
        return time.perf_counter() - started

    def kvtool() -> dict[str, float]:
        seconds = dict.fromkeys(drafting.PARTS, 0.0)

        @contextlib.contextmanager
        def part(name: str):
            _sync_device(device)
            started = time.perf_counter()
            yield
            _sync_device(device)
            seconds[name] += time.perf_counter() - started

        with attach(model, recipe) as handle:
            _sync_device(device)
            started = time.perf_counter()
            drafting.prepare(model, prompt, handle.bare_cache, draft, part=part)
            _sync_device(device)
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
            _sync_device(device)
            started = time.perf_counter()
            with profile(activities=activities) as prof:
                measure.decode_steps(model, state, steps)
                _sync_device(device)
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
            _sync_device(device)
            started = time.perf_counter()
            with profile(activities=activities) as prof:
                state = measure.prompt_phase(model, ids, handle.bare_cache, draft=draft)
                _sync_device(device)
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
                _sync_device(device)
                started = time.perf_counter()
                with profile(activities=activities) as prof:
                    yield
                    _sync_device(device)
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


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----- benchmarks/cuda_check.py's exactness checks -----


def cuda_exactness(device: torch.device) -> dict[str, Any]:
    """`exactness` of benchmarks/cuda_check.py (beside this file), imported from its path."""
    path = Path(__file__).with_name("cuda_check.py")
    if not path.is_file():
        return {"note": "benchmarks/cuda_check.py not found"}
    started = time.perf_counter()
    try:
        spec = importlib.util.spec_from_file_location("kvtool_cuda_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        results = module.exactness(device, read_profile(builtin_profile(*RECIPE)))
        return {"checks": results, "passed": all(results.values()), "seconds": time.perf_counter() - started}
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc(limit=6), "passed": False, "seconds": time.perf_counter() - started}


# ----- (h) decode attention alone -----


def decode_attention_check(model, shapes: list[tuple[int, int]], budget: float, device: torch.device) -> dict[str, Any]:
    """One layer's decode attention with scores (`decode_attention_with_scores`) over a kvtool layer's
    slots at each shape (budget * prompt tokens, whole chunks): the path the model's dtype takes on
    this device against the float32 copies it replaced, timed, and both against float64."""
    from kvtool.runtime.importance import decode as decode_module

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    report: dict[str, Any] = {"mixed_bmm": decode_module._HAS_MIXED_BMM, "shapes": {}}
    generator = torch.Generator(device="cpu").manual_seed(3)
    for tokens, batch in shapes:
        slots = -(-int(budget * tokens) // decode_module.SLOT_CHUNK) * decode_module.SLOT_CHUNK
        q = torch.randn(batch, heads, 1, head_dim, generator=generator).to(device, dtype)
        k = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(device, dtype)
        v = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(device, dtype)
        mask = (torch.rand(batch, 1, 1, slots, generator=generator) > 0.05).to(device)
        scale = head_dim ** -0.5
        ref_out, ref_probs = decode_module.decode_attention_with_scores(q.double(), k.double(), v.double(), mask, scale, per_head=True)
        entry: dict[str, Any] = {"slots": slots}

        def run():
            return decode_module.decode_attention_with_scores(q, k, v, mask, scale, per_head=True)

        for name, mixed in (("model dtype (mixed products, chunked values)", None), ("float32 copies", False)):
            saved = decode_module._mixed
            if mixed is False:
                decode_module._mixed = lambda tensor, acc: False
            try:
                out, probs = run()
                entry[name] = {
                    "ms": device_time(run, device, repeats=20) * 1e3,
                    "output_max_abs": float((out.double() - ref_out).abs().max()),
                    "probs_max_abs": float((probs.double() - ref_probs).abs().max()),
                }
            finally:
                decode_module._mixed = saved
        report["shapes"][f"{tokens}x{batch}"] = entry
    return report


# ----- report -----


def fmt(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not stat:
        return "-"
    med, lo, hi = (stat[k] / scale for k in ("median", "min", "max"))
    if lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def ratio(entry: dict[str, Any], key: str) -> str:
    value = entry.get("ratio_to_baseline", {}).get(key)
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['device']}, {report['shape']} (random weights, {report['dtype']}), torch {report['torch']}, "
        f"transformers {report['transformers']}, triton {report.get('triton') or '-'}; kvtool cells: the shipped "
        f"{RECIPE[0]} b{RECIPE[1]:g} recipe's rules at budget {report['kv_budget']:g} in every layer; "
        f"{report['new_tokens']} new tokens; median (min-max) of {report['repeats']} runs; x: against the fastest "
        f"full cache for that column (SDPA choices compared; kvtool and the ceiling run under the fastest prompt phase's).",
        "",
        "| prompt x batch | cache | prompt phase, s | x | decode, tok/s | x | end-to-end, tok/s | x | KV, GiB | x | prompt-phase peak, GiB | x | peak, GiB | x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in report["cells"]:
        label = f"{cell['prompt_tokens']} x {cell['batch']}"
        for name, entry in cell["cells"].items():
            marks = sorted({label for key, label in (("prefill_s", "prompt"), ("decode_tok_s", "decode"), ("end_to_end_tok_s", "end to end"))
                            if cell.get("baselines", {}).get(key) == name})
            shown = f"{name} (baseline: {', '.join(marks)})" if marks else name
            if entry.get("note"):
                shown += f" [{entry['note'].splitlines()[-1][:60]}]"
            lines.append(
                f"| {label} | {shown} | {fmt(entry.get('prefill_s'), digits=3)} | {ratio(entry, 'prefill_s')} "
                f"| {fmt(entry.get('decode_tok_s'), digits=1)} | {ratio(entry, 'decode_tok_s')} "
                f"| {fmt(entry.get('end_to_end_tok_s'), digits=1)} | {ratio(entry, 'end_to_end_tok_s')} "
                f"| {fmt(entry.get('kv_bytes'), GIB)} | {ratio(entry, 'kv_bytes')} "
                f"| {fmt(entry.get('prompt_peak_memory_bytes'), GIB)} | {ratio(entry, 'prompt_peak_memory_bytes')} "
                f"| {fmt(entry.get('peak_memory_bytes'), GIB)} | {ratio(entry, 'peak_memory_bytes')} |"
            )
    parts = report.get("parts")
    if parts and "median" in parts:
        median, full = parts["median"], parts["median"]["full prompt forward"]
        lines += ["", f"The recipe's prompt phase by part at {parts['prompt_tokens']} x {parts['batch']} (draft {parts['draft']}; "
                  f"median of {len(parts['runs'])}; x: of the full cache's prompt forward):", "", "| part | s | x |", "| --- | --- | --- |"]
        lines += [f"| {name} | {seconds:.3f} | {seconds / full:.2f}x |" for name, seconds in median.items()]
    elif parts:
        lines += ["", f"prompt phase by part: {parts['error'].splitlines()[-1]}"]
    cap = report.get("capacity")
    if cap:
        lines += ["", f"Capacity at {cap['prompt_tokens']} prompt tokens, {cap['new_tokens']} new tokens:", "",
                  "| cache | largest batch | x | decode, tok/s | end-to-end, tok/s | x | peak, GiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
        base = cap.get("full", {})
        for name in [n for n in CAPACITY_CACHES if n in cap]:
            entry = cap.get(name, {})
            times = lambda key: (f"{entry[key] / base[key]:.2f}x" if entry.get(key) and base.get(key) else "-")  # noqa: E731
            run = entry.get("run") or {}
            note = entry.get("note") or (entry.get("error") or "").strip().splitlines()[-1:] or [""]
            note = note if isinstance(note, str) else note[0]
            lines.append(
                f"| {name} | {entry.get('batch', '-')} | {times('batch')} | {entry.get('decode_tok_s', float('nan')):.1f} "
                f"| {entry.get('end_to_end_tok_s', float('nan')):.1f} | {times('end_to_end_tok_s')} "
                f"| {run.get('peak_memory_bytes', float('nan')) / GIB:.1f} |"
                + (f" {note}" if note else "")
            )
    gen = report.get("generate")
    if gen and gen.get("cells"):
        lines += ["", f"`generate`, {gen['new_tokens']} greedy new tokens at {gen['prompt_tokens']} x {gen['batch']} "
                  "(wall time, prompt phase included):", "",
                  "| how | seconds | tok/s | x |", "| --- | --- | --- | --- |"]
        for name, entry in gen["cells"].items():
            sec = entry["seconds"]
            lines.append(f"| {name} | {sec['median']:.2f} ({sec['min']:.2f}-{sec['max']:.2f}) | {entry['tok_s']:.1f} "
                         f"| {entry['x']:.2f}x |" if entry.get("x") else f"| {name} | {sec['median']:.2f} | {entry['tok_s']:.1f} | - |")
    dec = report.get("decode_attention")
    if dec and dec.get("shapes"):
        lines += ["", f"Decode attention with scores alone, one layer (median of 20, CUDA events; mixed bmm available: "
                  f"{dec.get('mixed_bmm')}), against float64:", "",
                  "| prompt x batch | slots | path | ms | output max abs | probabilities max abs |", "| --- | --- | --- | --- | --- | --- |"]
        for key, cell in dec["shapes"].items():
            for name, entry in cell.items():
                if isinstance(entry, dict):
                    lines.append(f"| {key} | {cell['slots']} | {name} | {entry['ms']:.3f} | {entry['output_max_abs']:.2e} | {entry['probs_max_abs']:.2e} |")
    kern = report.get("kernels")
    if kern and kern.get("exactness_sdpa_forward"):
        ex = kern["exactness_sdpa_forward"]
        lines += ["", f"The sdpa forward with log-sum-exp and the column sums, against float64 at {ex['tokens']} unpadded tokens: "
                  f"output max abs {ex['output_max_abs']:.2e}, importance max rel {ex['importance_max_rel']:.2e}, "
                  f"heads max rel {ex['heads_max_rel']:.2e}, window max rel {ex['window_max_rel']:.2e}"]
    if kern and kern.get("one_layer_s"):
        ex = kern.get("exactness", {})
        lines += ["", "Prompt kernels alone, one layer (median of 10, CUDA events); against float64 at "
                  f"{ex.get('tokens')} tokens: output max abs {ex.get('output_max_abs', float('nan')):.2e}, "
                  f"importance max rel {ex.get('importance_max_rel', float('nan')):.2e}, "
                  f"window max rel {ex.get('window_max_rel', float('nan')):.2e}:", "",
                  "| prompt x batch | sdpa causal, ms | triton fwd + sums (heads, window), ms | x | importance only, ms | x "
                  "| sdpa fwd with log-sum-exp + sums (heads, window), ms | x | sdpa fwd with log-sum-exp alone, ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for key, cell in kern["one_layer_s"].items():
            if "error" in cell:
                lines.append(f"| {key} | {cell['error'].splitlines()[-1]} | | | | | | | |")
                continue
            a, b, c = (cell[k] for k in ("sdpa causal (K/V repeated)", "triton fwd + column sums (heads, window 32)", "triton fwd + column sums (importance only)"))
            d, e = (cell.get(k, float("nan")) for k in (SDPA_FWD_SUMS, SDPA_FWD_ALONE))
            lines.append(f"| {key} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x | {c * 1e3:.2f} | {c / a:.2f}x | {d * 1e3:.2f} | {d / a:.2f}x | {e * 1e3:.2f} |")
    if kern and kern.get("sweep"):
        sw = kern["sweep"]
        show = lambda d: ", ".join(f"{k} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{k} failed" for k, v in d.items())  # noqa: E731
        lines += ["", f"Tile sweep at {sw['shape']} (both kernels, fwd_m x fwd_n / warps): {show(sw['forward_tiles_s'])}; "
                  f"column sums (sum_m x sum_n / warps) with the fastest forward: {show(sw['column_sum_tiles_s'])}"]
    if report.get("exactness"):
        ex = report["exactness"]
        state = "passed" if ex.get("passed") else "FAILED"
        lines += ["", f"cuda_check exactness: {state}" + (f" ({sum(ex['checks'].values())}/{len(ex['checks'])})" if ex.get("checks") else "")]
    if report["skipped"]:
        lines += ["", "Skipped for the time budget: " + "; ".join(report["skipped"])]
    return "\n".join(lines)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        tokens, batch = (int(x) for x in part.strip().lower().split("x"))
        shapes.append((tokens, batch))
    return shapes


def first_cell_ids(model, shapes: list[tuple[int, int]], seed: int, device: torch.device) -> torch.Tensor:
    """Random prompt ids of the first --shapes cell (the sections that run at it: profile, parts, generate)."""
    tokens, batch = shapes[0]
    return torch.randint(3, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed)).to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--shapes", default="8192x4,32768x2", help="PROMPTxBATCH[,...]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (tiny: 8, which also caps the draft)")
    parser.add_argument("--kv-budget", type=float, default=0.2, help="kept fraction of the kvtool cells")
    parser.add_argument("--capacity", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--capacity-prompt", type=int, default=32768)
    parser.add_argument("--capacity-new-tokens", type=int, default=1024)
    parser.add_argument("--capacity-max-batch", type=int, default=256)
    parser.add_argument("--capacity-caches", type=lambda text: [c.strip() for c in text.split(",")],
                        default=list(CAPACITY_CACHES), help=f"of {', '.join(CAPACITY_CACHES)}")
    parser.add_argument("--capacity-rows", type=int, default=1, help="rows at a time in kvtool-no-draft-by-row's prompt phase")
    parser.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True, help="the truncated-cache cells")
    parser.add_argument("--decode-attention", action=argparse.BooleanOptionalAction, default=None,
                        help="(h) one layer's decode attention with scores, timed and against float64; default: on a GPU")
    parser.add_argument("--capacity-memory-gb", type=float, default=None, help="the memory to plan against (default: the GPU's)")
    parser.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None, help="(f); default: on a GPU")
    parser.add_argument("--kernel-sweep", action="store_true", help="(f) also times tile choices at the first --shapes cell")
    parser.add_argument("--exactness", action=argparse.BooleanOptionalAction, default=None, help="cuda_check's checks; default: on a GPU")
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=None,
                        help="(i) generate's wall time at the first --shapes cell, full against kvtool; default: on a GPU")
    parser.add_argument("--profile", nargs="?", const="all", choices=("all", "decode", "parts"), default=None,
                        help="(g) torch.profiler tables at the first --shapes cell: of decode steps and prompt phases, (decode) of decode steps alone, or (parts) of each part of the recipe's prompt phase")
    parser.add_argument("--parts", action="store_true", help="(j) the recipe's prompt phase by part at the first --shapes cell")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip whatever would start after this many seconds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = 8 if args.shape == "tiny" else 64
    device = torch.device(args.device)
    args.budget_guard = budget = Budget(args.budget_s)
    on_gpu = device.type == "cuda"

    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "shape": args.shape, "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version,
        "kv_budget": args.kv_budget, "new_tokens": args.new_tokens, "repeats": args.repeats, "budget_s": args.budget_s,
        "cells": [], "skipped": budget.skipped,
    }

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=str))

    if args.exactness if args.exactness is not None else on_gpu:
        log("cuda_check exactness ...")
        report["exactness"] = cuda_exactness(device)
        log(f"exactness: {'passed' if report['exactness'].get('passed') else 'FAILED'}")
        save()

    started = time.perf_counter()
    model = build_model(args.shape, device)
    report["model_build_s"] = time.perf_counter() - started
    report["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    log(f"model {args.shape} on {device} in {report['model_build_s']:.1f} s")
    method = recipe_method()
    shapes = parse_shapes(args.shapes)
    if args.kernels if args.kernels is not None else on_gpu:
        try:
            report["kernels"] = kernel_check(model, shapes, device, sweep=args.kernel_sweep)
        except Exception:  # noqa: BLE001
            report["kernels"] = {"error": traceback.format_exc(limit=4)}
        save()
    if args.decode_attention if args.decode_attention is not None else on_gpu:
        try:
            report["decode_attention"] = decode_attention_check(model, shapes, args.kv_budget, device)
        except Exception:  # noqa: BLE001
            report["decode_attention"] = {"error": traceback.format_exc(limit=4)}
        log(f"decode attention: {json.dumps(report['decode_attention'])[:400]}")
        save()
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        if args.profile:
            ids = first_cell_ids(model, shapes, 4, device)
            profile_steps(model, ids, args, method, report.setdefault("profile", {}))
            del ids
            release(device)
            save()
        if args.parts:
            ids = first_cell_ids(model, shapes, 6, device)
            try:
                report["parts"] = prompt_parts(model, ids, args, method)
            except Exception:  # noqa: BLE001
                report["parts"] = {"error": traceback.format_exc(limit=4)}
            del ids
            release(device)
            save()
        for tokens, batch in shapes:
            ids = torch.randint(3, model.config.vocab_size, (batch, tokens), generator=generator).to(device)
            entry: dict[str, Any] = {}
            report["cells"].append(entry)
            shape_cells(model, ids, args, method, entry, save)
            del ids
            release(device)
            save()
        if args.generate if args.generate is not None else on_gpu:
            ids = first_cell_ids(model, shapes, 5, device)
            try:
                report["generate"] = generate_cells(model, ids, args, method)
            except Exception:  # noqa: BLE001
                report["generate"] = {"error": traceback.format_exc(limit=4)}
            log(f"generate: {json.dumps(report['generate'])[:600]}")
            del ids
            release(device)
            save()
        if args.capacity:
            report["capacity"] = {}
            capacity(model, args, method, device, report["capacity"], save)
    report["total_s"] = budget.elapsed
    save()
    print(markdown(report), flush=True)
    failed = report.get("exactness", {}).get("passed") is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
