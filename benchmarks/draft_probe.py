"""Which draft brings a lost needle back? Greedy answers of one kind of prompt through a profile,
without a draft and with drafts of several lengths: the compressed cache's own, and the full cache's
own tokens handed over as the draft (an oracle no runtime has).

    .venv/bin/python benchmarks/draft_probe.py /tmp/unseen.jsonl --kind retrieval --own 8 --own 24 --oracle 8 --oracle 24

Prints, per prompt, each answer's start and how many expected answers it contains. The profile is
the model's built-in one for the budget (or --profile); its own `draft` is not used here.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from kvtool.data.records import load_jsonl
from kvtool.models import load_model
from kvtool.profiles import read_profile
from kvtool.profiles.builtin import builtin_profile
from kvtool.runtime import attach
from kvtool.scoring import encode_batches, prompt_forward, step_tokens
from kvtool.scoring.draft import with_draft


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a JSONL prompt set (benchmarks/unseen_calibration.py writes one)")
    parser.add_argument("--kind", default="retrieval")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--tokens", type=int, default=40, help="greedy tokens per answer")
    parser.add_argument("--own", type=int, action="append", default=[], help="draft length through the compressed cache")
    parser.add_argument("--oracle", type=int, action="append", default=[], help="draft length from the full cache's answer")
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    profile = read_profile(args.profile or builtin_profile(args.model, args.budget))
    records = [r for r in load_jsonl(args.data) if r.kind == args.kind]
    batches, _ = encode_batches(loaded, records, max_tokens=2048, method=profile.method, batch_size=1)

    def greedy(cache, first, batch) -> torch.Tensor:
        chosen: list[torch.Tensor] = []
        step_tokens(model, cache, first, batch, args.tokens, lambda t, logits: chosen.append(logits.argmax(-1)) or chosen[-1])
        return torch.stack(chosen, dim=1)

    with torch.no_grad():
        for batch in batches:
            record = records[batch.rows[0]]
            full = DynamicCache(config=model.config)
            reference = greedy(full, prompt_forward(model, batch, full), batch)
            answers = {"full": reference}
            with attach(model, profile) as handle:
                cache = handle.new_cache()
                first = prompt_forward(model, batch, cache)
                own = greedy(cache, first, batch)
                answers["no draft"] = own
                drafts = [(f"own {k}", own[:, :k]) for k in args.own] + [(f"oracle {k}", reference[:, :k]) for k in args.oracle]
                for name, draft in drafts:
                    cache = handle.new_cache()
                    cache.set_draft(draft.shape[1])
                    prompt_forward(model, with_draft(batch, draft), cache)
                    answers[name] = greedy(cache, first, batch)
            expected = record.answers or []
            for name, ids in answers.items():
                text = tokenizer.decode(ids[0], skip_special_tokens=True)
                found = sum(a in text for a in expected)
                print(f"{name:10s} {found}/{len(expected)} {text[:100]!r}")
            print()


if __name__ == "__main__":
    main()
