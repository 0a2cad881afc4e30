"""`kvtool calibrate MODEL --budget B`: measure a model's per-layer importance and write a profile.

Over 400 lines because most of it is the options' help text and the report of what calibration
chose, which belong with the command they describe.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvtool.cli.app import app
from kvtool.cli.progress import StageBars
from kvtool.errors import KvtoolError

if TYPE_CHECKING:  # heavy imports stay out of `kvtool --help`
    from kvtool.calibration.runner import CalibrationResult
    from kvtool.calibration.truncation import TruncationResult


# SearchSpace fields `--space` may set, and how each value is read. D candidates and merge modes
# are the run's own settings (the config replaces the space's), so they are not offered here.
SPACE_FIELDS = {
    "evictions": str, "selections": str, "scorers": str, "windows": int, "pools": int, "window_shares": float,
    "ratio_sources": str, "heads": str, "recent_shares": float, "seeds": str,
}


def search_space(base: Any, options: list[str]) -> Any:
    """`base` (a SearchSpace) with each `FIELD=V1,V2` of `options` replacing that field; a one-line
    KvtoolError for a malformed option (the values themselves are checked with the config)."""
    changes: dict[str, tuple] = {}
    for option in options:
        field, sep, values = option.partition("=")
        field = field.strip().replace("-", "_")
        if not sep or not values.strip():
            raise KvtoolError(f"--space takes FIELD=V1,V2 (fields: {', '.join(SPACE_FIELDS)}), got {option!r}")
        if field not in SPACE_FIELDS:
            raise KvtoolError(f"unknown --space field {field!r} (fields: {', '.join(SPACE_FIELDS)})")
        kind = SPACE_FIELDS[field]
        parsed = []
        for value in (v.strip() for v in values.split(",")):
            try:
                parsed.append(kind(value))
            except ValueError:
                raise KvtoolError(f"--space {field}: {value!r} is not {'an integer' if kind is int else 'a number'}") from None
        changes[field] = tuple(parsed)
    return dataclasses.replace(base, **changes)


# `--draft`'s default: kvtool.calibration.config.DEFAULT_DRAFT (a test keeps them equal; importing it here costs torch).
DRAFT_DEFAULT = "32,rounds=2,verify"
KV_FORMATS_DEFAULT = "int8"  # kvtool.calibration.config.DEFAULT_KV_FORMATS (a test keeps them equal)
PER_LAYER = "per-layer"  # in --kv-formats: each layer chooses its storage (CalibrateConfig.layer_storage)


@app.command("calibrate")
def calibrate_command(
    model: Annotated[
        str, typer.Argument(help="Alias (smollm2, gemma3-270m), HF model directory, .gguf file, or cached hub id.")
    ],
    budget: Annotated[float, typer.Option("--budget", help="Share of the full KV cache's bytes kept, in (0, 1] (at the model's own precision: on a float32 model 0.1 is 0.2 of a 16-bit cache).")],
    data: Annotated[
        Path | None, typer.Option(
            "--data",
            help='JSONL prompts, one {"prompt": ..., "answer": optional, "images": optional list of paths} per line.',
        )
    ] = None,
    samples: Annotated[
        int | None, typer.Option("--samples", help="Prompts drawn from the data (default: 12; 10 on hybrid models).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sample draw.")] = 0,
    out: Annotated[
        Path | None, typer.Option("--out", help="Profile to write (default: profiles/MODEL-bBUDGET.yaml, e.g. profiles/smollm2-b0.2.yaml).")
    ] = None,
    max_prompt_tokens: Annotated[
        int, typer.Option("--max-prompt-tokens", help="Longer prompts are cut in the middle to this many tokens.")
    ] = 1024,
    merge: Annotated[
        str,
        typer.Option(
            "--merge",
            help="How evicted prompt tokens are folded into kept ones: 'auto' lets calibration choose between "
            "position (Elastic Cache bucket mean) and none (pure eviction); or name one mode (position, none, "
            "similarity-avg, similarity-pivot, similarity-weighted).",
        ),
    ] = "auto",
    search: Annotated[
        bool,
        typer.Option(
            "--search/--papers",
            help="--search (default): choose the recipe (generation rule, prompt selection, scorer and its pool "
            "width, ratio source, shared or per-head entries, recent share, merge, D), starting from the best of "
            "the papers', h2o's and tova's rules, on half the prompts by calibration PPL, and confirm it on the other half. "
            "--papers: keep the papers' recipe (attention-sum, shared, fixed-point) and tune only D and the merge mode.",
        ),
    ] = True,
    space: Annotated[
        list[str] | None,
        typer.Option(
            "--space",
            help="Change what the recipe search tries, FIELD=V1,V2 (repeatable): " + ", ".join(SPACE_FIELDS)
            + "; e.g. --space window_shares=0.5,0.7 --space pools=15,31. The D candidates are the run's own and "
            "--merge sets the merge modes.",
        ),
    ] = None,
    reference_tokens: Annotated[
        int,
        typer.Option(
            "--reference-tokens",
            help="Length of the full-cache continuations the recipe search teacher-forces; match the generation "
            "length you serve (eviction needs about D / (1 - budget) steps to reach generated tokens). Prompts of "
            "kind long-answer get 256-token ones.",
        ),
    ] = 64,  # kvtool.calibration.config.REFERENCE_TOKENS (a test keeps them equal; importing it here costs torch)
    draft: Annotated[
        str,
        typer.Option(
            "--draft",
            help="The profile's draft: tokens drafted through the compressed cache before the prompt is compressed "
            "again with their attention in its scores (the budget holds; the cost is the draft's steps and one "
            "forward of its rows per round, never longer than the generation). Comma-separated: the tokens (0 or 'none': "
            "compress once), 'rounds=N' (each round drafts through the cache the last one scored), 'verify' / "
            "'no-verify' (check each draft against the full-attention logits of the forward that scores it; the "
            "answer starts with the agreed prefix), 'jacobi' / 'no-jacobi' (a later round's draft is the last "
            "round's full-attention predictions, not new steps through the cache: half the steps of 2 rounds, "
            "less kept), 'stage' (after the search, measure its pick and the recipes one "
            "generation rule or ratio source away with the draft and ship the best if the held-out prompts agree; "
            "minutes more, the built-in profiles are made with it). Omitted parts keep the default's.",
        ),
    ] = DRAFT_DEFAULT,
    max_prompt_overhead: Annotated[
        str,
        typer.Option(
            "--max-prompt-overhead",
            help="The most the prompt phase may cost, as a multiple of the full cache's prompt forward, measured on "
            "the calibration prompts with the profile's draft: a draft over it gives way to the next cheaper one "
            "that fits (half the tokens down to 32, then one round fewer, then half the tokens, then none). 'none': measure and record only. The "
            "profile records the measured overhead; `kvtool inspect profile` shows it.",
        ),
    ] = "4",  # kvtool.calibration.config.DEFAULT_MAX_PROMPT_OVERHEAD (a test keeps them equal)
    budget_tokens: Annotated[
        int,
        typer.Option(
            "--budget-tokens",
            help="Hybrid models (sliding-window layers, e.g. Gemma 3): the prompt length at which --budget is the kept "
            "share of the whole KV cache, each layer counted as it stores (a sliding layer at most its window). "
            "Recorded in the profile; calibration splits the budget between shorter sliding windows and the "
            "full-attention layers by measured PPL on prompts past the window.",
        ),
    ] = 4096,  # kvtool.calibration.config.DEFAULT_BUDGET_TOKENS (a test keeps them equal)
    kv_formats: Annotated[
        str,
        typer.Option(
            "--kv-formats",
            help="Storages to spend the bytes at, comma-separated (int8, fp8, int4, int4-g32, int2-g32, or KEYS/VALUES "
            "such as int8/int4-g32): the recipe search runs at the entries the first keeps at the budget's bytes, then "
            "the recipe is measured at each and at the model's precision, every layer at one, its entries re-derived to "
            "the same bytes; the lowest PPL on the prompts that choose ships where the held-out prompts confirm it "
            "against the model's own precision. 'native': the model's precision only. Add 'per-layer' (int8,int4-g32,per-layer) for each "
            "layer to choose its storage with its entries by measured loss within the bytes (models without "
            "sliding-window layers; slower, and on SmolLM2 no better).",
        ),
    ] = KV_FORMATS_DEFAULT,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="Also search what a serving engine can serve at the same bytes (vllm: one recency-window size, one "
            "KV dtype, skipped layers at native precision; trtllm: a window per layer, auto or fp8), emulated with the "
            "engine's semantics on the same prompts, and record its PPL beside kvtool's (`kvtool export --engine`).",
        ),
    ] = None,
) -> None:
    """Calibrate a model at a budget: choose the recipe, its per-layer ratios (PrefixKV) and D; write a profile."""
    # Imported here so `kvtool --help` does not pay for torch/transformers.
    from kvtool.profiles.kept_fraction import check_budget
    from kvtool.calibration.config import DEFAULT_MERGE_MODES, CalibrateConfig
    from kvtool.calibration.recipes import SearchSpace
    from kvtool.calibration.runner import calibrate
    from kvtool.files import check_writable
    from kvtool.profiles import MERGE_MODES, MethodSettings

    if space and not search:
        raise KvtoolError("--space changes the recipe search; it cannot go with --papers")
    if merge != "auto" and merge not in MERGE_MODES:
        raise KvtoolError(f"--merge must be auto or one of {', '.join(MERGE_MODES)}, got {merge!r}")

    formats = [part.strip() for part in kv_formats.split(",") if part.strip()]
    draft_settings, draft_stage = parse_draft(draft)
    overhead_limit = parse_overhead(max_prompt_overhead)
    model_budget = check_budget(budget)
    dest = check_writable(out if out is not None else default_out_path(model, model_budget))
    config = CalibrateConfig(
        samples=samples,
        seed=seed,
        max_prompt_tokens=max_prompt_tokens,
        method=MethodSettings() if merge == "auto" else MethodSettings(merge=merge),
        merge_modes=DEFAULT_MERGE_MODES if merge == "auto" else (merge,),
        reference_tokens=reference_tokens,
        draft=draft_settings,
        draft_stage=draft_stage,
        max_prompt_overhead=overhead_limit,
        budget_tokens=budget_tokens,
        kv_formats=tuple(part for part in formats if part != PER_LAYER),
        layer_storage=PER_LAYER in formats,
        # Its D candidates and merge modes are the config's.
        search=search_space(SearchSpace(), space or []) if search else None,
    )
    if engine is not None:
        from kvtool.calibration.engine import calibrate_for_engine, describe, engine_space

        engine_space(engine)  # an unknown engine before any model work
        with StageBars(Console(stderr=True)) as bars:
            run = calibrate_for_engine(model, model_budget, engine, data=data, out=dest, config=config, progress=bars)
        render_summary(Console(), run.result)
        Console().print(Text(describe(run)))
        return
    with StageBars(Console(stderr=True)) as bars:
        result = calibrate(model, model_budget, data=data, out=dest, config=config, progress=bars)
    render_summary(Console(), result)


def parse_overhead(spec: str) -> float | None:
    """`--max-prompt-overhead` as a number >= 1 or None ('none'); a one-line KvtoolError otherwise."""
    if spec.strip().lower() == "none":
        return None
    try:
        limit = float(spec)
    except ValueError:
        limit = float("nan")
    if not limit >= 1.0:
        raise KvtoolError(f"--max-prompt-overhead takes a number >= 1 (a multiple of the full cache's prompt phase) or none, got {spec!r}")
    return limit


def parse_draft(spec: str) -> tuple[Any, bool]:
    """`--draft SPEC` as (the Draft or None, whether the draft stage runs); a one-line KvtoolError
    for a malformed SPEC. Parts SPEC leaves out keep `DRAFT_DEFAULT`'s."""
    from kvtool.profiles import Draft

    usage = "--draft takes TOKENS[,rounds=N][,verify|no-verify][,jacobi|no-jacobi][,stage], e.g. 64,rounds=2,verify or none"
    tokens, rounds, verify, jacobi, stage = 0, 1, False, False, False
    for part in (p.strip().lower() for p in f"{DRAFT_DEFAULT},{spec}".split(",")):
        key, sep, value = part.partition("=")
        if part == "none":
            tokens = 0
        elif part.isdigit():
            tokens = int(part)
        elif sep and key == "rounds" and value.isdigit():
            rounds = int(value)
        elif part in ("verify", "no-verify"):
            verify = part == "verify"
        elif part in ("jacobi", "no-jacobi"):
            jacobi = part == "jacobi"
        elif part == "stage":
            stage = True
        else:
            raise KvtoolError(f"{usage}; got {spec!r}")
    if rounds < 1:
        raise KvtoolError(f"--draft rounds must be at least 1, got {rounds}")
    return (Draft(tokens, rounds, verify, jacobi) if tokens else None), stage


