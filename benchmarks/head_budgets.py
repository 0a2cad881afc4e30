"""Does giving heads unequal shares of a layer's budget (AdaKV) pay on this model? A quality probe.

AdaKV (Feng et al., 2024) ranks a layer's prompt entries across all its KV heads at once: the layer
keeps its total, Hkv × k entries, as the global top by score, each head guaranteed at least
`alpha` × k of its own top entries (kvpress's `alpha_safeguard`, 0.2). kvtool's layers keep the
same number in every head (`heads: per-head`) or the same columns in every head (`heads: shared`).

Before building storage in which heads hold different counts, this measures what the allocation
alone buys, as kvpress measures its AdaKV press: by masking. Each prompt runs once with full
attention to score its columns (per KV head: the column sums of all prompt rows, `attention-sum`,
and the last 32 rows' sums max-pooled over 31 columns, `window`, both averaged over the head's query
heads). Then the prompt and its reference run as one forward in which the prompt's rows attend
causally to everything (as the prompt phase does) and the reference's rows see, per KV head, only
the prompt columns that head keeps, and every reference token (the cache grows, as a prompt-only
press's does). The reference's NLL under each allocation is paired with the others per prompt.
Every allocation keeps the same number of entries per layer (k = ceil(budget × n) per head), with
the first 4 and last 8 prompt columns in every head, as kvtool's recipes protect them.

References are the full cache's greedy output (`--reference-tokens`; 256 for the long-answer kind),
or a retrieval prompt's exact answers, as calibration scores them. The prompts are calibration's
(`kvtool/data/calibration.jsonl`), never the evaluation set's.

    .venv/bin/python benchmarks/head_budgets.py smollm2 --budget 0.2 --json head-budgets.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict

import torch
from transformers import AttentionInterface

from kvtool.data import load_jsonl
from kvtool.data.long_prompts import long_prompts
from kvtool.models import load_model, use_offline_defaults
from kvtool.runtime.importance.union import rank_share
from kvtool.scoring.encoding import encode_prompt

SINKS, RECENT, WINDOW, POOL = 4, 8, 32, 31
LONG_ANSWER = "long-answer"


class Probe:
    """The attention function's state: 'score' records each layer's per-head scores, 'mask' applies
    each layer's keep mask [Hkv, n] to the rows after the prompt's n."""

    def __init__(self) -> None:
        self.mode = "score"
        self.scores: dict[int, dict[str, torch.Tensor]] = {}
        self.keep: dict[int, torch.Tensor] = {}
        self.prompt_len = 0

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        _, hq, rows, dim = query.shape
        hkv = key.shape[1]
        group = hq // hkv
        scaling = dim**-0.5 if scaling is None else scaling
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
        allowed = torch.ones(rows, rows, dtype=torch.bool).tril().expand(hq, rows, rows)
        if self.mode == "mask":
            n = self.prompt_len
            keep = self.keep[module.layer_idx].repeat_interleave(group, dim=0)  # [Hq, n]
            allowed = allowed.clone()
            allowed[:, n:, :n] &= keep[:, None, :]
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed[None], scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        logits = (query @ key.transpose(-1, -2)) * scaling
        probs = torch.softmax(logits.masked_fill(~allowed[None], float("-inf")), dim=-1)
        per_kv = probs[0].view(hkv, group, rows, rows)
        sums = per_kv.sum(dim=2).mean(dim=1)  # [Hkv, n]
        window = per_kv[:, :, -WINDOW:, :].sum(dim=2).mean(dim=1)
        window = torch.nn.functional.max_pool1d(window[:, None, :], POOL, stride=1, padding=POOL // 2)[:, 0]
        self.scores[module.layer_idx] = {"attention-sum": sums, "window": window}
        out = probs @ value
        return out.transpose(1, 2).contiguous(), None


def protected(n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[:SINKS] = True
    mask[n - RECENT :] = True
    return mask


def union(scores: dict[str, torch.Tensor]) -> torch.Tensor:
    """[Hkv, n]: each column's better rank under the column sums and the pooled window, as a share
    of the row (kvtool's `union` at its default window share, ties by position)."""
    n = scores["window"].shape[-1]
    valid = torch.ones(1, n, dtype=torch.bool)
    return torch.maximum(rank_share(scores["attention-sum"][None], valid), rank_share(scores["window"][None], valid))[0]


def keep_masks(score: torch.Tensor, k: int, alpha: float) -> dict[str, torch.Tensor]:
    """[Hkv, n] keep masks with k entries per head on average: shared columns, the same count per
    head, and AdaKV's layer-wide top with each head's floor."""
    hkv, n = score.shape
    top = float("inf")
    ranked = score.masked_fill(protected(n)[None], top)
    out = {}
    shared_cols = ranked.mean(dim=0).topk(k).indices
    shared = torch.zeros(n, dtype=torch.bool)
    shared[shared_cols] = True
    out["shared"] = shared.expand(hkv, n).clone()
    per_head = torch.zeros(hkv, n, dtype=torch.bool)
    per_head.scatter_(1, ranked.topk(k, dim=1).indices, True)
    out["per-head"] = per_head
    floor = max(int(alpha * k), SINKS + RECENT)
    guaranteed = torch.zeros(hkv, n, dtype=torch.bool)
    guaranteed.scatter_(1, ranked.topk(floor, dim=1).indices, True)
    rest = ranked.masked_fill(guaranteed, float("-inf")).flatten()
    chosen = guaranteed.flatten().clone()
    chosen[rest.topk(hkv * k - int(guaranteed.sum())).indices] = True
    out["adakv"] = chosen.view(hkv, n)
    return out


def union_adakv(scores: dict[str, torch.Tensor], k: int, alpha: float) -> torch.Tensor:
    """[Hkv, n]: the union's two lists with AdaKV on the window's: half the layer's entries go to
    the window scores across heads (AdaKV, each head's floor), then each head adds its own top
    column sums until it holds its window entries plus k - k // 2."""
    n = scores["window"].shape[-1]
    kept = keep_masks(scores["window"], k // 2, alpha)["adakv"].clone()
    sums = scores["attention-sum"].masked_fill(protected(n)[None], float("inf")).masked_fill(kept, float("-inf"))
    kept.scatter_(1, sums.topk(k - k // 2, dim=1).indices, True)
    return kept


def reference(model, tokenizer, ids: list[int], record, length: int) -> list[int]:
    if record.answers:
        return list(tokenizer(", ".join(record.answers), add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=length, do_sample=False)
    return out[0, len(ids) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--per-kind", type=int, default=4, help="prompts of each kind (file order)")
    parser.add_argument("--reference-tokens", type=int, default=96)
    parser.add_argument("--long-prompts", type=int, default=0, help="surround each prompt with others to about this many tokens")
    parser.add_argument("--max-prompt-tokens", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args()
    use_offline_defaults()
    torch.set_grad_enabled(False)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    records = load_jsonl(None)
    counts: dict[str, int] = defaultdict(int)
    chosen = []
    for r in records:
        if not r.images and counts[r.kind] < args.per_kind:
            counts[r.kind] += 1
            chosen.append(r)
    if args.long_prompts:
        chosen = list(long_prompts(chosen, records, args.long_prompts))
    probe = Probe()
    AttentionInterface.register("head_budgets_probe", probe)
    rows = []
    started = time.perf_counter()
    for index, record in enumerate(chosen):
        ids = encode_prompt(tokenizer, record.prompt, args.max_prompt_tokens)
        length = 256 if record.kind == LONG_ANSWER else args.reference_tokens
        ref = reference(model, tokenizer, ids, record, length)
        model.set_attn_implementation("head_budgets_probe")
        probe.mode, probe.prompt_len = "score", len(ids)
        model(torch.tensor([ids]))
        n = len(ids)
        k = math.ceil(args.budget * n)
        full_ids = torch.tensor([ids + ref])
        nll = {}
        probe.mode = "mask"
        variants = {"full": None}
        for scorer in ("attention-sum", "window"):
            masks = {layer: keep_masks(s[scorer], k, args.alpha) for layer, s in probe.scores.items()}
            for name in ("shared", "per-head", "adakv"):
                variants[f"{scorer}/{name}"] = {layer: m[name] for layer, m in masks.items()}
        # kvtool's default scorer ranks by the better of the two ranks: AdaKV cannot compare ranks
        # across heads (every head has the same ranks), so its AdaKV allocates the window's list.
        masks = {layer: keep_masks(union(s), k, args.alpha) for layer, s in probe.scores.items()}
        for name in ("shared", "per-head"):
            variants[f"union/{name}"] = {layer: m[name] for layer, m in masks.items()}
        variants["union/adakv"] = {layer: union_adakv(s, k, args.alpha) for layer, s in probe.scores.items()}
        spread = {}
        for name, keep in variants.items():
            probe.keep = keep or {layer: torch.ones_like(s["window"], dtype=torch.bool) for layer, s in probe.scores.items()}
            logits = model(full_ids).logits[0, n - 1 : -1].double()
            target = full_ids[0, n:]
            # The first reference token is predicted from the prompt's own row, the same everywhere.
            token_nll = -torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
            nll[name] = float(token_nll[1:].mean()) if len(ref) > 1 else float(token_nll.mean())
            if keep is not None and name.endswith("adakv"):
                counts_per_head = torch.stack([m.sum(dim=1) for m in keep.values()]).double() / k
                spread[name] = {"max_share": float(counts_per_head.max(dim=1).values.mean()), "min_share": float(counts_per_head.min(dim=1).values.mean())}
        model.set_attn_implementation("sdpa")
        rows.append({"kind": record.kind, "where": record.where, "prompt_tokens": n, "reference_tokens": len(ref), "nll": nll, "adakv_heads": spread})
        print(f"[{index + 1}/{len(chosen)}] {record.kind:<11} n={n:<5} ref={len(ref):<4} " + " ".join(f"{k_}={v:.3f}" for k_, v in nll.items()) + f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def report(rows: list[dict]) -> None:
    names = list(rows[0]["nll"])
    print(f"\n{len(rows)} prompts; mean NLL per reference token (each prompt weighs the same); differences paired per prompt\n")
    print("| allocation | NLL | vs full | vs per-head (same scorer) |")
    print("| --- | --- | --- | --- |")
    for name in names:
        vals = torch.tensor([r["nll"][name] for r in rows], dtype=torch.float64)
        full = torch.tensor([r["nll"]["full"] for r in rows], dtype=torch.float64)
        cells = [f"{vals.mean():.4f}", _paired(vals - full)]
        if "/" in name:
            base = torch.tensor([r["nll"][name.split("/")[0] + "/per-head"] for r in rows], dtype=torch.float64)
            cells.append(_paired(vals - base))
        else:
            cells.append("")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nper kind, adakv minus per-head (mean ± s.e.):")
    kinds = sorted({r["kind"] for r in rows})
    scorers = [name for name in ("attention-sum", "window", "union") if f"{name}/adakv" in rows[0]["nll"]]
    for scorer in scorers:
        parts = []
        for kind in kinds:
            d = torch.tensor([r["nll"][f"{scorer}/adakv"] - r["nll"][f"{scorer}/per-head"] for r in rows if r["kind"] == kind], dtype=torch.float64)
            parts.append(f"{kind} {_paired(d)}")
        print(f"  {scorer}: " + "; ".join(parts))
    shares = [r["adakv_heads"] for r in rows]
    for scorer in scorers:
        mx = sum(s[f"{scorer}/adakv"]["max_share"] for s in shares) / len(shares)
        mn = sum(s[f"{scorer}/adakv"]["min_share"] for s in shares) / len(shares)
        print(f"  {scorer}/adakv: the fullest head holds {mx:.2f}x, the emptiest {mn:.2f}x an equal share (layer mean)")


def _paired(d: torch.Tensor) -> str:
    se = float(d.std(unbiased=True) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return f"{float(d.mean()):+.4f} ± {se:.4f}"


if __name__ == "__main__":
    main()
