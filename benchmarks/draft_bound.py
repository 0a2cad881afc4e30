"""How much PPL could a better draft still buy? The profile's own verified draft against an oracle
that hands over the full cache's whole answer as the draft (no runtime has it), both teacher-forcing
the full cache's greedy answer through the cache they leave, on the same prompts.

    .venv/bin/python benchmarks/draft_bound.py /tmp/unseen.jsonl --json docs/draft/bound-unseen-b0.2.json

Prints the PPL of the full cache and of each arm, the ratios, and the paired NLL-per-token difference
(oracle minus own, ± one standard error over prompts) overall and per kind. If the oracle's ratio is
not much below the own draft's, no draft (or query-aware score built from one) closes the gap at this
budget: what is lost is what 20% of the prompt cannot hold.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

import torch
from transformers import DynamicCache

from kvtool.data.records import load_jsonl
from kvtool.models import load_model
from kvtool.models.loader import eos_token_ids
from kvtool.profiles import read_profile
from kvtool.profiles.builtin import builtin_profile
from kvtool.runtime import attach
from kvtool.scoring import drafted_prompt, encode_batches, prompt_forward, reference_continuations, teacher_forced
from kvtool.scoring.draft import with_draft


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a JSONL prompt set (benchmarks/unseen_calibration.py writes one)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--profile", default=None, help="default: the model's built-in profile for the budget")
    parser.add_argument("--tokens", type=int, default=64, help="answer length (the eval's --max-new-tokens)")
    parser.add_argument("--json", default=None, help="write per-prompt NLLs here")
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    profile = read_profile(args.profile or builtin_profile(args.model, args.budget))
    method = profile.method
    records = load_jsonl(args.data)
    batches, _ = encode_batches(loaded, records, max_tokens=2048, method=method, batch_size=1)
    eos, pad = eos_token_ids(model, tokenizer), tokenizer.pad_token_id or 0
    arms = ("full", "own draft", "oracle draft")
    rows: list[dict] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for done, batch in enumerate(batches):
            record = records[batch.rows[0]]
            full = DynamicCache(config=model.config)
            first = prompt_forward(model, batch, full)
            refs = reference_continuations(model, full, first, batch, length=args.tokens, eos_ids=eos, pad_id=pad, answers=[None])
            scored = refs.scored
            n = int(scored.sum())
            nll = {"full": float(refs.nll_full[scored].sum())}
            with attach(model, profile) as handle:
                cache, own_first, _ = drafted_prompt(
                    model, batch, handle.new_cache, min(method.draft, args.tokens), method.draft_rounds,
                    method.draft_verify, method.draft_reuse,
                )
                nll["own draft"] = float(teacher_forced(model, cache, own_first, batch, refs).nll[scored].sum())
                del cache
                oracle = handle.new_cache()
                oracle.set_draft(n)
                prompt_forward(model, with_draft(batch, refs.tokens[:, :n]), oracle)
                nll["oracle draft"] = float(teacher_forced(model, oracle, first, batch, refs).nll[scored].sum())
            rows.append({"kind": record.kind, "tokens": n, **{arm: nll[arm] for arm in arms}})
            elapsed = time.perf_counter() - started
            print(f"[{done + 1}/{len(batches)}] {record.kind:9s} " + "  ".join(
                f"{arm} {math.exp(nll[arm] / n):.3f}" for arm in arms) + f"  ({elapsed:.0f} s)", flush=True)

    tokens = sum(r["tokens"] for r in rows)
    ppl = {arm: math.exp(sum(r[arm] for r in rows) / tokens) for arm in arms}
    print(f"\n{len(rows)} prompts, {tokens} reference tokens, budget {args.budget}")
    for arm in arms:
        print(f"  {arm:13s} PPL {ppl[arm]:.3f}  ratio to full {ppl[arm] / ppl['full']:.3f}")
    by_kind = defaultdict(list)
    for r in rows:
        by_kind["all"].append(r)
        by_kind[r["kind"]].append(r)
    print("oracle minus own, NLL per token (paired over prompts):")
    for kind, group in by_kind.items():
        mean, se = mean_se([(r["oracle draft"] - r["own draft"]) / r["tokens"] for r in group])
        print(f"  {kind:9s} {mean:+.4f} ± {se:.4f} ({len(group)} prompts)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget": args.budget, "profile": args.profile or "built-in", "ppl": ppl, "prompts": rows}, f, indent=1)


if __name__ == "__main__":
    main()
