"""`kvtool inspect ...`: read-only views of profiles."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtool.cli.app import inspect_app
from kvtool.profiles import Profile, profile_to_dict, read_profile, whole_cache
from kvtool.profiles.byte_budget import byte_share, is_quantized
from kvtool.profiles.entry_bytes import layer_share
from kvtool.profiles.schema import WINDOW_SCORERS, CalibrationInfo, LayerProfile, draft_phrase

_BAR_WIDTH = 20
# Eighth blocks give the bar sub-character resolution, so 0.20 and 0.22 look different.
_EIGHTHS = " ▏▎▍▌▋▊▉█"
_MISSING = "—"


@inspect_app.command("profile")
def inspect_profile(
    path: Annotated[Path, typer.Argument(help="Profile YAML file to check and summarise.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON instead.")] = False,
) -> None:
    """Validate a profile and show its model, budget, method and per-layer kept ratios."""
    profile = read_profile(path)
    if as_json:
        # Plain echo, not rich: the output must stay parseable JSON.
        typer.echo(json.dumps(profile_to_dict(profile), indent=2, ensure_ascii=False))
        return
    console = Console()
    console.print(summary_grid(profile, path))
    console.print(layer_table(profile))
    if profile.calibration is not None and profile.calibration.recipes:
        console.print(recipe_table(profile))
    # soft_wrap keeps the verdict on one line, so it stays greppable whatever the path length.
    console.print(
        Text.assemble(
            ("✓ ", "green"), f"{path} is a valid kvtool profile (schema v{profile.schema_version})"
        ),
        soft_wrap=True,
    )


# --------------------------------------------------------------------------- summary


def summary_grid(profile: Profile, path: Path) -> Table:
    """Two-column key/value overview of everything except the per-layer rows."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")  # long paths and names wrap instead of being cut off
    rows = [("Profile", str(path))]
    rows += _model_rows(profile) + _budget_rows(profile) + _method_rows(profile)
    if profile.calibration is not None:
        rows += _calibration_rows(profile.calibration)
    else:
        rows.append(("Calibration", "none (uniform profile)"))
    made = [profile.created, f"kvtool {profile.kvtool_version}" if profile.kvtool_version else ""]
    rows.append(("Created", " · ".join(part for part in made if part) or _MISSING))
    for key, value in rows:
        # Text, not markup: names and paths come from the file and may contain "[...]".
        grid.add_row(key, Text(value))
    return grid


def _model_rows(profile: Profile) -> list[tuple[str, str]]:
    m = profile.model
    shape = (
        f"{m.num_layers} layers · {m.num_attention_heads} heads / {m.num_kv_heads} KV heads"
        f" · head_dim {m.head_dim} · hidden {m.hidden_size} · vocab {m.vocab_size}"
    )
    counts = Counter(m.layer_types)
    types = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in counts.items()) or _MISSING
    return [("Model", f"{m.name} ({m.model_type})"), ("Shape", shape), ("Layer types", types)]


def whole_cache_phrase(profile: Profile) -> str:
    """A hybrid profile's budget: the whole cache's kept share at its reference length, and each layer type's."""
    shares = whole_cache.shares(profile)
    kinds = ", ".join(f"{kind.removesuffix('_attention')} layers {share:.1%}" for kind, share in shares.items() if kind != "all")
    return (f"keeps {profile.budget:.1%} of the whole KV cache at {profile.budget_tokens} prompt tokens "
            f"(measured from the layers: {shares['all']:.1%}; {kinds})")


def _budget_rows(profile: Profile) -> list[tuple[str, str]]:
    compressed = [layer.ratio for layer in profile.layers if layer.compress]
    mean = f"{sum(compressed) / len(compressed):.3f}" if compressed else _MISSING
    budget = (whole_cache_phrase(profile) if profile.budget_tokens is not None
              else f"keeps {profile.budget:.1%} of KV entries (evicts {1 - profile.budget:.1%})")
    rows = [
        ("Budget", budget),
        ("Kept ratios", f"mean {mean} over {len(compressed)} compressed of {len(profile.layers)} layers"),
    ]
    if is_quantized(profile):
        native = profile.native_bytes
        stored = Counter(storage_name(layer) for layer in profile.layers if layer.compress)
        rows[0] = ("Budget", f"keeps {profile.budget:.1%} of the KV cache's bytes at {8 * native}-bit values"
                   + (f" ({profile.budget * native / 2:.1%} of a 16-bit cache)" if native != 2 else ""))
        rows.append(("Stored", ", ".join(f"{name} in {n} layers" for name, n in stored.most_common())
                     + f"; {byte_share(profile):.1%} of the compressed layers' bytes"))
    return rows
    windows = sorted({(layer.window, layer.sinks or 0, layer.scored) for layer in profile.layers if layer.window is not None})
    if windows:
        shaped = sum(1 for layer in profile.layers if layer.window is not None)
        kept = lambda w, s, scored: f"{w - s} by the last row's attention in the model's window" if scored else f"{w - s} recent"  # noqa: E731
        rows.append(("Windows", ", ".join(f"{w} entries ({s} sinks + {kept(w, s, scored)})" for w, s, scored in windows)
                     + f" in {shaped} window-shaped layers (sliding layers given a shorter window)"))
    return rows


