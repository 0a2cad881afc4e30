"""`kvtool bench MODEL`: decode speed, prompt-phase cost and memory of a kvtool cache vs the full cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtool.cli.app import app
from kvtool.cli.profile_choice import KvFormatOption, check_choice, choose_cache_profile

DEFAULT_BUDGET = 0.2


@app.command("bench")
def bench_command(
    model: Annotated[
        str, typer.Argument(help="Alias (smollm2, gemma3-270m), HF model directory, .gguf file, or cached hub id.")
    ],
    profile: Annotated[
        Path | None,
        typer.Option(help="Profile YAML from `kvtool calibrate` (with --budget: its ratios re-derived for it)."),
    ] = None,
    budget: Annotated[
        float | None,
        typer.Option(
            help="Kept share of the KV cache's bytes in (0, 1]: the calibrated profile for the model (built-in, else "
            f"calibrated now), as in `kvtool generate` and `kvtool eval`. Default {DEFAULT_BUDGET:g} when "
            "neither --budget nor --profile is given."
        ),
    ] = None,
    prompt_tokens: Annotated[
        int,
        typer.Option(
            "--prompt-tokens",
            help="Prompt length per row (at least 16; with --new-tokens within the model's max_position_embeddings). "
            "Windows of Python's own documentation text.",
        ),
    ] = 4096,
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", help="Greedy one-token decode steps timed after the prompt.")
    ] = 64,
    batch: Annotated[int, typer.Option(help="Prompts per batch (different windows of the text, no padding).")] = 4,
    repeat: Annotated[
        int, typer.Option(help="Measured runs per cache (interleaved, after one warm-up each); medians are reported.")
    ] = 3,
    side_by_side: Annotated[
        bool,
        typer.Option(
            "--side-by-side/--no-side-by-side",
            help="After the runs, fill the three caches again and decode NEW_TOKENS steps each in turns of 8, "
            "so the machine's drift between runs cannot skew the decode ratio.",
        ),
    ] = True,
    kv_format: KvFormatOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead.")] = False,
) -> None:
    """Measure the full cache, a kvtool cache and a truncated dense cache (the ceiling) in one process.

    Each run is one prompt forward plus NEW_TOKENS greedy one-token forwards. Reported per cache, as the
    median of the measured runs: prompt-phase seconds, decode tokens/s (batch x new tokens / decode
    seconds), end-to-end tokens/s (batch x new tokens / (prompt + decode seconds)), KV bytes held at the
    end, and peak memory during the run. Peak memory is, on CUDA, torch.cuda.max_memory_allocated (GPU
    tensor memory); on CPU, the process's resident set size sampled from /proc/self/statm every 5 ms
    (where /proc is missing: getrusage ru_maxrss, the process's lifetime peak). The ceiling is a plain
    DynamicCache cut after the prompt to the entries kvtool keeps in each layer (no scoring, no merging).

    The runs decode minutes apart (each after its own prompt phase), so a machine whose speed drifts
    moves their decode ratio. Side by side (the default) the three caches are then filled again and
    decode in turns of 8 steps, each turn between the other two caches' turns: the median tokens/s of
    the turns gives the decode ratio the report leads with.
    """
    # Imported here so `kvtool --help` does not pay for torch/transformers.
    from kvtool.bench import BenchConfig, bench_dict, long_prompts, render, run_bench
    from kvtool.models import load_model

    config = BenchConfig(
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, batch=batch, repeat=repeat, side_by_side=side_by_side
    )
    check_choice(budget, profile, kv_format)
    if profile is None and budget is None:
        budget = DEFAULT_BUDGET
    loaded = load_model(model)
    config.check_fits(loaded.model)
    chosen = choose_cache_profile(loaded, budget, profile, kv_format)
    assert chosen is not None  # a budget or a profile is always given here
    kv_profile, profile_note = chosen
    ids = long_prompts(loaded.tokenizer, config.prompt_tokens, config.batch).to(loaded.model.device)

    err = Console(stderr=True)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("bench", total=config.total_runs)
        started = False

        def on_run(description: str) -> None:
            nonlocal started
            if started:
                bar.advance(task)
            started = True
            bar.update(task, description=description)

        result = run_bench(loaded.model, ids, kv_profile, config, progress=on_run)
        bar.advance(task)

    if as_json:
        # Plain echo, not rich: the output must stay parseable JSON.
        typer.echo(json.dumps(bench_dict(result, model=loaded.name, profile_note=profile_note)))
        return
    render(Console(), result, model=loaded.name, source=loaded.source, profile_note=profile_note)
