"""A profile with one change: its prompt scorer or its generation rule swapped (a one-change
comparison for `kvtool eval`).

For the rules that read them (the `expected-attention` and `expected-output` scorers, the
`expected-attention` generation rule) the per-head query statistics are recorded on the prompts
`kvtool calibrate` draws with its defaults (the same seed and halves), as calibration would record them.

    .venv/bin/python benchmarks/with_scorer.py smollm2 smollm2.yaml smollm2-ea.yaml --scorer expected-attention
    .venv/bin/python benchmarks/with_scorer.py smollm2 smollm2.yaml smollm2-ea-evict.yaml --eviction expected-attention
"""

from __future__ import annotations

import argparse
import dataclasses

from kvtool.calibration.config import CalibrateConfig
from kvtool.calibration.queries import record_query_stats
from kvtool.calibration.runner import draw, encode_halves
from kvtool.data import load_jsonl
from kvtool.models import load_model, use_offline_defaults
from kvtool.profiles import read_profile, save_profile
from kvtool.profiles.schema import QUERY_SCORERS
from kvtool.runtime.eviction import EVICT_RULES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("profile")
    parser.add_argument("out")
    parser.add_argument("--scorer")
    parser.add_argument("--eviction")
    args = parser.parse_args()
    use_offline_defaults()
    profile = read_profile(args.profile)
    scorer, eviction = args.scorer or profile.method.scorer, args.eviction or profile.method.eviction
    stats = profile.query_stats
    if (scorer in QUERY_SCORERS or EVICT_RULES[eviction].needs_queries) and stats is None:
        loaded = load_model(args.model)
        config = CalibrateConfig().checked()
        _, choosing, confirming = draw(load_jsonl(None), config)
        batches, _, _ = encode_halves(loaded, choosing, confirming, config)
        stats = record_query_stats(loaded.model, batches)
    method = dataclasses.replace(profile.method, scorer=scorer, eviction=eviction)
    save_profile(dataclasses.replace(profile, method=method, query_stats=stats), args.out)
    print(f"wrote {args.out}" + (f" ({stats.queries} queries recorded)" if stats is not None else ""))


if __name__ == "__main__":
    main()
