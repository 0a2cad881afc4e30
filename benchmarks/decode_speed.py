"""Decode and prompt-phase speed of a uniform kvtool profile vs the full cache (README's figures).

    .venv/bin/python benchmarks/decode_speed.py --model smollm2 --prompt-tokens 4096 --batch 4 \
        --new-tokens 64 --budget 0.2 --repeat 3

A thin wrapper over `kvtool bench` (kvtool/bench/) that always uses the same ratio in every layer,
as the README's table does; `kvtool bench MODEL --budget B` picks a built-in calibrated profile
when one ships. Prints `kvtool bench --json`'s object.
"""

from __future__ import annotations

import argparse
import json

from kvtool.models import load_model, use_offline_defaults

use_offline_defaults()  # before the imports below load transformers, which reads them once

from kvtool.bench import BenchConfig, bench_dict, long_prompts, run_bench  # noqa: E402
from kvtool.runtime import uniform_profile  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    for flag, default in (("--prompt-tokens", 4096), ("--batch", 4), ("--new-tokens", 64), ("--repeat", 3)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    config = BenchConfig(
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, batch=args.batch, repeat=args.repeat
    )
    loaded = load_model(args.model)
    config.check_fits(loaded.model)
    ids = long_prompts(loaded.tokenizer, config.prompt_tokens, config.batch).to(loaded.model.device)
    result = run_bench(loaded.model, ids, uniform_profile(loaded.model, args.budget), config)
    note = f"uniform profile: ratio {args.budget:g} in every layer"
    print(json.dumps(bench_dict(result, model=loaded.name, profile_note=note), indent=2))
