"""Side-by-side quality tables from `kvtool eval --json` files and `peer_kvpress.py --json` files.

Every row saw the same prompts and the same references (pass kvtool eval's JSON to peer_kvpress.py
with `--references`), so the per-prompt differences tell a real gap from prompt-to-prompt noise.
Prints Markdown: one table of every method and press (PPL, ROUGE-L, retrieval accuracy, KV kept,
whether it compresses the prompt only), one per kind, and the paired differences of one method
against every other (mean ± one standard error over prompts, and on how many prompts it is ahead):
ROUGE-L, retrieval accuracy and each prompt's mean NLL per reference token (where the file has it), and
the same NLL by answer position (tokens 1-32, 33-128, 129+; kvtool eval files that have it).

A file given as `FILE.json:LABEL` shows its methods as `METHOD [LABEL]`, so two runs of the same
method (two profiles, say) sit side by side:

    .venv/bin/python benchmarks/compare.py a.json:10-samples b.json:20-samples --budget 0.2 \\
        --against "kvtool [20-samples]"

    .venv/bin/python benchmarks/compare.py docs/results/eval-smollm2-b0.2-baselines.json \\
        docs/results/eval-smollm2-b0.2-kvtool.json --peer docs/results/eval-smollm2-b0.2-kvpress-tova.json \\
        --budget 0.2 --against kvtool

Feeds the quality tables: README.md "Quality against the peers" and every table of
docs/results.md that combines `kvtool eval` files (`--plot OUT.png` draws quality against budget).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

# kvtool methods that let the cache grow while generating (kvpress says so per press).
PROMPT_ONLY_METHODS = {"snapkv", "kvtool-prompt-only"}


@dataclass(frozen=True)
class Row:
    name: str
    tool: str  # "kvtool" or "kvpress"
    prompt_only: bool
    ppl: float
    rouge: list[float]
    accuracy: list[float | None]
    kv_fraction: float
    kinds: dict[str, dict]
    nll: list[float | None] | None = None  # per prompt: mean NLL per scored reference token
    kv_peak: float | None = None  # the most KV held after any step (files from before it: unknown)
    draft: int = 0  # tokens drafted at the budget to score the prompt again
    draft_rounds: int = 1  # how many times
    draft_jacobi: bool = False  # later rounds drafted from the last one's predictions
    # Per answer-position bucket (label -> per prompt mean NLL per token there; None where no token).
    positions: dict[str, list[float | None]] | None = None


def per_token_nll(result: dict) -> list[float | None] | None:
    nll, tokens = result.get("nll_per_prompt"), result.get("tokens_per_prompt")
    if nll is None or tokens is None:
        return None
    return [n / t if t else None for n, t in zip(nll, tokens)]


def position_nll(result: dict) -> dict[str, list[float | None]] | None:
    """Per-token NLL per prompt in each answer-position bucket (kvtool eval files that have them)."""
    labels, nll, tokens = (result.get(k) for k in ("ppl_by_position", "nll_by_position_per_prompt", "tokens_by_position_per_prompt"))
    if not labels or nll is None or tokens is None:
        return None
    return {label: [n[b] / t[b] if t[b] else None for n, t in zip(nll, tokens)] for b, label in enumerate(labels)}


def labelled(arg: str) -> tuple[Path, str | None]:
    """`FILE` or `FILE:LABEL` (a label never contains a path separator)."""
    path, sep, label = arg.rpartition(":")
    if sep and path and "/" not in label and label:
        return Path(path), label
    return Path(arg), None


def read_json(path: Path) -> dict:
    """A results file, or a one-line error naming what is wrong with it."""
    try:
        doc = json.loads(path.read_text())
    except OSError as error:
        raise SystemExit(f"error: cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"error: {path} is not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise SystemExit(f"error: {path} has no \"results\" list (not a kvtool eval or peer_kvpress.py --json file)")
    return doc


def sem(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def load(paths: list[str], peers: list[Path], budget: float) -> tuple[list[Row], dict, list[str | None]]:
    rows: list[Row] = []
    full: dict = {}
    kinds: list[str | None] = []
    for arg in paths:
        path, label = labelled(arg)
        doc = read_json(path)
        full = full or {
            "ppl": doc["full_ppl"], "accuracy": doc.get("full_accuracy"), "kinds": doc.get("full_kinds", {}),
        }
        kinds = kinds or doc.get("kinds_per_prompt") or []
        for r in doc["results"]:
            if math.isclose(r["budget"], budget):
                name = r["method"] if label is None else f"{r['method']} [{label}]"
                # A later file's row for the same method replaces an earlier one (a re-run).
                rows = [row for row in rows if row.name != name]
                rows.append(Row(
                    name, "kvtool", r["method"] in PROMPT_ONLY_METHODS, r["ppl"], r["rouge_l_per_prompt"],
                    r.get("accuracy_per_prompt") or [], r["kv_fraction"], r.get("kinds", {}), per_token_nll(r),
                    r.get("kv_peak_fraction"), r.get("draft") or 0, r.get("draft_rounds") or 1,
                    bool(r.get("draft_jacobi")), position_nll(r),
                ))
    for path in peers:
        doc = read_json(path)
        for r in doc["results"]:
            # A press that failed on the model has an "error" and no figures.
            if math.isclose(r["budget"], budget) and r["method"] != "none" and "error" not in r:
                rows.append(Row(
                    r["method"] if r["method"].startswith("kvpress") else f"kvpress {r['method']}", "kvpress", r["prompt_only"], r["ppl"], r["rouge_l_per_prompt"],
                    r.get("accuracy_per_prompt") or [], r["kv_fraction"], r.get("kinds", {}),
                ))
    if not rows:
        sys.exit(f"error: no results at budget {budget:g}")
    lengths = {len(r.rouge) for r in rows}
    if len(lengths) != 1:
        sys.exit(f"error: the files scored different numbers of prompts {sorted(lengths)}: not the same evaluation")
    return rows, full, kinds


def mean_accuracy(row: Row, keep: list[bool] | None = None) -> float | None:
    values = [a for i, a in enumerate(row.accuracy) if a is not None and (keep is None or keep[i])]
    return sum(values) / len(values) if values else None


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def compresses(row: Row) -> str:
    if row.prompt_only:
        return "prompt only"
    if row.draft:
        rounds = f", {row.draft_rounds} rounds" if row.draft_rounds > 1 else ""
        rounds += " after the first from its predictions" if row.draft_jacobi else ""
        return f"prompt + generation (budget held; prompt compressed with the attention of a {row.draft}-token draft{rounds})"
    return "prompt + generation (budget held)"


def main_table(rows: list[Row], full: dict) -> str:
    lines = [
        f"| method | compresses | PPL | ROUGE-L | retrieval accuracy | KV kept | KV peak |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| full cache | - | {fmt(full['ppl'])} | 1 | {fmt(full['accuracy'])} | 100% | 100% |",
    ]
    for r in rows:
        rouge = [v for v in r.rouge if not math.isnan(v)]
        lines.append(
            f"| {r.name} | {compresses(r)} | "
            f"{fmt(r.ppl)} | {statistics.fmean(rouge):.3f} ± {sem(rouge):.3f} | {fmt(mean_accuracy(r))} | "
            f"{r.kv_fraction:.1%} | {fmt(r.kv_peak, '.1%')} |"
        )
    return "\n".join(lines)


def kind_table(rows: list[Row], full: dict, kinds: list[str | None]) -> str:
    names = sorted({k for k in kinds if k is not None}, key=lambda k: kinds.index(k))
    head = "| method | " + " | ".join(f"{k} PPL / ROUGE-L" for k in names) + " | retrieval acc. |"
    lines = [head, "| --- |" + " --- |" * (len(names) + 1)]
    full_cells = [fmt(full["kinds"].get(k, {}).get("ppl")) + " / 1" for k in names]
    lines.append("| full cache | " + " | ".join(full_cells) + f" | {fmt(full['accuracy'])} |")
    for r in rows:
        cells = []
        for k in names:
            members = [v for v, kind in zip(r.rouge, kinds) if kind == k and not math.isnan(v)]
            cells.append(f"{fmt(r.kinds.get(k, {}).get('ppl'))} / {statistics.fmean(members):.3f}")
        lines.append(f"| {r.name} | " + " | ".join(cells) + f" | {fmt(mean_accuracy(r))} |")
    return "\n".join(lines)


def paired(rows: list[Row], against: str, kinds: list[str | None]) -> str:
    base = next((r for r in rows if r.name == against), None)
    if base is None:
        sys.exit(f"error: no method {against!r} at this budget")
    lines = [
        f"| {against} minus | ROUGE-L (all) | ahead on | " + " | ".join(
            f"ROUGE-L {k}" for k in sorted({k for k in kinds if k}, key=kinds.index)
        ) + " | retrieval accuracy | NLL per token |",
    ]
    names = sorted({k for k in kinds if k}, key=kinds.index)
    lines.append("| --- | --- | --- |" + " --- |" * (len(names) + 2))
    for r in rows:
        if r is base:
            continue
        pairs = [(a, b) for a, b in zip(base.rouge, r.rouge) if not (math.isnan(a) or math.isnan(b))]
        diffs = [a - b for a, b in pairs]
        ahead = sum(d > 0 for d in diffs)
        behind = sum(d < 0 for d in diffs)
        cells = []
        for k in names:
            d = [a - b for a, b, kind in zip(base.rouge, r.rouge, kinds) if kind == k and not (math.isnan(a) or math.isnan(b))]
            cells.append(f"{statistics.fmean(d):+.3f} ± {sem(d):.3f}")
        acc = [a - b for a, b in zip(base.accuracy, r.accuracy) if a is not None and b is not None]
        acc_cell = f"{statistics.fmean(acc):+.3f} ± {sem(acc):.3f}" if acc else "-"
        nll = [a - b for a, b in zip(base.nll or [], r.nll or []) if a is not None and b is not None]
        nll_cell = f"{statistics.fmean(nll):+.4f} ± {sem(nll):.4f} (lower on {sum(d < 0 for d in nll)})" if nll else "-"
        lines.append(
            f"| {r.name} | {statistics.fmean(diffs):+.3f} ± {sem(diffs):.3f} | {ahead} / {behind} | "
            + " | ".join(cells) + f" | {acc_cell} | {nll_cell} |"
        )
    return "\n".join(lines)


def position_paired(rows: list[Row], against: str) -> str | None:
    """NLL per token by answer position, `against` minus each method: mean ± one standard error over
    the prompts whose answers reach the bucket (where a draft's help ends shows here)."""
    base = next((r for r in rows if r.name == against), None)
    if base is None or base.positions is None:
        return None
    labels = list(base.positions)
    lines = [f"| {against} minus, NLL per token | " + " | ".join(f"tokens {label}" for label in labels) + " |",
             "| --- |" + " --- |" * len(labels)]
    for r in rows:
        if r is base or r.positions is None:
            continue
        cells = []
        for label in labels:
            d = [a - b for a, b in zip(base.positions[label], r.positions.get(label, [])) if a is not None and b is not None]
            cells.append(f"{statistics.fmean(d):+.4f} ± {sem(d):.4f} (lower on {sum(x < 0 for x in d)} of {len(d)})" if d else "-")
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else None


def plot(evals: list[str], peers: list[Path], path: Path) -> Path:
    """PPL, ROUGE-L and retrieval accuracy against budget, one line per method of every file (all
    budgets they hold; later files replace earlier rows of the same method and budget). kvpress
    presses are dashed: they compress the prompt only unless the row says it holds the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtool.evaluation.plot import save_figure

    files = [labelled(e)[0] for e in evals] + peers
    budgets = sorted({r["budget"] for p in files for r in read_json(p)["results"] if r["budget"] < 1})
    series: dict[str, dict[float, Row]] = {}
    full: dict = {}
    for budget in budgets:
        try:
            rows, full_b, _ = load(evals, peers, budget)
        except SystemExit:
            continue
        full = full or full_b
        for row in rows:
            series.setdefault(row.name, {})[budget] = row
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    for name, points in series.items():
        xs = sorted(points)
        rows = [points[x] for x in xs]
        style = dict(marker="o", linestyle="--" if rows[0].tool == "kvpress" else "-", label=name,
                     linewidth=2.5 if name == "kvtool" else 1.2)
        axes[0].plot(xs, [r.ppl for r in rows], **style)
        rouge = [[v for v in r.rouge if not math.isnan(v)] for r in rows]
        axes[1].errorbar(xs, [statistics.fmean(v) for v in rouge], yerr=[sem(v) for v in rouge], capsize=3, **style)
        axes[2].plot(xs, [mean_accuracy(r) for r in rows], **style)
    axes[0].axhline(full["ppl"], color="black", linestyle=":", label="full cache")
    axes[0].set(xlabel="budget (kept fraction)", ylabel="PPL (lower is better)", yscale="log", title="Perplexity")
    axes[1].axhline(1.0, color="black", linestyle=":", label="full cache")
    axes[1].set(xlabel="budget (kept fraction)", ylabel="ROUGE-L vs the full cache's output", ylim=(0, 1.05), title="ROUGE-L (± 1 SE)")
    if full.get("accuracy") is not None:
        axes[2].axhline(full["accuracy"], color="black", linestyle=":", label="full cache")
    axes[2].set(xlabel="budget (kept fraction)", ylabel="share of needles found", ylim=(0, 1.05), title="Retrieval accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "evals", nargs="+",
        help="kvtool eval --json files, each optionally FILE:LABEL (a later file's method replaces the same method of an earlier one)",
    )
    parser.add_argument("--peer", type=Path, action="append", default=[], help="peer_kvpress.py --json files")
    parser.add_argument("--budget", type=float, help="the budget of the tables (required without --plot)")
    parser.add_argument("--plot", type=Path, help="also draw every budget of the files here (PNG; needs matplotlib)")
    parser.add_argument("--against", default="kvtool", help="the method the paired differences start from")
    args = parser.parse_args(argv)
    if args.plot is not None:
        print(f"wrote {plot(args.evals, args.peer, args.plot)}")
    if args.budget is None:
        if args.plot is None:
            parser.error("--budget is required without --plot")
        return
    rows, full, kinds = load(args.evals, args.peer, args.budget)
    print(f"Budget {args.budget:g}, {len(rows[0].rouge)} prompts.\n")
    print(main_table(rows, full) + "\n")
    if kinds:
        print(kind_table(rows, full, kinds) + "\n")
        print(paired(rows, args.against, kinds))
    by_position = position_paired(rows, args.against)
    if by_position:
        print("\n" + by_position)


if __name__ == "__main__":
    main()
