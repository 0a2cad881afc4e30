"""Paired ROUGE-L comparison of two methods from a `kvtool eval --json` file.

Both methods saw the same prompts, so the per-prompt differences are what tells a real gap from
prompt-to-prompt noise (an unpaired comparison of two means throws that pairing away).

    .venv/bin/python benchmarks/paired_rouge.py docs/eval-smollm2.json prefixkv h2o --budget 0.2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from kvtool.evaluate.metrics import standard_error


def per_prompt(doc: dict, method: str, budget: float) -> list[float]:
    for row in doc["results"]:
        if row["method"] == method and math.isclose(row["budget"], budget):
            if "rouge_l_per_prompt" not in row:
                sys.exit(f"error: {method} at {budget:g} has no rouge_l_per_prompt (re-run kvtool eval)")
            return row["rouge_l_per_prompt"]
    sys.exit(f"error: no result for method {method!r} at budget {budget:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--budget", type=float, required=True)
    args = parser.parse_args()
    doc = json.loads(args.json.read_text())
    a, b = per_prompt(doc, args.a, args.budget), per_prompt(doc, args.b, args.budget)
    if len(a) != len(b):
        sys.exit(f"error: {args.a} has {len(a)} prompts, {args.b} {len(b)}: not the same evaluation")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean, sem = statistics.fmean(diffs), standard_error(diffs)
    wins, ties = sum(d > 0 for d in diffs), sum(d == 0 for d in diffs)
    print(
        f"budget {args.budget:g}, {n} prompts: ROUGE-L {args.a} {sum(a) / n:.3f}, {args.b} {sum(b) / n:.3f}; "
        f"paired difference {mean:+.3f} ± {sem:.3f} (one standard error); "
        f"{args.a} higher on {wins}, equal on {ties}, lower on {n - wins - ties} prompts"
    )


if __name__ == "__main__":
    main()
