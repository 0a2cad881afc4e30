"""kvtool against the full cache on one GPU at a Llama-3.1-8B shape (random weights).

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
    (`use_settings(fused_decode_step=False)`, kvtool.runtime.settings) instead of the four Triton
    kernels of kernels/triton_step.py (the default);
(c'') on a GPU, (c) with the fused step's score and victim loop in one program per row and KV head
    (`split_victim_search` off) instead of split as the attention is;
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
(h) `--decode-attention` (default on a GPU): one layer's decode attention with scores over a kvtool
    layer's slots at each cell, in the model's dtype and through float32 copies
    (`mixed_precision_decode` off), timed and against float64.
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

The target: kvtool's prompt phase without a draft at most 1.3x the baseline's at 8192x4
and 32768x2 on an H100. The Markdown table it prints is the Llama-3.1-8B-shape table of README.md's
"On a GPU" section and docs/results.md's "On a GPU" (prompt phase, decode, end-to-end, KV and peak
memory, each against the full cache); `--json PATH` keeps every run (docs/results/bench-gpu-*.json).
`--budget-s` (default 420) bounds the whole run: cells that would start after it are skipped and the
report says which.

This file is the command line; the rest is beside it, by purpose: gpu_models.py (the random-weight
models and the recipe), gpu_timing.py (kvtool's timing loop, the time guard, ratios), gpu_cells.py
((a)-(e), (i)), gpu_kernels.py ((f), (h)), gpu_profile.py ((g), (j)) and gpu_tables.py (the Markdown
tables). The variants run through public runtime settings (`kvtool.runtime.use_settings`).

    python benchmarks/gpu_bench.py --shape llama3-8b --shapes 8192x4,32768x2 --repeats 2 --kernel-sweep --profile \
        --capacity-caches full,kvtool-no-draft --json llama3-8b.json   # 8.5 minutes on an H100
    python benchmarks/gpu_bench.py --shape tiny --shapes 64x2 --repeats 1 --no-capacity   # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kvtool.models import use_offline_defaults

use_offline_defaults()  # before transformers is imported: it reads them once

if str(Path(__file__).resolve().parent) not in sys.path:  # the gpu_* modules beside this one (not a package)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cells import CAPACITY_CACHES, capacity, generate_cells, shape_cells  # noqa: E402
from gpu_kernels import decode_attention_check, kernel_check  # noqa: E402
from gpu_models import RECIPE, SHAPES, build_model, recipe_method  # noqa: E402
from gpu_profile import profile_steps, prompt_parts  # noqa: E402
from gpu_tables import markdown  # noqa: E402
from gpu_timing import Budget, log, release  # noqa: E402

from kvtool.profiles import read_profile  # noqa: E402
from kvtool.profiles.builtin import builtin_profile  # noqa: E402


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
