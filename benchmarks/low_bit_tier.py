"""Keep the entries eviction would drop at 2 bits (MiKV), or split the bytes between 8 and 4 bits? A quality probe.

MiKV (Yang et al., 2024) keeps the entries that eviction would drop, at 2 to 4 bits, instead of
dropping them; ZipCache gives the salient entries more bits than the rest. At a fixed byte budget
both trade entries at high precision for more entries at lower precision *within* a layer. This
measures the trade before building a second storage tier into the cache, by masking, as
`benchmarks/head_budgets.py` measures allocations.

Each prompt runs once with full attention; every prompt column is ranked per KV head by kvtool's
default `union` score (the first 4 and last 8 columns always first). Then the prompt and its
reference run as one forward: the prompt's rows attend to the exact prompt (as the prompt phase
does), and the reference's rows see, per layer and KV head, the prompt entries of each tier stored
and read back in that tier's format (kvtool's `FORMATS`; keys after RoPE, as the cache holds them),
nothing of the dropped ones, and every reference token stored at int8 (the cache grows, as a
prompt-only press's does). Every arm spends the same bytes on the prompt's entries, each stored
byte counted (codes, scales, zero points) as a 16-bit model stores them:

    arm "int8"            all the bytes at int8: the top  B * 2D / bytes(int8)  share of entries
    arm "int8+int2 @ s"   share s of the bytes at int8 (the top entries), the rest at int2-g32 (the next ones)
    arm "int8+int4 @ s"   the same with int4-g32 as the lower tier; arm "int4": all at int4-g32

where B is the budget as a share of a 16-bit cache's bytes (`--budgets`, 2 bytes per element). The
reference's NLL per token is paired per prompt against the "int8" arm (today's storage: int8, the
rest evicted). References are the full cache's greedy output (`--reference-tokens`; 256 for the
long-answer kind) or a retrieval prompt's exact answers. The prompts are calibration's
(`kvtool/data/calibration.jsonl`, the first `--per-kind` of each kind); the evaluation set is never read.

    .venv/bin/python benchmarks/low_bit_tier.py smollm2 --budgets 0.2,0.1 --json low-bit-tier.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_budgets import LONG_ANSWER, Probe, _paired, protected, reference, union  # noqa: E402

from kvtool.data import load_jsonl  # noqa: E402
from kvtool.data.long_prompts import first_per_kind  # noqa: E402
from kvtool.models import load_model, use_offline_defaults  # noqa: E402
from kvtool.runtime.storage import FORMATS  # noqa: E402
from kvtool.scoring.encoding import encode_prompt  # noqa: E402

TOP = "int8"
LOWER = ("int2-g32", "int4-g32")
SPLITS = (0.75, 0.5, 0.25)  # the int8 tier's share of the bytes in the two-tier arms


def arms(budget16: float, dim: int, element: int) -> dict[str, list[tuple[str, float]]]:
    """Each arm's tiers in rank order: (format, share of the prompt's entries it holds)."""
    allowed = budget16 * 2 * dim  # bytes per entry of a 16-bit cache's budget, per key or value vector
    size = {name: FORMATS[name].bytes_per_entry(dim, element) for name in (TOP, *LOWER)}
    out = {TOP: [(TOP, allowed / size[TOP])], "int4": [("int4-g32", allowed / size["int4-g32"])]}
    for lower in LOWER:
        for split in SPLITS:
            out[f"int8+{lower.split('-')[0]} @ {split}"] = [(TOP, split * allowed / size[TOP]), (lower, (1 - split) * allowed / size[lower])]
    return out


def tier_codes(score: torch.Tensor, tiers: list[tuple[str, float]]) -> torch.Tensor:
    """[Hkv, n] tier index per entry (1-based, in `tiers`' order; 0 = dropped), by rank of `score`."""
    hkv, n = score.shape
    order = score.masked_fill(protected(n)[None], float("inf")).argsort(dim=1, descending=True)
    codes = torch.zeros(hkv, n, dtype=torch.long)
    start = 0
    for index, (_, share) in enumerate(tiers, start=1):
        stop = min(n, start + math.floor(share * n))
        codes.scatter_(1, order[:, start:stop], index)
        start = stop
    return codes


def round_trip(name: str, x: torch.Tensor) -> torch.Tensor:
    fmt = FORMATS[name]
    return fmt.decode(fmt.encode(x), x.dtype)


class TierProbe(Probe):
    """Probe's 'score' mode; 'tiers' mode: the reference's rows read each prompt entry in its tier's format."""

    def __init__(self) -> None:
        super().__init__()
        self.codes: dict[int, torch.Tensor] = {}
        self.formats: list[str] = []

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if self.mode != "tiers":
            return super().__call__(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        _, hq, rows, dim = query.shape
        hkv = key.shape[1]
        group = hq // hkv
        n = self.prompt_len
        scaling = dim**-0.5 if scaling is None else scaling
        causal = torch.ones(rows, rows, dtype=torch.bool).tril()
        head = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, :n], key[:, :, :n].repeat_interleave(group, 1), value[:, :, :n].repeat_interleave(group, 1),
            attn_mask=causal[:n, :n], scale=scaling,
        )
        codes = self.codes[module.layer_idx]  # [Hkv, n]
        k_read, v_read = key.clone(), value.clone()
        k_read[:, :, n:] = round_trip(TOP, key[:, :, n:])
        v_read[:, :, n:] = round_trip(TOP, value[:, :, n:])
        for index, name in enumerate(self.formats, start=1):
            where = (codes == index)[None, :, :, None]
            k_read[:, :, :n] = torch.where(where, round_trip(name, key[:, :, :n]), k_read[:, :, :n])
            v_read[:, :, :n] = torch.where(where, round_trip(name, value[:, :, :n]), v_read[:, :, :n])
        allowed = causal[n:].expand(hkv, rows - n, rows).clone()
        allowed[:, :, :n] &= (codes > 0)[:, None, :]
        tail = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, n:], k_read.repeat_interleave(group, 1), v_read.repeat_interleave(group, 1),
            attn_mask=allowed.repeat_interleave(group, 0)[None], scale=scaling,
        )
        return torch.cat([head, tail], dim=2).transpose(1, 2).contiguous(), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--budgets", default="0.2,0.1", help="shares of a 16-bit cache's bytes, comma-separated")
    parser.add_argument("--per-kind", type=int, default=4, help="prompts of each kind (file order)")
    parser.add_argument("--reference-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-tokens", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    use_offline_defaults()
    torch.set_grad_enabled(False)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    dim = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // model.config.num_attention_heads
    # Bytes as a 16-bit model stores them (the budget's own terms): a lower tier's scales and zero
    # points in 16 bits; int8's one scale per vector is float32 in any model.
    plans = {b: arms(b, dim, 2) for b in budgets}
    chosen = first_per_kind([r for r in load_jsonl(None) if not r.images], args.per_kind)
    probe = TierProbe()
    AttentionInterface.register("low_bit_tier_probe", probe)
    rows = []
    started = time.perf_counter()
    for index, record in enumerate(chosen):
        ids = encode_prompt(tokenizer, record.prompt, args.max_prompt_tokens)
        n = len(ids)
        ref = reference(model, tokenizer, ids, record, 256 if record.kind == LONG_ANSWER else args.reference_tokens)
        model.set_attn_implementation("low_bit_tier_probe")
        probe.mode, probe.prompt_len = "score", n
        model(torch.tensor([ids]))
        ranks = {layer: union(s) for layer, s in probe.scores.items()}
        full_ids = torch.tensor([ids + ref])
        target = full_ids[0, n:]
        nll: dict[str, float] = {}
        probe.mode = "tiers"
        for budget, plan in plans.items():
            for name, tiers in plan.items():
                probe.formats = [fmt for fmt, _ in tiers]
                probe.codes = {layer: tier_codes(r, tiers) for layer, r in ranks.items()}
                logits = model(full_ids).logits[0, n - 1 : -1].double()
                token_nll = -torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
                # The first reference token is predicted from the prompt's own row, the same everywhere.
                nll[f"{budget}/{name}"] = float(token_nll[1:].mean()) if len(ref) > 1 else float(token_nll.mean())
        model.set_attn_implementation("sdpa")
        full_logits = model(full_ids).logits[0, n - 1 : -1].double()
        full_nll = -torch.log_softmax(full_logits, dim=-1).gather(1, target[:, None])[:, 0]
        nll["full"] = float(full_nll[1:].mean()) if len(ref) > 1 else float(full_nll.mean())
        rows.append({"kind": record.kind, "where": record.where, "prompt_tokens": n, "reference_tokens": len(ref), "nll": nll})
        print(f"[{index + 1}/{len(chosen)}] {record.kind:<11} n={n:<5} ref={len(ref):<4} full={nll['full']:.3f} "
              + " ".join(f"{k}={v:.3f}" for k, v in nll.items() if k.endswith("/int8")) + f"  ({time.perf_counter() - started:.0f} s)",
              file=sys.stderr, flush=True)
    report(rows, plans)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "arms": {str(b): p for b, p in plans.items()}, "rows": rows}, f, indent=1)


