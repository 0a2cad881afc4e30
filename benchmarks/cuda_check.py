"""kvtool on a CUDA GPU: the exactness checks on a float64 tiny Llama, then `kvtool bench` timings.

The test suite runs on the CPU (Triton's kernels in its interpreter); this script checks the same
paths on a GPU.

1. Exactness on the GPU (float64 tiny Llama, GQA; the shipped recipe and every named method):
   budget 1.0 generates what the unmodified model generates, a padded batch generates what each
   sequence generates alone, each layer holds at most its share after the generated tokens, the
   CUDA-graph decode equals the eager one (also inside `generate`), the recipe's draft prepares
   the same cache with its held prompts in host memory as on the GPU, and its decode steps through
   kernels/triton_step.py (float32) decode what the float64 eager steps decode.
2. Speed and memory: `run_bench` (what `kvtool bench` runs) of the full cache, the built-in profile
   and the truncated ceiling, at each `--shape` (prompt tokens x batch), in float32 and bfloat16.

    python benchmarks/cuda_check.py --model path/to/SmolLM2.gguf --json cuda.json

Each part reports its own error and the rest still runs; the exit status is 1 if any part failed.

Feeds README.md "On a GPU" and docs/results.md "On a GPU (NVIDIA H200)" (the files
docs/results/bench-gpu-h200-*.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from kvtool.models import load_model, use_offline_defaults

use_offline_defaults()  # before the imports below load transformers, which reads them once

from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtool.bench import BenchConfig, bench_dict, long_prompts, run_bench  # noqa: E402
from kvtool.models.forward import with_cache  # noqa: E402
from kvtool.profiles import read_profile  # noqa: E402
from kvtool.profiles.builtin import builtin_profile  # noqa: E402
from kvtool.runtime import METHODS, attach, method_profile, uniform_profile, use_settings  # noqa: E402
from kvtool.scoring.batches import left_pad  # noqa: E402

NEW = 24
GREEDY = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)


def tiny_llama(device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=torch.float64).eval()


def tiny_gemma3(device: torch.device) -> Gemma3ForCausalLM:
    """A hybrid model: sliding-window layers (window 8) beside full ones, QK-norm, two RoPE bases."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = Gemma3ForCausalLM(config).to(device=device, dtype=torch.float64).eval()
    model.set_attn_implementation("sdpa")
    return model


def hybrid_profile(model, shipped):
    """The shipped recipe (its draft included) on the hybrid model: sliding layers window-shaped (4
    entries, 1 sink), full layers at 0.3."""
    import dataclasses

    base = uniform_profile(model, 0.3, shipped.method)
    layers = tuple(
        dataclasses.replace(layer, window=4, sinks=1, compress=False, ratio=1.0) if kind == "sliding_attention" else layer
        for kind, layer in zip(base.model.layer_types, base.layers)
    )
    return dataclasses.replace(base, layers=layers)


