"""Calibrated profiles' prompt-phase overhead, measured again as `kvtool calibrate` measured it.

A profile records `calibration.prompt_overhead`: its prompt phase (draft included) over the full
cache's prompt forward on the last batch of its calibration prompts (`kvtool.calibration.cost`). This
measures each PROFILE again on the prompts its calibration drew (its sample count and seed, the
packaged data, the default prompt length; checked against its dataset hash), each against the full
cache in the same run: e.g. a profile's draft edited by hand against the one calibration shipped.

    .venv/bin/python benchmarks/prompt_overhead.py kvtool/profiles/builtin/smollm2-b0.2.yaml jacobi.yaml --model smollm2
"""

from __future__ import annotations

import argparse
import sys

from kvtool.calibration.config import CalibrateConfig
from kvtool.calibration.cost import prompt_overhead
from kvtool.calibration.runner import draw, encode_halves
from kvtool.data import dataset_hash, load_jsonl
from kvtool.errors import KvtoolError
from kvtool.models.loader import as_loaded
from kvtool.profiles import read_profile
from kvtool.profiles.schema import draft_phrase


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", metavar="PROFILE")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    try:
        profiles = [read_profile(path) for path in args.profiles]
        loaded = as_loaded(args.model, "measure")
        for path, profile in zip(args.profiles, profiles):
            info = profile.calibration
            if info is None:
                raise KvtoolError(f"{path} is not calibrated: it has no calibration prompts to measure on")
            config = CalibrateConfig(samples=info.samples, seed=info.seed or 0).checked()
            chosen, choosing, confirming = draw(load_jsonl(None), config)
            if dataset_hash(chosen) != info.dataset_hash:
                raise KvtoolError(f"{path} was calibrated on other prompts than the packaged set's draw (seed {config.seed})")
            batches, _, _ = encode_halves(loaded, choosing, confirming, config)
            ratio = prompt_overhead(loaded.model, profile, batches[-1:])
            recorded = "none" if info.prompt_overhead is None else f"{info.prompt_overhead:.3f}x"
            draft = draft_phrase(profile.method.draft) or "no draft"
            print(f"{path}: {ratio:.3f}x the full cache's prompt forward (recorded {recorded}; {draft})", flush=True)
    except KvtoolError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
