"""Does the number of draft rounds change decode speed? One and two rounds, alternating, in one process.

The decode path never sees how many rounds built the cache (the same slots, the same rules), so
its speed should not move; this checks it on the same prompts, interleaved so that the machine's
drift hits both alike. Prints each run's prompt phase and decode tokens/s.

    .venv/bin/python benchmarks/draft_rounds_decode.py --prompt-tokens 2048 --batch 4 --new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kvtool.bench import long_prompts
from kvtool.bench.measure import DraftRun, run_once
from kvtool.models import load_model
from kvtool.profiles import read_profile
from kvtool.profiles.builtin import builtin_profile
from kvtool.runtime import attach


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--order", default="1,2,1,2", help="draft rounds of each run, in order")
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    profile = read_profile(builtin_profile(args.model, args.budget))
    draft = profile.method.draft or 64
    ids = long_prompts(loaded.tokenizer, args.prompt_tokens, args.batch)
    with torch.inference_mode():
        for rounds in (int(r) for r in args.order.split(",")):
            method = dataclasses.replace(profile.method, draft=draft, draft_rounds=rounds)
            with attach(loaded.model, dataclasses.replace(profile, method=method)) as handle:
                run = run_once(loaded.model, ids, args.new_tokens, handle.new_cache, draft=DraftRun(draft, rounds))
            print(f"{rounds} round(s): prompt phase {run.prefill_s:.1f} s, decode {run.decode_tok_s:.2f} tok/s", flush=True)


if __name__ == "__main__":
    main()