def hybrid_exactness(device: torch.device, shipped) -> dict:
    """Gemma 3's shape (sliding windows made shorter, the draft through every layer): the same
    checks as the Llama's, with the fused step where the device has one."""
    model = tiny_gemma3(device)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 97, (n,), generator=g) for n in (61, 37, 50)]
    profile = hybrid_profile(model, shipped)
    results = {}
    with torch.no_grad():
        with attach(model, profile) as handle:
            batch = handle.generate(**padded(seqs, device), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            same = True
            for row, seq in enumerate(seqs):
                alone = handle.generate(**padded([seq], device), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
                alone = alone[0, len(seq):]
                same &= bool(torch.equal(alone, batch[row, -NEW:][: len(alone)]))
        results["gemma3 hybrid, windows: padded batch == single runs (with the draft)"] = same
        results["gemma3 hybrid, windows: CUDA-graph decode == eager decode"] = graph_decode_matches(model, profile, padded(seqs, device))
        results["gemma3 hybrid, windows: generate through the CUDA graph == transformers' loop"] = graphed_generate_matches(
            model, profile, padded(seqs, device)
        )
        if device.type == "cuda":
            results["gemma3 hybrid, windows: fused step (float32, CUDA graph) == eager (float64)"] = fused_step_matches(
                model, profile, padded(seqs, device)
            )
    return results


def padded(seqs: list[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    batch = left_pad([s.tolist() for s in seqs], tuple(range(len(seqs))), pad_id=0)
    return {"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device)}


def exactness(device: torch.device, shipped) -> dict:
    """The equivalence checks of tests/test_runtime_equivalence.py, on `device`."""
    model = tiny_llama(device)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 97, (n,), generator=g) for n in (61, 37, 50)]
    results = {}
    with torch.no_grad():
        ref = model.generate(**padded(seqs, device), max_new_tokens=NEW, **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            out = model.generate(**padded(seqs, device), max_new_tokens=NEW, **with_cache(model, handle.bare_cache()), **GREEDY)
        results["budget 1.0 == unmodified"] = bool(torch.equal(ref.sequences, out.sequences))
        recipes = {"kvtool (shipped recipe)": uniform_profile(model, 0.3, shipped.method)}
        # Methods with one ratio in every layer (the per-layer ones need a calibrated profile of this model).
        recipes.update({name: method_profile(name, model, 0.3) for name, m in METHODS.items() if not m.per_layer})
        for name, profile in recipes.items():
            with attach(model, profile) as handle:
                cache = handle.bare_cache()
                batch = model.generate(**padded(seqs, device), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
                same = True
                for row, seq in enumerate(seqs):
                    single = model.generate(**padded([seq], device), max_new_tokens=NEW, **with_cache(model, handle.bare_cache()), **GREEDY)
                    alone = single.sequences[0, len(seq):]
                    same &= bool(torch.equal(alone, batch.sequences[row, -NEW:][: len(alone)]))
                holds = all(
                    (layer.kept <= layer.plan.keep(layer.tokens)).all() or not layer.plan.evict.holds_budget
                    for layer in cache.layers if hasattr(layer, "kept") and layer.compresses
                )
            results[f"{name}: padded batch == single runs"] = same
            results[f"{name}: each layer within its share after {NEW} tokens"] = bool(holds)
            results[f"{name}: CUDA-graph decode == eager decode"] = graph_decode_matches(model, profile, padded(seqs, device))
            results[f"{name}: generate through the CUDA graph == transformers' loop"] = graphed_generate_matches(
                model, profile, padded(seqs, device)
            )
        draft_profile = recipes["kvtool (shipped recipe)"]
        results["kvtool (shipped recipe): draft with prompts held in host memory == held on the GPU"] = held_on_host_matches(
            model, draft_profile, padded(seqs, device)
        )
        if device.type == "cuda":  # a CPU runs the kernels only in Triton's interpreter (the tests do)
            results["kvtool (shipped recipe): decode through the fused step (float32, CUDA graph) == eager (float64)"] = (
                fused_step_matches(model, draft_profile, padded(seqs, device))
            )
    results.update(hybrid_exactness(device, shipped))
    return results


def graphed_generate_matches(model, profile, inputs: dict[str, torch.Tensor]) -> bool:
    """`handle.generate` (the recipe's draft applied where it has one) gives the same sequences with
    its decode steps replayed as a CUDA graph (runtime.graphed_generate) as with transformers' loop."""
    runs = []
    for loop in ("off", "auto"):
        with use_settings(generate_loop=loop), torch.inference_mode(), attach(model, profile) as handle:
            runs.append(handle.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0))
    return bool(torch.equal(runs[0], runs[1]))


def held_on_host_matches(model, profile, inputs: dict[str, torch.Tensor]) -> bool:
    """The recipe's draft prepares exactly the same cache (first logits, verified prefix, kept keys
    and values) with its held prompts in pinned host memory as with them on the GPU, also the second
    time, from the pinned buffers the first one gave back (`runtime.layer.pinned`)."""
    from kvtool.runtime.draft import prepare
    from kvtool.runtime.steps import Prompt

    runs = []
    for on_host in (False, True, True):
        with use_settings(hold_prompt_on_host=on_host), torch.inference_mode(), attach(model, profile) as handle:
            prompt = Prompt.of(inputs)  # the whole batch at once, wherever the prompt is held
            runs.append(prepare(model, prompt, handle.bare_cache, profile.method.draft, rows=len(prompt.input_ids)))
    gpu, same = runs[0], True
    for host in runs[1:]:
        same &= torch.equal(gpu.first_logits, host.first_logits)
        if gpu.prefix is not None:
            same &= torch.equal(gpu.prefix.tokens, host.prefix.tokens) and torch.equal(gpu.prefix.lengths, host.prefix.lengths)
        for a, b in zip(gpu.cache.layers, host.cache.layers, strict=True):
            same &= torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.valid, b.valid)
    return bool(same)


def graph_decode_matches(model, profile, inputs: dict[str, torch.Tensor], steps: int = NEW) -> bool:
    """Greedy steps of a left-padded batch replayed as a CUDA graph (fixed slots; on a CPU, fixed
    slots run eagerly) give the eager steps' tokens, and logits within float64 rounding."""
    eager_tokens, eager_logits = greedy_steps(model, profile, inputs, "eager", steps)
    tokens, logits = greedy_steps(model, profile, inputs, _graph_mode(model), steps)
    return bool(torch.equal(eager_tokens, tokens)) and bool(torch.allclose(eager_logits, logits, rtol=1e-9, atol=1e-9))


def fused_step_matches(model, profile, inputs: dict[str, torch.Tensor], steps: int = NEW) -> bool:
    """The recipe's decode steps through kernels/triton_step.py (a float32 copy of the model: the
    kernels take 32- and 16-bit inputs), replayed as a CUDA graph, give the float64 eager steps'
    tokens and logits within float32 rounding, and some layer stepped through them (its `fused`, as
    `fix_slots` set it: the layers the kernels cover, whose plain softmax attention they replace)."""
    import copy

    eager_tokens, eager_logits = greedy_steps(model, profile, inputs, "eager", steps)
    single = copy.deepcopy(model).float()
    fused: list[bool] = []
    with use_settings(fused_decode_step=True):
        tokens, logits = greedy_steps(single, profile, inputs, _graph_mode(model), steps, fused=fused)
    return (
        bool(torch.equal(eager_tokens, tokens))
        and bool(torch.allclose(eager_logits, logits.double(), rtol=1e-4, atol=1e-4))
        and any(fused)
    )


def _graph_mode(model) -> str:
    return "graph" if model.device.type == "cuda" else "fixed"


def greedy_steps(
    model, profile, inputs: dict[str, torch.Tensor], how: str, steps: int, fused: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` greedy tokens after the prompt through a fresh cache decoding in mode `how`
    (runtime.graphed); returns the tokens [B, steps] and the logits of each step. `fused`, if given,
    gets each layer's `fused` (whether its steps went through kernels/triton_step.py) after them."""
    from kvtool.runtime.graphed import Decoder
    from kvtool.runtime.steps import Prompt, prompt_forward

    prompt = Prompt.of(inputs)
    with torch.inference_mode(), attach(model, profile) as handle:
        cache = handle.bare_cache()
        logits = prompt_forward(model, prompt, cache)
        decoder = Decoder(model, cache, steps, how)
        tokens, seen = [], []
        for step in range(steps):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            logits = decoder(token, prompt.next_positions.to(model.device) + step).clone()
            seen.append(logits)
        if fused is not None:
            fused.extend(bool(getattr(layer, "fused", False)) for layer in cache.layers)
        decoder.close()
    return torch.cat(tokens, dim=1), torch.stack(seen)


def host_waits(model, profile, ids: torch.Tensor, steps: int = 4) -> dict:
    """Operations that make the host wait for the GPU during kvtool decode steps (torch's sync debug
    mode), by source line: each one drains the GPU's queue, which a launch-bound decode cannot afford."""
    import collections
    import warnings

    lines: collections.Counter = collections.Counter()
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.bare_cache()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **with_cache(model, cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for step in range(steps):
                    position = torch.full((ids.shape[0], 1), ids.shape[1] + step, device=ids.device)
                    out = model(input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1, **with_cache(model, cache))
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message):
                lines[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return {"per_step": sum(lines.values()) / steps, "by_line": dict(lines.most_common(12))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="alias, directory or .gguf file")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--shape", action="append", default=None, help="PROMPTxBATCH (repeatable; default 4096x4 and 16384x8)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cuda (what it is for); cpu to try the script itself")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict = {"device": name, "torch": torch.__version__}
    import transformers

    report["transformers"] = transformers.__version__
    failed = False
    shipped = read_profile(builtin_profile("smollm2", args.budget))

    t0 = time.perf_counter()
    try:
        report["exactness"] = exactness(device, shipped)
        failed |= not all(report["exactness"].values())
    except Exception:  # noqa: BLE001 - report and go on to the timings
        report["exactness_error"] = traceback.format_exc()
        failed = True
    report["exactness_s"] = time.perf_counter() - t0
    print(json.dumps({k: v for k, v in report.items()}, indent=1), flush=True)

    report["bench"] = []
    for dtype in args.dtypes.split(","):
        try:
            loaded = load_model(args.model, dtype=dtype)
            model = loaded.model.to(device)
        except Exception:  # noqa: BLE001
            report["bench"].append({"dtype": dtype, "error": traceback.format_exc()})
            failed = True
            continue
        for shape in args.shape or ["4096x4", "16384x8"]:
            tokens, batch = (int(x) for x in shape.split("x"))
            config = BenchConfig(prompt_tokens=tokens, batch=batch, new_tokens=args.new_tokens, repeat=args.repeat)
            t0 = time.perf_counter()
            try:
                ids = long_prompts(loaded.tokenizer, tokens, batch).to(device)
                if device.type == "cuda":
                    report.setdefault("host_waits", {})[f"{dtype} {shape}"] = host_waits(model, shipped, ids)
                    print(json.dumps(report["host_waits"][f"{dtype} {shape}"]), flush=True)
                result = run_bench(model, ids, shipped, config)
                entry = bench_dict(result, model=args.model, profile_note=f"built-in smollm2 b{args.budget}")
            except Exception:  # noqa: BLE001
                entry = {"error": traceback.format_exc()}
                failed = True
            entry.update(dtype=dtype, shape=shape, seconds=time.perf_counter() - t0)
            report["bench"].append(entry)
            brief = {k: entry.get(k) for k in ("dtype", "shape", "decode_speedup", "decode_speedup_ceiling", "prefill_ratio", "kv_fraction", "seconds", "error")}
            for name in ("full", "compressed", "ceiling"):
                if name in entry:
                    brief[name] = {k: entry[name][k] for k in ("prefill_s", "decode_tok_s", "peak_memory_bytes")}
            print(json.dumps(brief, indent=1), flush=True)
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))
        del model, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
