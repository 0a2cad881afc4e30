"""`kvtool eval MODEL`: quality (PPL, ROUGE-L) and kept KV fraction per method and budget."""

from __future__ import annotations

import dataclasses

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli.app import app
from kvtool.cli.profile_choice import KV_FORMAT_HELP
from kvtool.cli.progress import StageBars
from kvtool.errors import KvtoolError
from kvtool.files import check_writable, write_text_atomic

if TYPE_CHECKING:
    from kvtool.evaluation import EvalReport


def parse_list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise KvtoolError(f"--{what} is empty; give a comma-separated list")
    return items


def parse_budgets(text: str) -> tuple[float, ...]:
    budgets = []
    for item in parse_list(text, "budgets"):
        try:
            value = float(item)
        except ValueError:
            raise KvtoolError(f"--budgets: {item!r} is not a number") from None
        if not 0.0 < value <= 1.0:
            raise KvtoolError(f"--budgets: {item} is outside (0, 1] (a budget is the share of the KV cache's bytes kept)")
        budgets.append(value)
    return tuple(budgets)


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Argument(help="Alias (smollm2, gemma3-270m), HF model directory, .gguf file, or cached hub id.")],
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help='JSONL prompts {"prompt": ..., "answer": optional, "images": optional list of paths}; '
            "default: the packaged evaluation prompts.",
        ),
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option("--profile", help="Calibrated profile for the per-layer methods (default: the built-in one, else calibrate first)."),
    ] = None,
    budgets: Annotated[str, typer.Option("--budgets", help="Comma-separated kept shares of the KV cache's bytes.")] = "0.1,0.2,0.5",
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            help="Comma-separated: kvtool (the calibrated recipe, with its profile's draft), kvtool-no-draft (the same, "
            "compressing the prompt once), kvtool-prompt-only (the same, nothing evicted while generating), "
            "prefixkv (the papers': attention-sum ratios, "
            "fixed-point), prefixkv-merge, prefixkv-evict, elastic, lookm (LOOK-M: text-prior anchors + "
            "similarity-pivot merging; the prior needs image tokens), h2o, tova, local, snapkv (prompt-only).",
        ),
    ] = "kvtool,prefixkv,h2o,tova,local",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Greedy tokens per prompt (ROUGE-L; PPL reference length).")] = 64,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per left-padded batch.")] = 4,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", help="Longer prompts are cut in the middle (which can drop a retrieval needle).")] = 2048,
    score_from: Annotated[
        int,
        typer.Option(
            "--score-from",
            help="Leave the first K tokens of every reference and output out of PPL, top-1 and ROUGE-L (accuracy reads "
            "the whole output): judges only what comes after the answer's first K tokens.",
        ),
    ] = 0,
    kv_format: Annotated[
        str | None,
        typer.Option(
            "--kv-format",
            help="Every method: " + KV_FORMAT_HELP,
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw PPL and ROUGE-L against budget here (needs the kvtool\\[plot] extra).")] = None,
    kinds: Annotated[
        str | None,
        typer.Option("--kinds", help="Only the prompts of these kinds, comma-separated (the packaged ones: document, image, "
                     "chat, code, retrieval, long-answer; long answers want --max-new-tokens 256 or more)."),
    ] = None,
    per_kind: Annotated[
        int, typer.Option("--per-kind", min=0, help="Only the first N prompts of each kind (0: all).")
    ] = 0,
    long_prompts: Annotated[
        int,
        typer.Option(
            "--long-prompts", min=0,
            help="Put each prompt in the middle of the set's other (text) prompts, about N tokens in all: long-context "
            "prompts from the same texts (0: as they are). Prompts are then cut only past 2N tokens.",
        ),
    ] = 0,
) -> None:
    """Score methods x budgets with the papers' protocol: PPL of the references teacher-forced through
    the compressed cache (eviction active), ROUGE-L of the compressed greedy output against the full
    cache's, and the physical KV bytes kept. References are the data's answers, else the full cache's
    greedy output."""
    from kvtool.data import load_jsonl
    from kvtool.evaluation import EvalConfig, evaluate
    from kvtool.runtime import load_profile
    from kvtool.runtime.methods import get_method

    names = parse_list(methods, "methods")
    for name in names:
        get_method(name)
    config = EvalConfig(
        tuple(names), parse_budgets(budgets), max_new_tokens, batch_size, max_prompt_tokens, score_from, kv_format
    ).checked()
    records = load_jsonl(data) if data is not None else None
    if kinds is not None or per_kind or long_prompts:
        from kvtool.data import EVALUATION_DATA, of_kinds, packaged_data
        from kvtool.data.long_prompts import first_per_kind, long_prompts as make_long

        pool = records if records is not None else load_jsonl(packaged_data(EVALUATION_DATA))
        if kinds is not None:  # long prompts are then built from these kinds' texts only
            pool = of_kinds(pool, parse_list(kinds, "kinds"))
        records = first_per_kind(pool, per_kind) if per_kind else pool
        if long_prompts:
            records = make_long(records, pool, long_prompts)
            config = dataclasses.replace(config, max_prompt_tokens=max(config.max_prompt_tokens, 2 * long_prompts))
    if profile is not None:
        load_profile(profile)  # a bad file fails now, not after the full-cache pass
    if plot is not None:
        from kvtool.cli.gini_plot import require_matplotlib

        require_matplotlib()
        check_writable(plot, "plot")
    if json_out is not None:
        check_writable(json_out, "JSON")
    console = Console(stderr=True)
    with StageBars(console) as bars:
        report = evaluate(
            model, data=records, profile=profile, config=config, progress=bars,
            notify=lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True),
        )
    if data is not None or kinds is not None or per_kind or long_prompts:
        name = str(data) if data is not None else "the packaged evaluation prompts"
        if kinds is not None:
            name += f" of kind {kinds}"
        if per_kind:
            name += f", the first {per_kind} of each kind"
        if long_prompts:
            name += f", each amid the others (~{long_prompts} tokens)"
        report = _with_data_name(report, name)
    render(Console(), report)
    if json_out is not None:
        write_text_atomic(json_out, json.dumps(report.to_dict(), indent=2) + "\n", "JSON")
        Console(stderr=True).print(f"wrote {json_out}")
    if plot is not None:
        from kvtool.evaluation.plot import plot_report

        plot_report(report, plot)
        Console(stderr=True).print(f"wrote {plot}")


