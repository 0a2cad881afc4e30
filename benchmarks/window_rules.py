"""What a shorter sliding window should keep, measured as calibration measures it.

Runs calibration's full pass on a hybrid model's calibration prompts (the shipped set, drawn and
lengthened as `kvtool calibrate` draws them), then teacher-forces the references through the
profile's recipe with every sliding layer given a window of each size, kept by each rule:

- `recent`: the first tokens and the most recent ones (what engines accept per layer);
- `scored rN pP`: the first tokens and the entries of the model's own window that the last N prompt
  rows attended most (max-pooled over P), the oldest dropped first while generating;
- `scored r1 p1 + window-tova`: the same with one row, then TOVA's rule inside the window while
  generating (what calibration ships: `LayerProfile.scored`);
- `the same without sinks`: that rule with no first tokens kept (the model's own window never reaches them).

PPL on the half of the prompts that chooses a recipe and on the held-out half.

    .venv/bin/python benchmarks/window_rules.py gemma3-270m --profile kvtool/profiles/builtin/gemma3-270m-b0.2.yaml
"""

from __future__ import annotations

import argparse
import importlib
import time
from dataclasses import replace

from kvtool.calibration.config import DEFAULT_LONG_PROMPT_TOKENS, CalibrateConfig
from kvtool.calibration.passes import full_pass
from kvtool.calibration.runner import draw, encode_halves
from kvtool.calibration.windows import _side_by_side
from kvtool.data import load_jsonl
from kvtool.data.long_prompts import long_prompts
from kvtool.models import use_offline_defaults
from kvtool.models.loader import as_loaded
from kvtool.profiles import read_profile, whole_cache
from kvtool.runtime.eviction import evict_rule

attach_module = importlib.import_module("kvtool.runtime.attach")
SHIPPED = attach_module.window_plan
SHIPPED_ROWS = (attach_module.SCORED_WINDOW_ROWS, attach_module.SCORED_WINDOW_POOL)


def rule(rows: int, pool: int, generation: str):
    """`window_plan` with a scored window's rows, pool and generation rule set."""
    def plan(layer, model):
        attach_module.SCORED_WINDOW_ROWS, attach_module.SCORED_WINDOW_POOL = rows, pool
        built = SHIPPED(layer, model)
        return built if generation == "window-tova" or not layer.scored else replace(built, evict=evict_rule(generation))
    return plan


# The sinks the first variants keep: the rule kvtool shipped until they were measured here (now none).
SINKS = 4
# name: (scored, sinks, window_plan)
VARIANTS = {
    "recent": (False, SINKS, SHIPPED),
    "scored r32 p7": (True, SINKS, rule(32, 7, "sliding")),
    "scored r8 p7": (True, SINKS, rule(8, 7, "sliding")),
    "scored r1 p1": (True, SINKS, rule(1, 1, "sliding")),
    "scored r1 p1 + window-tova": (True, SINKS, rule(1, 1, "window-tova")),
    "the same without sinks": (True, 0, rule(1, 1, "window-tova")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--profile", required=True, help="the recipe and budget to split (a hybrid profile)")
    parser.add_argument("--windows", default="127,64,32")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which columns, by name, comma-separated")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
    use_offline_defaults()
    started = time.perf_counter()
    config = CalibrateConfig().checked()
    records = load_jsonl(None)
    _, choosing, confirming = draw(records, config)
    tokens = config.long_prompt_tokens or DEFAULT_LONG_PROMPT_TOKENS
    long = lambda part: long_prompts(part, records, tokens, config.seed)  # noqa: E731
    choosing, confirming = long(choosing), long(confirming)
    config = replace(config, max_prompt_tokens=max(config.max_prompt_tokens, 2 * tokens))
    loaded = as_loaded(args.model, "calibrate")
    profile = read_profile(args.profile)
    profile = replace(profile, method=replace(profile.method, draft=None))
    batches, answers, lengths = encode_halves(loaded, choosing, confirming, config)
    measured = full_pass(loaded.model, loaded.tokenizer, batches, answers, profile.method,
                         reference_tokens=lengths, with_references=True)
    split = len([b for b in batches if b.rows[0] < len(choosing)])
    print(f"full pass: {time.perf_counter() - started:.0f} s", flush=True)
    windows = [int(w) for w in args.windows.split(",")]
    print("| prompts | window | " + " | ".join(names) + " |")
    print("| --- | --- |" + " --- |" * len(names))
    for part, states in (("choosing", measured.states[:split]), ("held out", measured.states[split:])):
        for window in windows:
            row = []
            for scored, sinks, plan in (VARIANTS[n] for n in names):
                candidate = whole_cache.with_windows(
                    profile, profile.budget, window, tokens=profile.budget_tokens, sinks=sinks, scored=scored
                )
                attach_module.window_plan = plan
                try:
                    row.append(float(_side_by_side(loaded.model, [candidate], states, lambda *_: None)[0]))
                finally:
                    attach_module.window_plan = SHIPPED
                    attach_module.SCORED_WINDOW_ROWS, attach_module.SCORED_WINDOW_POOL = SHIPPED_ROWS
            print(f"| {part} | {window} | " + " | ".join(f"{p:.3f}" for p in row) + " |", flush=True)
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
