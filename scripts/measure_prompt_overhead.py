"""Measure a calibrated profile's prompt-phase overhead again, as `kvtool calibrate` measured it.

A profile records `calibration.prompt_overhead`: its prompt phase (draft included) over the full
cache's prompt forward on the last batch of the calibration prompts (`kvtool.calibrate.cost`). After
a change to the draft by hand (scripts/build_builtin_profiles.sh turns the built-in 0.2 profile's
second round into a Jacobi round), this measures it again on the same prompts (the same draw:
the profile's sample count and seed, the default data and prompt length) and, with `--write`,
stores it in the profile.

    .venv/bin/python scripts/measure_prompt_overhead.py kvtool/profiles/builtin/smollm2-b0.2.yaml --model smollm2 --write
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvtool.calibrate.config import CalibrateConfig
from kvtool.calibrate.cost import prompt_overhead
from kvtool.calibrate.runner import draw, encode_halves
from kvtool.data import dataset_hash, load_jsonl
from kvtool.errors import KvtoolError
from kvtool.models.loader import as_loaded
from kvtool.profiles import read_profile, save_profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--write", action="store_true", help="store the measured overhead in the profile")
    args = parser.parse_args()
    try:
        profile = read_profile(args.profile)
        info = profile.calibration
        if info is None or info.prompt_overhead is None:
            raise KvtoolError(f"{args.profile} records no prompt overhead to measure again")
        config = CalibrateConfig(samples=info.samples, seed=info.seed or 0).checked()
        chosen, choosing, confirming = draw(load_jsonl(None), config)
        if dataset_hash(chosen) != info.dataset_hash:
            raise KvtoolError(f"{args.profile} was calibrated on other prompts than the packaged set's draw (seed {config.seed})")
        loaded = as_loaded(args.model, "measure")
        batches, _ = encode_halves(loaded, choosing, confirming, config)
        ratio = round(prompt_overhead(loaded.model, profile, batches[-1:]), 3)
    except KvtoolError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"prompt overhead: {ratio}x the full cache's prompt forward (recorded: {info.prompt_overhead}x)")
    if args.write:
        save_profile(dataclasses.replace(profile, calibration=dataclasses.replace(info, prompt_overhead=ratio)), args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
