"""Where a lost needle is lost: which layers and KV heads keep its digits, and which layers it must be
kept in for the answer to come back.

For one retrieval prompt (a JSONL row with `answers`), with a profile (its draft and rounds as they
run): the compressed cache's answer, then per layer and KV head how many of the answer's tokens the
cache kept, then the answer again with the answer's tokens forced into the kept entries of each
group of layers given (`--force 0-6 --force 7-13 ...`), everything else the same.

    .venv/bin/python benchmarks/needle_layers.py /tmp/unseen.jsonl 6 --profile kvtool/profiles/builtin/smollm2-b0.2.yaml \\
        --force 0-29 --force 0-13 --force 14-29 --force 0-6 --force 7-13

The forcing is an experiment, not a rule: it wraps `CompressingLayer._rank_by` (kvtool's own
selection, not transformers') so the answer's positions rank first in the chosen layers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvtool.models.loader import load_model
from kvtool.models.prompts import format_prompts
from kvtool.runtime import attach, load_profile
from kvtool.runtime import layer as layer_module
from kvtool.runtime.generate import generate


def answer_positions(tokenizer, prompt_ids: list[int], answers: list[str]) -> list[int]:
    positions = []
    for answer in answers:
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        for start in range(len(prompt_ids) - len(ids) + 1):
            if prompt_ids[start : start + len(ids)] == ids:
                positions += range(start, start + len(ids))
    return positions


def layer_range(text: str) -> set[int]:
    first, _, last = text.partition("-")
    return set(range(int(first), int(last or first) + 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path)
    parser.add_argument("row", type=int, help="0-based row of the JSONL file")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--force", action="append", default=[], help="layers A-B whose kept entries must hold the answer")
    parser.add_argument("--new-tokens", type=int, default=64, help="also caps the draft, as in generate (default: eval's 64)")
    args = parser.parse_args(argv)

    row = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][args.row]
    loaded = load_model("smollm2")
    model, tokenizer = loaded.model, loaded.tokenizer
    text = format_prompts(tokenizer, [row["prompt"]])[0]
    prompt_ids = tokenizer([text], add_special_tokens=False)["input_ids"][0]
    needle = answer_positions(tokenizer, prompt_ids, row["answers"])
    print(f"prompt {len(prompt_ids)} tokens; answers {row['answers']} at positions {needle}")

    forced: set[int] = set()
    original = layer_module.CompressingLayer._rank_by

    def ranked(self, scores, token_valid):
        score = original(self, scores, token_valid)
        if score is not None and getattr(self, "index", None) in forced:
            score = score.clone()
            score[..., needle] += 1e6
        return score

    layer_module.CompressingLayer._rank_by = ranked
    profile = load_profile(args.profile)
    handle = attach(model, profile)
    last = {}

    def factory():
        cache = handle.new_cache()
        for index, layer in cache.compressing_layers().items():
            layer.index = index
        last["cache"] = cache
        return cache

    def run(layers: set[int]) -> str:
        forced.clear()
        forced.update(layers)
        result = generate(
            model, tokenizer, [row["prompt"]], max_new_tokens=args.new_tokens, cache_factory=factory,
            draft=profile.method.draft, draft_rounds=profile.method.draft_rounds,
        )
        return result.outputs[0].replace("\n", " ")

    full = generate(model, tokenizer, [row["prompt"]], max_new_tokens=args.new_tokens)
    print(f"full cache: {full.outputs[0][:120]!r}")
    print(f"compressed: {run(set())[:120]!r}")
    kept = []
    for index, layer in last["cache"].compressing_layers().items():
        order = layer.order if layer.per_head else layer.order[:, None]
        valid = layer.valid[0]
        heads = [sum(int(p) in needle for p in order[0, h][valid].tolist()) for h in range(order.shape[1])]
        kept.append(f"{index}:{'/'.join(map(str, heads))}")
    print(f"answer tokens kept per layer, per KV head (of {len(needle)}): {' '.join(kept)}")
    for spec in args.force:
        print(f"forced into layers {spec}: {run(layer_range(spec))[:120]!r}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
