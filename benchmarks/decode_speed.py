"""Decode and prompt-phase speed of a kvtool cache vs the full cache, measured in the same run.

    .venv/bin/python benchmarks/decode_speed.py --model smollm2 --prompt-tokens 4096 --batch 4 \
        --new-tokens 64 --budget 0.2 --repeat 3

Three caches on the same prompts, after one warm-up each, median of the repeats:
- full:      transformers' DynamicCache (what the model does without kvtool);
- kvtool:    a uniform kvtool profile at the budget (scoring + merging at the prompt, eviction after);
- truncated: a plain DynamicCache cut to the same number of entries per layer after the prompt
             (no scoring, no merging, no eviction bookkeeping): the ceiling for decode speed.
Greedy decoding in a plain loop (one token per forward) so the timings contain nothing else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from kvtool.models import load_model
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.memory import kv_bytes


def long_prompts(tokenizer, n_tokens: int, batch: int) -> torch.Tensor:
    """`batch` different windows of real English text (Python's own docs), `n_tokens` each."""
    import pydoc
    import textwrap

    text = " ".join(pydoc.render_doc(obj, renderer=pydoc.plaintext) for obj in (str, list, dict, set, textwrap))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    while len(ids) < n_tokens + 97 * batch:
        ids = torch.cat([ids, ids])
    return torch.stack([ids[97 * i : 97 * i + n_tokens] for i in range(batch)])


def truncate(cache: DynamicCache, budget: float) -> None:
    """Keep the first `budget` share of entries in every layer: same shapes as kvtool, no work."""
    for layer in cache.layers:
        keep = max(1, int(layer.keys.shape[2] * budget))
        layer.keys = layer.keys[:, :, :keep].contiguous()
        layer.values = layer.values[:, :, :keep].contiguous()


def run(model, ids, new_tokens, make_cache, after_prefill=None) -> dict:
    cache = make_cache()
    bsz, n = ids.shape
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if after_prefill:
        after_prefill(cache)
    t1 = time.perf_counter()
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(new_tokens):
        position = torch.full((bsz, 1), n + step)
        out = model(input_ids=token, past_key_values=cache, position_ids=position, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_tok_s": bsz * new_tokens / (t2 - t1), "kv_bytes": kv_bytes(cache)}


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    loaded = load_model(args.model)
    model = loaded.model
    ids = long_prompts(loaded.tokenizer, args.prompt_tokens, args.batch)
    handle = attach(model, uniform_profile(model, args.budget))
    setups = {
        "full": (lambda: DynamicCache(config=model.config), None),
        "kvtool": (handle.new_cache, None),
        "truncated": (lambda: DynamicCache(config=model.config), lambda c: truncate(c, args.budget)),
    }
    results: dict[str, list[dict]] = {name: [] for name in setups}
    with torch.inference_mode():
        for name, (make, after) in setups.items():  # warm-up
            run(model, ids[:, : min(256, args.prompt_tokens)], 4, make, after)
        for _ in range(args.repeat):
            for name, (make, after) in setups.items():  # interleaved, so drift hits all three alike
                results[name].append(run(model, ids, args.new_tokens, make, after))
    summary = {name: median_of(r) for name, r in results.items()}
    full, comp, ceil = summary["full"], summary["kvtool"], summary["truncated"]
    report = {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "budget": args.budget,
        "repeat": args.repeat,
        "torch_threads": torch.get_num_threads(),
        **summary,
        "decode_speedup": comp["decode_tok_s"] / full["decode_tok_s"],
        "decode_speedup_ceiling": ceil["decode_tok_s"] / full["decode_tok_s"],
        "prefill_ratio": comp["prefill_s"] / full["prefill_s"],
        "kv_fraction": comp["kv_bytes"] / full["kv_bytes"],
    }
    report["share_of_ceiling"] = report["decode_speedup"] / report["decode_speedup_ceiling"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