def _method_rows(profile: Profile) -> list[tuple[str, str]]:
    s = profile.method
    scorer = s.scorer if s.scorer not in WINDOW_SCORERS else f"{s.scorer} (last {s.window} rows, pool {s.pool})"
    if s.scorer == "union":
        scorer = f"{scorer[:-1]}, window share {s.window_share:.0%})"
    return [
        (
            "Recipe",
            f"generation {s.eviction} · selection {s.selection} · scorer {scorer} · ratios {s.ratios}"
            f" · {s.heads} heads · recent share {s.recent_share:.0%}"
            + (f" · {draft_phrase(s.draft)}" if s.draft else ""),
        ),
        (
            "Method",
            f"merge {s.merge} · sink tokens {s.sink_tokens} · recent window {s.recent_window}"
            f" · truncation distance {s.truncation_distance}",
        ),
    ] + _query_rows(profile)


def _query_rows(profile: Profile) -> list[tuple[str, str]]:
    stats, ref = profile.query_stats, profile.queries
    if stats is None or ref is None:
        return []
    heads = stats.mean.shape[1]
    what = "mean and covariance" if stats.pair_norm is None else "mean, covariance and RoPE-pair lengths"
    return [(
        "Query statistics",
        f"{ref.file}: {len(stats.layers)} layers x {heads} heads, {what} of {stats.queries:,} "
        f"calibration queries ({stats.nbytes / 1e3:,.0f} kB); RoPE averaged over the next {stats.future} positions",
    )]


def _calibration_rows(info: CalibrationInfo) -> list[tuple[str, str]]:
    tokens = info.prompt_tokens
    rows = [
        ("Calibration", f"{info.samples} samples · dataset {info.dataset_hash}"),
        ("Prompt tokens", f"min {tokens.min} · mean {tokens.mean:.1f} · max {tokens.max}"),
    ]
    details = [
        f"retention p {info.retention_p:g}" if info.retention_p is not None else "",
        f"seed {info.seed}" if info.seed is not None else "",
        f"{info.seconds:.1f} s" if info.seconds is not None else "",
    ]
    if any(details):
        rows.append(("Run", " · ".join(d for d in details if d)))
    if info.ppl_full is not None or info.ppl_compressed is not None:
        full, compressed = _fmt(info.ppl_full, ".3f"), _fmt(info.ppl_compressed, ".3f")
        rows.append(("Perplexity", f"full {full} → compressed {compressed}"))
    if info.truncation_ppl:
        table = ", ".join(f"D={d}: {ppl:.3f}" for d, ppl in sorted(info.truncation_ppl.items()))
        rows.append(("Truncation PPL", table))
    if info.chosen_on is not None:
        held = f" · confirmed on {info.confirmed_on} held-out prompts" if info.confirmed_on else ""
        if info.fell_back:
            held = (f" · the held-out {info.confirmed_on} rejected the search's choice: shipped the finalist "
                    "with the lowest PPL over all prompts (not independently confirmed)")
        if info.held_out_ppl_full is not None:
            held += f" (full cache PPL there {info.held_out_ppl_full:.3f})"
        rows.append(("Recipe search", f"{len(info.recipes or ())} recipes tried on {info.chosen_on} prompts{held}"))
    if info.storages:
        rows.append(("Storage stage", storage_phrase(info)))
    if info.window_ppl:
        tried = ", ".join(f"{w}: {ppl:.3f}" for w, ppl in info.window_ppl.items())
        rows.append(("Window PPL", f"sliding-layer window (entries) tried: {tried}"))
    if info.prompt_overhead is not None:
        limit = f" (limit {info.max_prompt_overhead:g}x)" if info.max_prompt_overhead is not None else " (no limit)"
        rows.append(("Prompt phase", f"{info.prompt_overhead:.2f}x the full cache's, measured on the calibration prompts{limit}"))
    return rows