def default_out_path(model_name: str, budget: float) -> Path:
    """`profiles/<model>-b<budget>.yaml`, the model reduced to a file-name-safe last component."""
    base = model_name.rstrip("/\\")
    stem = Path(base).stem if base.lower().endswith(".gguf") else Path(base).name
    stem = stem.replace(os.sep, "-").replace("/", "-") or "model"
    return Path("profiles") / f"{stem}-b{budget:g}.yaml"


def render_summary(console: Console, result: CalibrationResult) -> None:
    from kvtool.cli.inspect_cmd import layer_table

    profile = result.profile
    info = profile.calibration
    console.print(layer_table(profile))
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column()
    tokens = info.prompt_tokens if info else None
    if profile.budget_tokens is not None:
        from kvtool.cli.inspect_cmd import whole_cache_phrase

        facts.add_row("Budget", whole_cache_phrase(profile))
    else:
        facts.add_row("Budget", f"keeps {profile.budget:.1%} of the KV cache's bytes, mean kept ratio of entries {_mean_ratio(profile):.4f}")
    if profile.method.ratios == "measured":
        facts.add_row("Ratios", f"from each layer's measured loss on {len(result.losses.deltas)} prompts (the Loss column of `kvtool inspect gini`)")
    else:
        facts.add_row(
            "Retention p", f"{result.allocation.p:.4f} (each compressed layer keeps at least this share of its importance)"
        )
    if tokens is not None:
        facts.add_row(
            "Samples",
            f"{len(result.samples)} prompts · tokens min {tokens.min} · mean {tokens.mean:.0f} · max {tokens.max}",
        )
    if result.recipes is not None:
        add_recipe_facts(facts, result, info)
    elif result.truncation is not None:
        facts.add_row("Truncation D", f"{result.truncation.best} (lowest calibration PPL)")
        if len(result.merge_ppl) > 1:
            tried = ", ".join(f"{mode} {ppl:.3f}" for mode, ppl in result.merge_ppl.items())
            facts.add_row("Merge mode", f"{profile.method.merge} (lowest calibration PPL at its best D: {tried})")
        facts.add_row(
            "Calibration PPL",
            f"full {result.truncation.ppl_full:.3f} → compressed {result.truncation.ppl_compressed:.3f}"
            f" over {result.truncation.tokens} reference tokens",
        )
    if result.windows is not None and result.windows.ppl:
        tried = ", ".join(f"{w} {ppl:.3f}" for w, ppl in result.windows.ppl.items())
        held = ", ".join(f"{w} {ppl:.3f}" for w, ppl in result.windows.held_out.items())
        facts.add_row(
            "Sliding windows",
            f"entries each sliding layer keeps, PPL on the prompts that chose: {tried}"
            + (f"; held out: {held}" if held else ""),
        )
    if info is not None and info.storages:
        from kvtool.cli.inspect_cmd import storage_phrase

        facts.add_row("Storage", storage_phrase(info))
    facts.add_row("Time", f"{result.seconds:.1f} s")
    if result.path is not None:
        facts.add_row("Profile", Text(str(result.path)))
    if result.recipes is not None:
        from kvtool.cli.inspect_cmd import recipe_table

        parts = [recipe_table(profile), facts]
    else:
        parts = [facts] if result.truncation is None else [truncation_table(result.truncation), facts]
    console.print(Group(*parts))


