"""Does a budget split across layers by measured loss beat the same ratio everywhere? A quality probe.

PrefixKV's per-layer ratios (from the Lorenz curves of the column sums) tie the same ratio in every
layer on SmolLM2 (this script's first command below: NLL per token -0.034 +- 0.040 against uniform
on the held-out prompts); the other road is to allocate by measured loss per byte of each layer.
This measures that allocation by masking, outside calibration, at more ratios and prompts than
calibration's `measured` ratio source affords (the first command below: -0.210 +- 0.063 against
uniform, 24 minutes on 2 cores).

1. **Each layer's loss curve, measured.** On the choosing prompts, each layer alone is compressed
   (per KV head, its top entries by kvtool's default `union` score, the first 4 and last 8 prompt
   columns always kept) at each ratio of `--ratios`, every other layer keeping everything; the
   increase of the reference's NLL per token over the full cache's is that layer's loss at that
   ratio (made non-increasing in the ratio, never below 0, and 0 at 1).
2. **The allocation.** The per-layer ratios, at least the smallest measured one and on a grid of
   0.01, that minimise the sum of the layers' interpolated losses with the layers' mean ratio equal
   to the budget (every layer holds the same number of entries per ratio here): an exact dynamic
   programme over the grid (`kvtool.profiles.loss_budget.solve_by_loss`, which calibration's
   `measured` ratio source uses too). Summing single-layer losses assumes that the layers'
   losses add up; step 3 checks what the allocation does when every layer compresses at once.
3. **Held out.** On other calibration prompts every layer compresses at once, with
   - the budget in every layer (`uniform`);
   - the built-in profile's calibrated ratios (`built-in`, PrefixKV's from the column sums);
   - the measured-loss ratios (`measured`);
   and the reference's NLL is paired per prompt.

How a variant is measured: the prompt runs once (its keys and values cached, its columns scored
with full attention); then the reference runs through that cache once per variant, each of its rows
seeing, per layer and KV head, only the prompt columns that head keeps plus every reference token
(prompt-only compression, as kvpress's presses and `benchmarks/head_budgets.py` measure), and the
cache is cut back to the prompt. References are the full cache's greedy output (`--reference-tokens`;
256 for the long-answer kind), or a retrieval prompt's exact answers. The prompts are calibration's
(`kvtool/data/calibration.jsonl`): the first `--choose-per-kind` of each kind choose, the next
`--held-out-per-kind` confirm. The evaluation set is never read.

    .venv/bin/python benchmarks/layer_budgets.py smollm2 --json layer-budgets.json
    # the same curves, held-out prompts made about 2k tokens long:
    .venv/bin/python benchmarks/layer_budgets.py smollm2 --curves layer-budgets.json --long-prompts 2048 --json long.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_budgets import Probe, _paired, protected, reference, union  # noqa: E402

from kvtool.data import load_jsonl  # noqa: E402
from kvtool.data.long_prompts import long_prompts  # noqa: E402
from kvtool.models import load_model, use_offline_defaults  # noqa: E402
from kvtool.models.forward import with_cache  # noqa: E402
from kvtool.profiles.builtin import builtin_profile  # noqa: E402
from kvtool.profiles.io import read_profile  # noqa: E402
from kvtool.profiles.loss_budget import clean_curves, solve_by_loss  # noqa: E402
from kvtool.scoring.encoding import encode_prompt  # noqa: E402

LONG_ANSWER = "long-answer"


class CachedProbe(Probe):
    """`head_budgets.Probe`'s scoring ('score': a prompt forward with no cache before it); its 'mask'
    is for rows after a cached prompt of n columns: in each layer of `keep` ([Hkv, n] masks, a layer
    missing keeps everything) they see only the kept prompt columns, and every row after the prompt
    up to their own."""

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if self.mode != "mask":
            return super().__call__(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        hq, rows, columns = query.shape[1], query.shape[2], key.shape[2]
        group = hq // key.shape[1]
        first = columns - rows  # the sequence position of the first query row
        allowed = torch.arange(columns)[None, :] <= torch.arange(first, columns)[:, None]  # [rows, columns]
        allowed = allowed.expand(hq, rows, columns).clone()
        keep = self.keep.get(module.layer_idx)
        if keep is not None:
            allowed[:, :, : self.prompt_len] &= keep.repeat_interleave(group, dim=0)[:, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1),
            attn_mask=allowed[None], scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
        )
        return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def reference_nll(model, probe: CachedProbe, cache: DynamicCache, ref: list[int], keep: dict[int, torch.Tensor]) -> float:
    """NLL per reference token after the first (whose logits are the prompt's last row's, the same
    under every variant) with the reference's rows masked by `keep`; the cache is cut back after."""
    n = probe.prompt_len
    probe.mode, probe.keep = "mask", keep
    ids = torch.tensor([ref])
    positions = torch.arange(n, n + len(ref))[None]
    logits = model(input_ids=ids, position_ids=positions, use_cache=True, **with_cache(model, cache)).logits[0, :-1].double()
    cache.crop(-len(ref))  # back to the prompt
    if len(ref) < 2:
        return 0.0
    return float(-torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0].mean())