def _fmt_or_blank(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


# --------------------------------------------------------------------------- per-layer table


def layer_table(profile: Profile) -> Table:
    """One row per layer: kept ratio (number and bar), Gini, spread across samples, compress flag."""
    table = Table(title="Per-layer KV budget (kept fraction)", title_justify="left")
    table.add_column("Layer", justify="right")
    table.add_column("Type")
    table.add_column("Kept", justify="right")
    table.add_column("", no_wrap=True, min_width=_BAR_WIDTH)
    table.add_column("Gini", justify="right")
    table.add_column("Spread", justify="right")
    table.add_column("Compress")
    quantized = is_quantized(profile)
    if quantized:
        table.add_column("Stored")
        table.add_column("Bytes", justify="right")
    types = profile.model.layer_types
    for index, layer in enumerate(profile.layers):
        kind = types[index] if index < len(types) else ""
        cells = _layer_cells(index, kind, layer)
        if quantized:
            cells += [storage_name(layer), f"{layer_share(layer, profile.model.head_dim, profile.native_bytes):.3f}" if layer.compress else _MISSING]
        table.add_row(*cells, style=None if layer.compress or layer.window else "dim")
    return table


def storage_name(layer: LayerProfile) -> str:
    """How a layer stores its kept entries: one format, or KEYS/VALUES."""
    k, v = layer.keys_format, layer.values_format
    return k if k == v else f"{k}/{v}"


def _layer_cells(index: int, kind: str, layer: LayerProfile) -> list[str | Text]:
    kept = f"{layer.ratio:.3f}" if layer.window is None else f"window {layer.window}"
    return [
        str(index),
        Text(kind.removesuffix("_attention") or _MISSING),
        kept,
        Text(ratio_bar(layer.ratio) if layer.window is None else "", style="cyan"),
        _fmt(layer.gini, ".3f"),
        _fmt(layer.ratio_std, ".3f", prefix="±"),
        "yes" if layer.compress or layer.window is not None else "no",
    ]


def ratio_bar(ratio: float, width: int = _BAR_WIDTH) -> str:
    """A `width`-character bar filled to `ratio` (clamped to [0, 1]) in eighth-block steps."""
    eighths = round(max(0.0, min(1.0, ratio)) * width * 8)
    full, rest = divmod(eighths, 8)
    bar = "█" * full + (_EIGHTHS[rest] if rest else "")
    return bar.ljust(width)


def _fmt(value: float | None, spec: str, prefix: str = "") -> str:
    return _MISSING if value is None else f"{prefix}{value:{spec}}"


def recipe_table(profile) -> Table:
    """Every recipe the search tried (from the profile's record), the chosen one marked."""
    info = profile.calibration
    table = Table(
        title="Recipe search",
        caption=f"teacher-forced PPL on {info.chosen_on} calibration prompts; held out: {info.confirmed_on or 0} others",
        title_justify="left",
    )
    table.add_column("stage", no_wrap=True)
    table.add_column("recipe: generation rule · scorer (window rows/pool width) · ratios · heads · recent share · merge", overflow="fold")
    # The numbers are the point of the table: narrow terminals wrap the recipe, never these.
    table.add_column("PPL", justify="right", no_wrap=True)
    table.add_column("held out", justify="right", no_wrap=True)
    drafted = any(t.drafted_ppl is not None for t in info.recipes)
    if drafted:
        # The draft stage's measures: the same prompts, each recipe run with the profile's draft.
        table.add_column("with draft", justify="right", no_wrap=True)
        table.add_column("held out, draft", justify="right", no_wrap=True)
    method = profile.method
    for t in info.recipes:
        chosen = (t.eviction, t.selection, t.scorer, t.ratios, t.heads, t.merge) == (
            method.eviction, method.selection, method.scorer, method.ratios, method.heads, method.merge
        ) and (t.eviction != "fixed-point" or t.truncation_distance == method.truncation_distance) and (
            t.scorer not in WINDOW_SCORERS or (t.window in (None, method.window) and t.pool in (None, method.pool))
        ) and (t.scorer != "union" or (t.window_share or 0.5) == method.window_share) and (t.selection != "importance" or t.recent_share == method.recent_share)
        rule = f"{t.eviction} D{t.truncation_distance}" if t.eviction == "fixed-point" else t.eviction
        if t.selection != "importance":
            rule += f" · {t.selection} sel."
        scorer = t.scorer
        if t.scorer in WINDOW_SCORERS and t.pool is not None:
            scorer = f"{t.scorer} {t.window or ''}/{t.pool}"
            if t.scorer == "union" and t.window_share not in (None, 0.5):
                scorer += f" ({t.window_share:.0%} window)"
        recent = f"{t.recent_share:.0%}" if t.selection == "importance" else "half"
        table.add_row(
            t.stage.replace("generation rule", "rule").replace("recent share", "recent"),
            f"{rule} · {scorer} · {t.ratios} · {t.heads} · {recent} · {t.merge}",
            f"{t.ppl:.3f}{' *' if chosen else ''}", "" if t.held_out_ppl is None else f"{t.held_out_ppl:.3f}",
            *((_fmt_or_blank(t.drafted_ppl), _fmt_or_blank(t.drafted_held_out_ppl)) if drafted else ()),
            style="bold green" if chosen else None,
        )
    return table


def storage_phrase(info) -> str:
    """The storage stage's PPLs (`calibration.storage`) and what shipped, in one line."""
    shipped = next((t.storage for t in info.storages if t.shipped), "?")
    tried = "; ".join(
        f"{t.storage} {t.ppl:.3f}" + (f" (held out {t.held_out_ppl:.3f})" if t.held_out_ppl is not None else "")
        for t in info.storages
    )
    return f"the recipe at the same bytes, PPL on the prompts that chose: {tried}; shipped: {shipped}"
