"""The packaged prompts of one kind, as a JSONL file for `kvtool calibrate --data` / `kvtool eval --data`.

Calibrating on the kind of prompt you serve is how a user tells kvtool what matters; this writes
such a set from the shipped ones, to show what it changes:

    .venv/bin/python benchmarks/prompt_kind.py --set calibration --kind retrieval --out /tmp/cal-retrieval.jsonl
    .venv/bin/kvtool calibrate smollm2 --budget 0.2 --data /tmp/cal-retrieval.jsonl --out retrieval.yaml
    .venv/bin/python benchmarks/prompt_kind.py --set evaluation --kind retrieval --out /tmp/eval-retrieval.jsonl
    .venv/bin/kvtool eval smollm2 --data /tmp/eval-retrieval.jsonl --budgets 0.2 --methods kvtool --profile retrieval.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtool.data.records import DEFAULT_DATA, EVALUATION_DATA, packaged_data

SETS = {"calibration": DEFAULT_DATA, "evaluation": EVALUATION_DATA}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), required=True)
    parser.add_argument("--kind", required=True, help="document, image, chat, code or retrieval")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    lines = [line for line in packaged_data(SETS[args.set]).read_text().splitlines() if line.strip()]
    kinds = sorted({json.loads(line).get("kind") or "-" for line in lines})
    kept = [line for line in lines if json.loads(line).get("kind") == args.kind]
    if not kept:
        raise SystemExit(f"no {args.set} prompt has kind {args.kind!r} (kinds: {', '.join(kinds)})")
    args.out.write_text("".join(line + "\n" for line in kept))
    print(f"wrote {len(kept)} of {len(lines)} {args.set} prompts (kind {args.kind}) to {args.out}")


if __name__ == "__main__":
    main()
