"""`kvtool calibrate` with the defaults, each stage's start and end printed in seconds from the start.

The CLI's progress bars overlap (a bar's clock runs on while the next batch's prompt forward runs);
this prints when each stage first reports and when it reports done, so the stage times add up.

    .venv/bin/python benchmarks/calibration_stages.py gemma3-270m --budget 0.2 --out /tmp/g.yaml
"""

from __future__ import annotations

import argparse
import time

from kvtool.calibration.runner import calibrate
from kvtool.models import use_offline_defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, help="calibrate's --samples (default: its own)")
    parser.add_argument("--long-prompts", type=int, help="calibrate's --long-prompts (default: its own)")
    args = parser.parse_args()
    use_offline_defaults()
    started = time.perf_counter()
    seen: set[str] = set()

    def progress(stage: str, done: int, total: int) -> None:
        now = time.perf_counter() - started
        if stage not in seen:
            seen.add(stage)
            print(f"{now:7.1f} s  start {stage}", flush=True)
        if done >= total:
            print(f"{now:7.1f} s  end   {stage} ({done}/{total})", flush=True)

    settings = {"samples": args.samples, "long_prompt_tokens": args.long_prompts}
    run = calibrate(args.model, args.budget, out=args.out, progress=progress, **{k: v for k, v in settings.items() if v})
    print(f"{run.seconds:7.1f} s  done: {run.profile.method}")
    if run.windows is not None:
        print(f"windows: {run.windows.ppl}; held out {run.windows.held_out}")
    print(f"prompt overhead {run.profile.calibration.prompt_overhead}")


if __name__ == "__main__":
    main()
