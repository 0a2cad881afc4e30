"""`kvtool eval --plot`: PPL, ROUGE-L (and answer accuracy) against budget, one line per method."""

from __future__ import annotations

import math
from pathlib import Path

from kvtool.evaluation.results import EvalReport


def plot_report(report: EvalReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_accuracy = report.full_accuracy is not None
    panels = 3 if with_accuracy else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), constrained_layout=True)
    ax_ppl, ax_rouge = axes[0], axes[1]
    methods = list(dict.fromkeys(r.method for r in report.results))
    for method in methods:
        rows = sorted((r for r in report.results if r.method == method), key=lambda r: r.budget)
        budgets = [r.budget for r in rows]
        ax_ppl.plot(budgets, [r.ppl for r in rows], marker="o", label=method)
        # Error bars: one standard error over prompts, so readers see which gaps are noise.
        sem = [0.0 if math.isnan(r.rouge_l_sem) else r.rouge_l_sem for r in rows]
        ax_rouge.errorbar(budgets, [r.rouge_l for r in rows], yerr=sem, marker="o", capsize=3, label=method)
        if with_accuracy:
            axes[2].plot(budgets, [r.accuracy for r in rows], marker="o", label=method)
    ax_ppl.axhline(report.full_ppl, color="black", linestyle="--", linewidth=1, label="full cache")
    ax_ppl.set(xlabel="budget (kept fraction)", ylabel="PPL (lower is better)", yscale="log", title="Perplexity")
    ax_rouge.axhline(1.0, color="black", linestyle="--", linewidth=1, label="full cache")
    ax_rouge.set(xlabel="budget (kept fraction)", ylabel="ROUGE-L F1 vs full cache", ylim=(0, 1.05), title="ROUGE-L")
    if with_accuracy:
        axes[2].axhline(report.full_accuracy, color="black", linestyle="--", linewidth=1, label="full cache")
        axes[2].set(xlabel="budget (kept fraction)", ylabel="share of expected answers found", ylim=(0, 1.05),
                    title="Answer accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.model}: {report.samples} prompts, {report.max_new_tokens} new tokens")
    return save_figure(fig, path)


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Write `fig` to `path` atomically (a half-written PNG never takes the name) and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)
    return path