def report(rows: list[dict], plans: dict[float, dict]) -> None:
    def col(name: str) -> torch.Tensor:
        return torch.tensor([r["nll"][name] for r in rows], dtype=torch.float64)

    full = col("full")
    kinds = sorted({r["kind"] for r in rows})
    print(f"\n{len(rows)} prompts; mean NLL per reference token (each prompt weighs the same); differences paired per prompt")
    for budget, plan in plans.items():
        base = col(f"{budget}/{TOP}")
        print(f"\nat {budget} of a 16-bit cache's bytes (full cache NLL {full.mean():.4f})\n")
        print("| arm | entries kept (int8 + lower tier) | NLL | vs full | vs int8, rest evicted | " + " | ".join(kinds) + " |")
        print("| --- | --- | --- | --- | --- |" + " --- |" * len(kinds))
        for name, tiers in plan.items():
            vals = col(f"{budget}/{name}")
            shares = " + ".join(f"{min(share, 1.0):.3f}" for _, share in tiers)
            per_kind = [_paired(torch.tensor([r["nll"][f"{budget}/{name}"] - r["nll"][f"{budget}/{TOP}"] for r in rows if r["kind"] == kind], dtype=torch.float64)) for kind in kinds]
            print(f"| {name} | {shares} | {vals.mean():.4f} | {_paired(vals - full)} | {_paired(vals - base)} | " + " | ".join(per_kind) + " |")


if __name__ == "__main__":
    main()