def _with_data_name(report: EvalReport, name: str) -> EvalReport:
    return dataclasses.replace(report, data=name)


def render(console: Console, report: EvalReport) -> None:
    with_accuracy = report.full_accuracy is not None
    table = Table(title=f"kvtool eval: {report.model} on {report.data} ({report.samples} prompts)")
    table.add_column("budget", justify="right")
    table.add_column("method")
    table.add_column("PPL", justify="right")
    table.add_column("ROUGE-L", justify="right")
    if with_accuracy:
        table.add_column("accuracy", justify="right")
    table.add_column("top-1", justify="right")
    table.add_column("KV kept", justify="right")
    wide = report.native_bytes > 2  # a float32 model: also the share of a 16-bit cache (what GPUs serve)
    if wide:
        table.add_column("of 16-bit", justify="right")
    table.add_column("KV peak", justify="right")
    budgets = list(dict.fromkeys(r.budget for r in report.results))
    for budget in budgets:
        rows = [r for r in report.results if r.budget == budget]
        best_ppl = min(r.ppl for r in rows)
        best_rouge = max(r.rouge_l for r in rows)
        best_accuracy = max((r.accuracy or 0.0) for r in rows)
        for i, r in enumerate(rows):
            several = len(rows) > 1
            ppl = f"[bold]{r.ppl:.3f}[/]" if r.ppl == best_ppl and several else f"{r.ppl:.3f}"
            rouge = f"[bold]{r.rouge_l:.3f}[/]" if r.rouge_l == best_rouge and several else f"{r.rouge_l:.3f}"
            if not math.isnan(r.rouge_l_sem):
                rouge += f" ± {r.rouge_l_sem:.3f}"
            cells = [f"{budget:g}" if i == 0 else "", r.method, ppl, rouge]
            if with_accuracy:
                accuracy = f"{r.accuracy:.3f}" if r.accuracy is not None else "-"
                cells.append(f"[bold]{accuracy}[/]" if r.accuracy == best_accuracy and several else accuracy)
            cells.append("-" if r.agreement is None else f"{r.agreement:.1%}")
            peak = "-" if math.isnan(r.kv_peak_fraction) else f"{r.kv_peak_fraction:.1%}"
            sixteen = [f"{report.share_of_16bit(r.kv_fraction):.1%}"] if wide else []
            table.add_row(*cells, f"{r.kv_fraction:.1%}", *sixteen, peak, end_section=i == len(rows) - 1)
    console.print(table)
    if len(report.kind_rows) > 1:
        console.print(kind_table(report))
    if sum(t[1] for t in report.full.tokens_by_position):
        console.print(position_table(report))
    accuracy = (
        f", answer accuracy {report.full_accuracy:.3f}" if with_accuracy else "",
        "; accuracy is the share of expected answers found in the output" if with_accuracy else "",
    )
    console.print(
        f"full cache: PPL {report.full_ppl:.3f} on {report.reference_tokens} reference tokens "
        f"({report.references}){accuracy[0]}; ROUGE-L is against the full cache's greedy output (1.0 = identical; "
        f"± one standard error over prompts){accuracy[1]}; top-1 is the share of reference tokens the compressed "
        f"cache itself ranks first when fed the reference (greedy output leaves the full cache's at the first miss); "
        f"KV kept / peak: physical KV bytes at the end / the most after any step, over the full cache's at the end"
        + (f" (entries stored as {report.kv_format})" if report.kv_format not in ("native", "as calibrated") else "")
        + ("; of 16-bit: the same bytes over a 16-bit full cache's" if wide else "") + "."
        + (f" PPL, top-1 and ROUGE-L leave out the first {report.score_from} tokens." if report.score_from else ""),
        soft_wrap=True,
    )
    by_type = [r for r in report.results if r.kv_fraction_by_type]
    if by_type:
        console.print("KV kept by layer type (hybrid model): " + "; ".join(
            f"{r.method} at {r.budget:g}: " + ", ".join(f"{k.removesuffix('_attention')} {v:.1%}" for k, v in r.kv_fraction_by_type.items())
            for r in by_type), soft_wrap=True)
    console.print(f"per-layer ratios and D from: {report.profile_source}; {report.seconds:.0f} s", soft_wrap=True)


