"""What kvtool's per-step bookkeeping costs: decode ms/step of the kvtool cache against the
truncated ceiling (a plain cache cut to the entries kvtool keeps), in one process, on the same prompts.

Both caches are filled by one prompt forward (no draft: the decode path is the same with one), then
both decode in turns of `--steps` one-token forwards, `--turns` times, so the machine's drift hits
both alike; the model stays attached throughout (the plain cache's forwards run sdpa as without
kvtool). The ratio kvtool / ceiling is the bookkeeping's share of a step (slot placement, the
new token's attention probabilities, the eviction rule); `kvtool bench` gives the same ratio over a
whole run against the full cache.

    .venv/bin/python benchmarks/decode_overhead.py --prompt-tokens 2048 --batch 4 --steps 24 --turns 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from transformers import DynamicCache

from kvtool.bench import long_prompts
from kvtool.bench.measure import truncate_like
from kvtool.models import load_model
from kvtool.models.forward import with_cache
from kvtool.profiles import read_profile
from kvtool.profiles.builtin import builtin_profile
from kvtool.runtime import attach
from kvtool.runtime.attach import layer_plans


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    model = loaded.model
    profile = read_profile(builtin_profile(args.model, args.budget))
    profile = dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=0, draft_rounds=1))
    ids = long_prompts(loaded.tokenizer, args.prompt_tokens, args.batch)
    n = ids.shape[1]

    def prefill(cache):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **with_cache(model, cache))
        return {"cache": cache, "token": out.logits[:, -1].argmax(-1, keepdim=True), "step": 0}

    def decode(state, steps: int) -> float:
        """ms per one-token forward over `steps` steps, continuing where `state` left off."""
        start = time.perf_counter()
        for _ in range(steps):
            position = torch.full((args.batch, 1), n + state["step"])
            out = model(
                input_ids=state["token"], position_ids=position, use_cache=True, logits_to_keep=1,
                **with_cache(model, state["cache"]),
            )
            state["token"] = out.logits[:, -1].argmax(-1, keepdim=True)
            state["step"] += 1
        return 1000 * (time.perf_counter() - start) / steps

    times: dict[str, list[float]] = {"kvtool": [], "ceiling": []}
    # Attached once for the whole run: a forward with a plain cache then runs transformers' sdpa
    # (kvtool's attention function hands it on), and no turn pays for attaching.
    with torch.inference_mode(), attach(model, profile) as handle:
        kvtool = prefill(handle.new_cache())
        ceiling = prefill(DynamicCache(config=model.config))
        truncate_like(ceiling["cache"], layer_plans(profile))
        for state in (kvtool, ceiling):
            decode(state, 4)  # warm-up
        for _ in range(args.turns):
            times["kvtool"].append(decode(kvtool, args.steps))
            times["ceiling"].append(decode(ceiling, args.steps))
    for name, values in times.items():
        print(f"{name:8s} ms/step {statistics.median(values):7.1f}  ({', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(times["kvtool"]) / statistics.median(times["ceiling"])
    print(f"kvtool / ceiling: {ratio:.3f}")


if __name__ == "__main__":
    main()
