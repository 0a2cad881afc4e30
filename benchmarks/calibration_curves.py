"""Calibration PPL of per-layer ratios from `mean` and `sum` curves vs the same ratio everywhere.

    .venv/bin/python benchmarks/calibration_curves.py --model smollm2 --budget 0.2

Same prompts (the packaged calibration set, 10 samples, seed 0), same full-cache references, same
D candidates: the teacher-forced PPL of each candidate D and the best one, per allocation.
In-sample calibration figures, not an evaluation on held-out prompts.
"""

from __future__ import annotations

import argparse
import json

from kvtool.models import load_model, use_offline_defaults

use_offline_defaults()  # before the imports below load transformers, which reads them once

from kvtool.calibrate.runner import calibrate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    args = parser.parse_args()
    loaded = load_model(args.model)
    runs = {
        "prefixkv-mean-curves": dict(curve_importance="mean"),
        "prefixkv-sum-curves": dict(curve_importance="sum"),
        "uniform": dict(uniform_ratios=True),
    }
    report = {}
    for name, options in runs.items():
        result = calibrate(loaded, args.budget, **options)
        t = result.truncation
        report[name] = {
            "ppl_by_D": {d: round(p, 4) for d, p in t.ppl.items()},
            "best_D": t.best,
            "ppl": round(t.ppl_compressed, 4),
            "ppl_full": round(t.ppl_full, 4),
            "ratios": [round(r, 3) for r in result.profile.ratios],
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
