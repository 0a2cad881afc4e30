"""`kvtool generate MODEL PROMPT...`: batched generation with timing and KV-cache size."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtool.cli.app import app
from kvtool.cli.profile_choice import (
    BudgetOption, KvFormatOption, MinKeptOption, ModelArgument, ProfileOption, check_choice, choose_cache_profile,
)
from kvtool.units import human_bytes

if TYPE_CHECKING:  # heavy imports stay out of `kvtool --help`
    from kvtool.models import LoadedModel
    from kvtool.runtime.generate import GenerationResult


def result_to_dict(model_name: str, result: GenerationResult, cache_note: str) -> dict[str, Any]:
    """The `--json` contract: keep these keys stable, scripts parse them."""
    return {
        "model": model_name,
        "cache": cache_note,
        "outputs": result.outputs,
        "prompt_tokens": result.prompt_tokens,
        "new_tokens": result.new_tokens,
        "prefill_s": result.prefill_s,
        "decode_tok_s": result.decode_tok_s,
        "kv_bytes": result.kv_bytes,
        "kv_bytes_full": result.kv_bytes_full,
        "kv_bytes_by_type": {kind: {"kv_bytes": held, "kv_bytes_full": full} for kind, (held, full) in result.kv_by_type.items()},
        "total_s": result.total_s,
        "compressed": result.compressed,
    }


# Below this many entries in some layer, a compressed prompt is mostly gone: say how to keep more.
FEW_ENTRIES = 16
SUGGESTED_FLOOR = 64


def short_prompt_hint(ratios: list[float], prompt_tokens: list[int], min_kept: int) -> str | None:
    """A one-line hint when the shortest prompt left some compressing layer fewer than FEW_ENTRIES
    entries and no floor was asked for."""
    if min_kept or not ratios or not prompt_tokens:
        return None
    from kvtool.runtime.selection import kept_count

    shortest = min(prompt_tokens)
    fewest = int(kept_count(min(ratios), [shortest])[0])
    if fewest >= FEW_ENTRIES or fewest >= shortest:
        return None
    return (
        f"short prompt: a {shortest}-token prompt leaves some layers {fewest} entries at this budget; "
        f"--min-kept {SUGGESTED_FLOOR} keeps at least {SUGGESTED_FLOOR} per layer (memory above the budget until "
        "prompts are longer)"
    )


def render(
    console: Console, loaded: LoadedModel, prompts: list[str], result: GenerationResult, cache_note: str,
    hint: str | None = None,
) -> None:
    for index, (prompt, output) in enumerate(zip(prompts, result.outputs), start=1):
        # Text objects, not markup strings: prompts and outputs may contain "[...]".
        console.print(Text.assemble((f"[{index}] ", "bold"), (prompt, "dim")))
        console.print(Text(output))
        console.print()
    console.print(Text(f"model {loaded.name}: {loaded.source}", style="dim"), soft_wrap=True)
    console.print(Text(f"KV cache: {cache_note}", style="dim"), soft_wrap=True)
    if hint:
        console.print(Text(hint, style="yellow"), soft_wrap=True)
    table = Table(show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_row("prompt tokens", ", ".join(map(str, result.prompt_tokens)))
    table.add_row("new tokens", ", ".join(map(str, result.new_tokens)))
    table.add_row("prefill", f"{result.prefill_s:.3f} s")
    table.add_row("decode", f"{result.decode_tok_s:.1f} tok/s" if result.decode_tok_s else "— (1 token)")
    table.add_row("KV cache", f"{human_bytes(result.kv_bytes)} ({result.kv_bytes:,} B)")
    table.add_row("full cache", f"{human_bytes(result.kv_bytes_full)} ({result.kv_bytes_full:,} B)")
    if result.kv_bytes_full:
        kept = result.kv_bytes / result.kv_bytes_full
        native = loaded.model.dtype.itemsize
        # Against the bytes a 16-bit cache of the same entries would hold (what GPUs serve), on wider models.
        sixteen = f" ({kept * native / 2:.1%} of a 16-bit one)" if native > 2 else ""
        table.add_row("kept", f"{kept:.1%} of the full cache{sixteen}")
    if len(result.kv_by_type) > 1:
        for kind, (held, full) in result.kv_by_type.items():
            table.add_row(f"  {kind.removesuffix('_attention')} layers", f"{held / full:.1%} of {human_bytes(full)}" if full else "—")
    console.print(table)


@app.command("generate")
def generate_command(
    model: ModelArgument,
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts, generated as one batch.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; above 0 samples at this temperature.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling.")] = None,
    budget: BudgetOption = None,
    profile: ProfileOption = None,
    min_kept: MinKeptOption = 0,
    kv_format: KvFormatOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead.")] = False,
) -> None:
    """Generate continuations for PROMPTs as one batch; report timing and KV-cache bytes."""
    # Imported here so `kvtool --help` does not pay for torch/transformers.
    from kvtool.models import load_model
    from kvtool.models.prompts import check_prompts
    from kvtool.runtime import attach
    from kvtool.profiles.schema import draft_phrase
    from kvtool.runtime.generate import generate

    check_prompts(prompts)  # before the slow model load
    check_choice(budget, profile, kv_format)
    loaded = load_model(model)
    chosen = choose_cache_profile(loaded, budget, profile, kv_format)
    handle = None
    cache_factory = draft = None
    cache_note = "full (uncompressed) cache"
    if chosen is not None:
        handle = attach(loaded.model, chosen[0], min_kept=min_kept)
        # The draft is applied by `generate` (as `handle.generate` applies it): the factory is the bare cache.
        cache_factory, cache_note, draft = handle.bare_cache, chosen[1], chosen[0].method.draft
        if min_kept:
            cache_note += f"; at least {min_kept} entries per layer"
        if draft is not None:
            cache_note += f"; {draft_phrase(draft)}"
    try:
        result = generate(
            loaded.model,
            loaded.tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            cache_factory=cache_factory,
            draft=draft,
        )
    finally:
        if handle is not None:
            handle.detach()
    if chosen is not None and not result.compressed:
        cache_note = "full cache: the prompts are too short for compression to save memory (their KV is under 1% of the weights)"
    if as_json:
        # Plain echo, not rich: the output must stay parseable JSON.
        typer.echo(json.dumps(result_to_dict(loaded.name, result, cache_note), ensure_ascii=False))
        return
    ratios = [] if chosen is None or not result.compressed else [l.ratio for l in chosen[0].layers if l.compress and l.ratio < 1.0]
    render(Console(), loaded, prompts, result, cache_note, short_prompt_hint(ratios, result.prompt_tokens, min_kept))
