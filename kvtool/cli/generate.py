"""`kvtool generate MODEL PROMPT...`: batched generation with timing and KV-cache size."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Callable

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtool.cli.app import app

if TYPE_CHECKING:  # heavy imports stay out of `kvtool --help`
    from kvtool.models import LoadedModel
    from kvtool.runtime.generate import GenerationResult


def build_cache_factory(loaded: LoadedModel) -> Callable[[], Any] | None:
    """The cache generation should use; None means a plain transformers DynamicCache.

    Options that pick a compressing cache (budget, profile) are turned into a factory here.
    """
    return None


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def result_to_dict(model_name: str, result: GenerationResult) -> dict[str, Any]:
    """The `--json` contract: keep these keys stable, scripts parse them."""
    return {
        "model": model_name,
        "outputs": result.outputs,
        "prompt_tokens": result.prompt_tokens,
        "new_tokens": result.new_tokens,
        "prefill_s": result.prefill_s,
        "decode_tok_s": result.decode_tok_s,
        "kv_bytes": result.kv_bytes,
        "kv_bytes_full": result.kv_bytes_full,
        "total_s": result.total_s,
    }


def render(console: Console, loaded: LoadedModel, prompts: list[str], result: GenerationResult) -> None:
    for index, (prompt, output) in enumerate(zip(prompts, result.outputs), start=1):
        # Text objects, not markup strings: prompts and outputs may contain "[...]".
        console.print(Text.assemble((f"[{index}] ", "bold"), (prompt, "dim")))
        console.print(Text(output))
        console.print()
    console.print(Text(f"model {loaded.name}: {loaded.source}", style="dim"), soft_wrap=True)
    table = Table(show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_row("prompt tokens", ", ".join(map(str, result.prompt_tokens)))
    table.add_row("new tokens", ", ".join(map(str, result.new_tokens)))
    table.add_row("prefill", f"{result.prefill_s:.3f} s")
    table.add_row("decode", f"{result.decode_tok_s:.1f} tok/s" if result.decode_tok_s else "— (1 token)")
    table.add_row("KV cache", f"{human_bytes(result.kv_bytes)} ({result.kv_bytes:,} B)")
    table.add_row("full cache", f"{human_bytes(result.kv_bytes_full)} ({result.kv_bytes_full:,} B)")
    console.print(table)


@app.command("generate")
def generate_command(
    model: Annotated[
        str, typer.Argument(help="Alias (smollm2, gemma3-270m), HF model directory, .gguf file, or cached hub id.")
    ],
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts, generated as one batch.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; above 0 samples at this temperature.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead.")] = False,
) -> None:
    """Generate continuations for PROMPTs as one batch; report timing and KV-cache bytes."""
    # Imported here so `kvtool --help` does not pay for torch/transformers.
    from kvtool.models import load_model
    from kvtool.models.prompts import check_prompts
    from kvtool.runtime.generate import generate

    check_prompts(prompts)  # before the slow model load
    loaded = load_model(model)
    result = generate(
        loaded.model,
        loaded.tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        cache_factory=build_cache_factory(loaded),
    )
    if as_json:
        # Plain echo, not rich: the output must stay parseable JSON.
        typer.echo(json.dumps(result_to_dict(loaded.name, result), ensure_ascii=False))
        return
    render(Console(), loaded, prompts, result)