def add_recipe_facts(facts: Table, result: CalibrationResult, info=None) -> None:
    from kvtool.calibration.recipes import describe
    from kvtool.calibration.storage import AS_SEARCHED

    chosen = result.recipes
    picked = chosen.picked
    if chosen.fell_back:
        facts.add_row(
            "Recipe",
            f"{describe(picked)} (the finalist with the lowest PPL over all {chosen.chosen_on + chosen.confirmed_on} "
            f"prompts: the held-out prompts rejected the search's choice, {describe(chosen.search.chosen)}; "
            "nothing independent confirms this one)",
        )
    elif chosen.shipped != picked:
        facts.add_row(
            "Recipe",
            f"{describe(chosen.shipped)} (the draft stage's choice; the search's pick, without the draft: {describe(picked)})",
        )
    else:
        facts.add_row("Recipe", f"{describe(picked)} (lowest PPL on {chosen.chosen_on} prompts)")
    if chosen.drafted is not None:
        add_draft_stage_facts(facts, chosen)
    facts.add_row(
        "Calibration PPL",
        f"full {chosen.ppl_full:.3f} → {chosen.search.ppl_of(picked):.3f} (papers' recipe "
        f"{chosen.search.ppl_of(chosen.search.start):.3f}) over {chosen.tokens} reference tokens"
        + "".join(f"; shipped at {t.storage}: {t.ppl:.3f}" for t in (info.storages if info else ()) or ()
                  if t.shipped and t.storage != AS_SEARCHED),
    )
    if chosen.held_out:
        from kvtool.calibration.recipes import recipe_key

        held = chosen.held_out
        verdict = {True: "confirmed", False: "NOT confirmed", None: "nothing to confirm"}[chosen.confirmed]
        facts.add_row(
            "Held out",
            f"{chosen.confirmed_on} other prompts: full {chosen.held_out_ppl_full:.3f} → chosen "
            f"{held[recipe_key(chosen.search.chosen)]:.3f}, papers' {held[recipe_key(chosen.search.start)]:.3f} ({verdict})"
            + (f"; shipped finalist {held[recipe_key(picked)]:.3f}" if chosen.fell_back else ""),
        )