def position_table(report: EvalReport) -> Table:
    """PPL by where the token sits in the answer: the draft helps the first tokens, and a pooled
    PPL over long answers would hide where that help ends."""
    from kvtool.evaluation.results import POSITION_BUCKETS, bucket_label

    table = Table(title="PPL by answer position (ratio to the full cache's)")
    table.add_column("budget", justify="right")
    table.add_column("method")
    full = report.full.ppl_by_position
    for bucket, tokens in zip(POSITION_BUCKETS, zip(*report.full.tokens_by_position)):
        table.add_column(f"tokens {bucket_label(bucket)} ({sum(tokens)})", justify="right")
    table.add_row("", "full cache", *("-" if math.isnan(f) else f"{f:.3f}" for f in full), end_section=True)
    budgets = list(dict.fromkeys(r.budget for r in report.results))
    for budget in budgets:
        rows_at = [r for r in report.results if r.budget == budget]
        for i, r in enumerate(rows_at):
            cells = ["-" if math.isnan(p) else f"{p:.3f} ({p / f:.3f})" for p, f in zip(r.per_prompt.ppl_by_position, full)]
            table.add_row(f"{budget:g}" if i == 0 else "", r.method, *cells, end_section=i == len(rows_at) - 1)
    return table


def kind_table(report: EvalReport) -> Table:
    """PPL / ROUGE-L (/ accuracy) per kind of prompt: a pooled figure can hide a kind that breaks."""
    kinds = report.kind_rows
    table = Table(title="per kind: PPL / ROUGE-L (/ accuracy where the kind has answers)")
    table.add_column("budget", justify="right")
    table.add_column("method")
    for kind, rows in kinds.items():
        table.add_column(f"{kind} ({len(rows)})", justify="right")
    full = ["", "full cache"]
    for rows in kinds.values():
        scores = report.full.subset(rows)
        full.append(f"{scores.ppl:.3f} / 1" + (f" / {scores.mean_accuracy:.2f}" if scores.mean_accuracy is not None else ""))
    table.add_row(*full, end_section=True)
    budgets = list(dict.fromkeys(r.budget for r in report.results))
    for budget in budgets:
        rows_at = [r for r in report.results if r.budget == budget]
        for i, r in enumerate(rows_at):
            cells = [f"{budget:g}" if i == 0 else "", r.method]
            for rows in kinds.values():
                scores = r.per_prompt.subset(rows)
                rouge = sum(scores.rouge_l) / len(scores.rouge_l)
                accuracy = scores.mean_accuracy
                cells.append(f"{scores.ppl:.3f} / {rouge:.2f}" + (f" / {accuracy:.2f}" if accuracy is not None else ""))
            table.add_row(*cells, end_section=i == len(rows_at) - 1)
    return table
