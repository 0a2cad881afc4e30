"""Replay a profile's recorded recipe search with another search rule, on the PPLs it recorded.

Once as recorded (no retry rule: it must ask for exactly the recorded trials) and once with later
rounds retrying only what came within `--retry-within` of their stage's PPL to beat
(`kvtool.calibration.replay`); trials and choices side by side.

    .venv/bin/python benchmarks/search_replay.py kvtool/profiles/builtin/gemma3-270m-b0.*.yaml
    .venv/bin/python benchmarks/search_replay.py kvtool/profiles/builtin/smollm2-b0.*.yaml --per-pass 3
"""

from __future__ import annotations

import argparse

from kvtool.calibration.recipes import RETRY_WITHIN, describe
from kvtool.calibration.replay import replay
from kvtool.calibration.search import ROWS_PER_PASS
from kvtool.profiles import read_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--retry-within", type=float, default=RETRY_WITHIN)
    # calibrate's recipes side by side: ROWS_PER_PASS over the rows of its batches (5 prompts by
    # default; the built-in SmolLM2 profiles' 10)
    parser.add_argument("--per-pass", type=int, default=ROWS_PER_PASS // 5)
    args = parser.parse_args()
    for path in args.profiles:
        profile = read_profile(path)
        for rule in (None, args.retry_within):
            run = replay(profile, per_pass=args.per_pass, retry_within=rule)
            label = "as recorded" if rule is None else f"retry within {rule:g}"
            print(
                f"{path}  {label:>16}: {len(run.search.trials):3d} trials (recorded {len(profile.calibration.recipes)}), "
                f"unmeasured {run.unmeasured}, chosen {describe(run.search.chosen)} {run.ppl:.4f}"
            )


if __name__ == "__main__":
    main()