def layer_masks(scores: dict[int, dict[str, torch.Tensor]], ratios: dict[int, float], n: int) -> dict[int, torch.Tensor]:
    """Per layer of `ratios`, the [Hkv, n] keep mask of each head's top ceil(ratio · n) entries by the
    union's ranks, the protected columns (`head_budgets.protected`) first."""
    masks = {}
    for layer, ratio in ratios.items():
        k = min(n, math.ceil(ratio * n))
        ranked = union(scores[layer]).masked_fill(protected(n)[None], float("inf"))
        keep = torch.zeros_like(ranked, dtype=torch.bool)
        masks[layer] = keep.scatter_(1, ranked.topk(k, dim=1).indices, True)
    return masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--ratios", default="0.05,0.1,0.2,0.4", help="the ratios each layer's loss is measured at")
    parser.add_argument("--choose-per-kind", type=int, default=2)
    parser.add_argument("--held-out-per-kind", type=int, default=4)
    parser.add_argument("--reference-tokens", type=int, default=96)
    parser.add_argument("--choose-reference-tokens", type=int, help="every choosing prompt's reference length (default: as the held-out ones')")
    parser.add_argument("--max-prompt-tokens", type=int, default=4096)
    parser.add_argument("--long-prompts", type=int, default=0, help="surround each held-out prompt with others to about this many tokens")
    parser.add_argument("--curves", help="an earlier run's --json: its loss curves, instead of measuring them again")
    parser.add_argument("--json")
    args = parser.parse_args()
    ratios = sorted(float(r) for r in args.ratios.split(","))
    earlier = None
    if args.curves:
        with open(args.curves) as f:
            earlier = json.load(f)
        ratios = earlier["ratios"]
    use_offline_defaults()
    torch.set_grad_enabled(False)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    layers = model.config.num_hidden_layers
    records = [r for r in load_jsonl(None) if not r.images]
    by_kind: dict[str, list] = defaultdict(list)
    for r in records:
        by_kind[r.kind].append(r)
    choose = [r for kind in by_kind for r in by_kind[kind][: args.choose_per_kind]]
    held = [r for kind in by_kind for r in by_kind[kind][args.choose_per_kind : args.choose_per_kind + args.held_out_per_kind]]
    if args.long_prompts:
        held = list(long_prompts(held, records, args.long_prompts))
    builtin = read_profile(builtin_profile(args.model, args.budget))
    builtin_ratios = {i: layer.ratio for i, layer in enumerate(builtin.layers)}
    probe = CachedProbe()
    AttentionInterface.register("layer_budgets_probe", probe)
    started = time.perf_counter()

    def prepared(record, tokens=None):
        """The prompt's ids, its reference (`tokens` for every kind, else 256 for long answers and
        --reference-tokens for the rest) and its cache, scored."""
        ids = encode_prompt(tokenizer, record.prompt, args.max_prompt_tokens)
        if tokens is None:
            tokens = 256 if record.kind == LONG_ANSWER else args.reference_tokens
        ref = reference(model, tokenizer, ids, record, tokens)
        model.set_attn_implementation("layer_budgets_probe")
        probe.mode, probe.prompt_len = "score", len(ids)
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids]), use_cache=True, **with_cache(model, cache))
        return ids, ref, cache

    chosen_rows = [] if earlier is None else earlier["choosing"]
    for index, record in enumerate(choose if earlier is None else []):
        ids, ref, cache = prepared(record, args.choose_reference_tokens)
        n = len(ids)
        full = reference_nll(model, probe, cache, ref, {})
        deltas = [[reference_nll(model, probe, cache, ref, layer_masks(probe.scores, {layer: r}, n)) - full for r in ratios] for layer in range(layers)]
        model.set_attn_implementation("sdpa")
        chosen_rows.append({"kind": record.kind, "prompt_tokens": n, "reference_tokens": len(ref), "full": full, "deltas": deltas})
        print(f"choose [{index + 1}/{len(choose)}] {record.kind:<11} n={n:<5} ref={len(ref):<4} full={full:.3f} "
              f"worst layer +{max(max(d) for d in deltas):.3f}  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    # Each prompt weighs the same.
    mean_deltas = np.mean([np.array(r["deltas"]) for r in chosen_rows], axis=0)
    curves = clean_curves(mean_deltas)
    measured = solve_by_loss(curves, tuple(ratios), args.budget)
    allocations = {
        "uniform": {i: args.budget for i in range(layers)},
        "built-in": builtin_ratios,
        "measured": {i: float(r) for i, r in enumerate(measured)},
    }
    print("measured ratios: " + " ".join(f"{r:.2f}" for r in measured), file=sys.stderr, flush=True)

    held_rows = []
    for index, record in enumerate(held):
        ids, ref, cache = prepared(record)
        n = len(ids)
        nll = {"full": reference_nll(model, probe, cache, ref, {})}
        for name, alloc in allocations.items():
            nll[name] = reference_nll(model, probe, cache, ref, layer_masks(probe.scores, alloc, n))
        model.set_attn_implementation("sdpa")
        held_rows.append({"kind": record.kind, "prompt_tokens": n, "reference_tokens": len(ref), "nll": nll})
        print(f"held out [{index + 1}/{len(held)}] {record.kind:<11} n={n:<5} ref={len(ref):<4} "
              + " ".join(f"{k}={v:.3f}" for k, v in nll.items()) + f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    report(mean_deltas, curves, ratios, allocations, held_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ratios": ratios, "choosing": chosen_rows, "mean_deltas": mean_deltas.tolist(),
                       "allocations": {k: [v[i] for i in range(layers)] for k, v in allocations.items()}, "held_out": held_rows}, f, indent=1)


def report(mean_deltas, curves, ratios, allocations, rows) -> None:
    print("\nEach layer alone compressed, mean NLL increase per token on the choosing prompts:\n")
    print("| layer | " + " | ".join(f"at {r:g}" for r in ratios) + " | measured ratio | built-in ratio |")
    print("| --- | " + " | ".join("---" for _ in ratios) + " | --- | --- |")
    for i, row in enumerate(mean_deltas):
        print(f"| {i} | " + " | ".join(f"{d:+.4f}" for d in row) + f" | {allocations['measured'][i]:.2f} | {allocations['built-in'][i]:.3f} |")
    print(f"\n{len(rows)} held-out prompts; mean NLL per reference token (each prompt weighs the same); paired differences\n")
    print("| allocation | mean ratio | NLL | vs full | vs uniform | lower than uniform on |")
    print("| --- | --- | --- | --- | --- | --- |")
    full = torch.tensor([r["nll"]["full"] for r in rows], dtype=torch.float64)
    uni = torch.tensor([r["nll"]["uniform"] for r in rows], dtype=torch.float64)
    for name in ["full", *allocations]:
        vals = torch.tensor([r["nll"][name] for r in rows], dtype=torch.float64)
        mean_ratio = "1" if name == "full" else f"{np.mean(list(allocations[name].values())):.3f}"
        lower = int(((vals - uni) < 0).sum())
        print(f"| {name} | {mean_ratio} | {vals.mean():.4f} | {_paired(vals - full)} | {_paired(vals - uni)} | {lower} of {len(rows)} |")
    print("\nper kind, minus uniform (mean ± s.e.):")
    kinds = sorted({r["kind"] for r in rows})
    for name in ("built-in", "measured"):
        parts = []
        for kind in kinds:
            d = torch.tensor([r["nll"][name] - r["nll"]["uniform"] for r in rows if r["kind"] == kind], dtype=torch.float64)
            parts.append(f"{kind} {_paired(d)}")
        print(f"  {name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
