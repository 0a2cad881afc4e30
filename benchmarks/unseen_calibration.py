"""The packaged calibration prompts that a calibration run with these settings does not draw.

Two profiles calibrated on different numbers of prompts (10 and 20, say) can be compared on
calibration data neither of them saw, without touching the evaluation set: write the prompts left
over by the larger draw, then `kvtool eval --data` each profile on them.

    .venv/bin/python benchmarks/unseen_calibration.py --samples 20 --out /tmp/unseen.jsonl
    .venv/bin/kvtool eval smollm2 --data /tmp/unseen.jsonl --budgets 0.2 --methods kvtool \\
        --profile docs/results/profile-smollm2-b0.2-calibrated-on-10.yaml --json a.json

Feeds docs/results.md "How calibration was tuned, on calibration prompts": every choice there was
measured on the prompts this script writes, never on the evaluation set.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtool.data import load_jsonl, select_by_kind
from kvtool.data.records import packaged_data


def unseen(samples: int, seed: int) -> list[int]:
    """Indices (0-based, non-blank lines) of the calibration prompts a recipe-searching
    `calibrate(samples=..., seed=...)` leaves out: it draws with `select_by_kind`."""
    records = load_jsonl(None)
    drawn = {id(r) for r in select_by_kind(records, samples, seed)}
    return [i for i, r in enumerate(records) if id(r) not in drawn]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, action="append", required=True,
                        help="prompts drawn by a calibration run (repeat for several runs: none of their prompts is written)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    left = set.intersection(*(set(unseen(n, args.seed)) for n in args.samples))
    lines = [line for line in packaged_data().read_text().splitlines() if line.strip()]
    kept = [line for i, line in enumerate(lines) if i in left]
    args.out.write_text("".join(line + "\n" for line in kept))
    kinds = sorted({json.loads(line).get("kind") or "-" for line in kept})
    print(f"wrote {len(kept)} of {len(lines)} calibration prompts to {args.out} (kinds: {', '.join(kinds)})")


if __name__ == "__main__":
    main()
