"""Replay a profile's recorded recipe search with another search rule, on the PPLs it recorded.

A calibrated profile records every recipe its search tried with the PPL measured
(`calibration.recipes`). This runs `search_recipe` again with `measure` reading those PPLs, once
as recorded (no retry rule: it must ask for exactly the recorded trials) and once with later rounds
retrying only what came within `--retry-within` of the stage's PPL to beat, and prints trials and
choices side by side. A recipe the new rule asks for that the run never measured makes the replay
inexact; it is counted and ranked last.

    .venv/bin/python benchmarks/search_replay.py kvtool/profiles/builtin/*.yaml
"""

from __future__ import annotations

import argparse
import dataclasses

from kvtool.calibrate.config import CalibrateConfig
from kvtool.calibrate.recipes import RETRY_WITHIN, SearchSpace, describe, recipe_key, search_recipe, seed_recipes
from kvtool.calibrate.search import ROWS_PER_PASS
from kvtool.profiles import read_profile


def replay(path: str, retry_within: float, per_pass: int) -> None:
    profile = read_profile(path)
    info = profile.calibration
    start = CalibrateConfig().method
    fields = ("eviction", "selection", "scorer", "ratios", "heads", "recent_share", "merge", "truncation_distance")
    table = {}
    for trial in info.recipes:
        values = {name: getattr(trial, name) for name in fields}
        values.update({k: getattr(trial, k) for k in ("window", "pool", "window_share") if getattr(trial, k) is not None})
        table[recipe_key(dataclasses.replace(start, **values))] = trial.ppl
    tried = {trial.scorer for trial in info.recipes}
    space = SearchSpace(
        scorers=tuple(s for s in SearchSpace().scorers if s in tried),
        heads=tuple(dict.fromkeys(t.heads for t in info.recipes)),
    )
    for rule in (None, retry_within):
        missing = []

        def measure(stage, recipes):
            out = []
            for settings in recipes:
                key = recipe_key(settings)
                if key not in table:
                    missing.append(key)
                out.append(table.get(key, float("inf")))
            return out

        search = search_recipe(
            start, space, measure, seeds=seed_recipes(space, start), per_pass=per_pass, retry_within=rule
        )
        label = "as recorded" if rule is None else f"retry within {rule:g}"
        print(f"{path}  {label:>16}: {len(search.trials):3d} trials (recorded {len(info.recipes)}), "
              f"unmeasured {len(missing)}, chosen {describe(search.chosen)} {table.get(recipe_key(search.chosen), float('nan')):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--retry-within", type=float, default=RETRY_WITHIN)
    # calibrate's ROWS_PER_PASS over its batches of 5 prompts: the recipes it looked ahead at
    parser.add_argument("--per-pass", type=int, default=ROWS_PER_PASS // 5)
    args = parser.parse_args()
    for path in args.profiles:
        replay(path, args.retry_within, args.per_pass)


if __name__ == "__main__":
    main()