def add_draft_stage_facts(facts: Table, chosen) -> None:
    from kvtool.calibration.recipes import describe, recipe_key

    stage = chosen.drafted
    scored = ", ".join(f"{describe(s).split(' · ')[0]} / {s.ratios} ratios {stage.choosing[recipe_key(s)]:.3f}" for s in stage.candidates)
    if recipe_key(stage.picked) != recipe_key(chosen.picked):
        verdict = (f"shipped {describe(stage.picked)}: held out {stage.held_out[recipe_key(stage.picked)]:.3f} "
                   f"vs the search's pick {stage.held_out[recipe_key(chosen.picked)]:.3f}")
    elif stage.held_out:
        best = next(k for k in stage.held_out if k != recipe_key(chosen.picked))
        verdict = (f"kept the search's pick: the held-out prompts did not confirm the best drafted recipe "
                   f"({stage.held_out[best]:.3f} vs {stage.held_out[recipe_key(chosen.picked)]:.3f})")
    else:
        verdict = "kept the search's pick (lowest drafted PPL)"
    facts.add_row("Draft stage", f"PPL with the draft on {chosen.chosen_on} prompts: {scored}; {verdict}")


def truncation_table(truncation: TruncationResult) -> Table:
    table = Table(
        title="Truncation distance D", caption="teacher-forced PPL of the full-cache references", title_justify="left"
    )
    table.add_column("D", justify="right")
    table.add_column("PPL", justify="right")
    table.add_column("vs full", justify="right")
    for distance in sorted(truncation.ppl):
        ppl = truncation.ppl[distance]
        chosen = distance == truncation.best
        table.add_row(
            f"{distance}{' *' if chosen else ''}",
            f"{ppl:.3f}",
            f"{ppl / truncation.ppl_full - 1:+.1%}",
            style="bold green" if chosen else None,
        )
    return table


def _mean_ratio(profile) -> float:
    ratios = [layer.ratio for layer in profile.layers if layer.compress]
    return sum(ratios) / len(ratios) if ratios else 1.0
