"""`kvtool inspect gini PROFILE|MODEL`: how concentrated each layer's attention importance is, and
what PrefixKV would keep beside what the profile ships."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtool.cli.app import inspect_app
from kvtool.profiles import Profile, read_profile
from kvtool.profiles.fingerprint import FULL_ATTENTION, SLIDING_ATTENTION
from kvtool.profiles.loss_budget import interpolate
from kvtool.profiles.byte_budget import is_quantized
from kvtool.cli.inspect_cmd import storage_name
from kvtool.profiles.prefixkv import PrefixKV, missing_curve, prefixkv

_PROFILE_SUFFIXES = (".yaml", ".yml")
_MISSING = "—"
_KINDS = {FULL_ATTENTION: "full", SLIDING_ATTENTION: "sliding"}


def is_profile_path(target: str) -> bool:
    """A YAML file name is a profile (missing or not: read_profile then says so); anything else is a model."""
    return Path(target).suffix.lower() in _PROFILE_SUFFIXES and not Path(target).is_dir()


def has_image_share(profile: Profile) -> bool:
    """Whether the calibration had images (some layer records its kept image share)."""
    return any(layer.image_share is not None for layer in profile.layers)


def layer_loss(profile: Profile, layer) -> float | None:
    """The measured rise of NLL per token were this layer alone to keep its ratio (None unmeasured)."""
    if layer.loss_curve is None or not profile.loss_ratios or not layer.compress:
        return None
    return float(interpolate(layer.loss_curve, profile.loss_ratios, [layer.ratio])[0])


def layer_kind(profile: Profile, index: int) -> str | None:
    """"full" or "sliding" attention; None where the profile does not record the layer types."""
    types = profile.model.layer_types
    return _KINDS.get(types[index], types[index]) if index < len(types) else None


def ratio_source(profile: Profile, layer) -> str:
    """Where a layer's shipped ratio comes from: the profile's ratio source (`scorer`,
    `attention-sum`, `uniform`, `measured`) for a compressing layer, `window` for a sliding layer
    kept as a window, `untouched` for a layer kept whole."""
    if layer.window is not None:
        return "window"
    return profile.method.ratios if layer.compress else "untouched"


def _source_label(profile: Profile, layer) -> str:
    source = ratio_source(profile, layer)
    if source == "window":
        return "scored window" if layer.scored else "window"
    if source == "untouched":
        return "kept whole"
    if source == "scorer":
        return "attention-sum" if profile.method.scorer == "attention-sum" else f"{profile.method.scorer} curve"
    return source


def correlation(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation of two equally long series; None with fewer than 2 points or no spread."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.size < 2 or np.ptp(a) == 0.0 or np.ptp(b) == 0.0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def _correlated(profile: Profile, ratios: list[float] | None) -> tuple[float | None, int]:
    """corr(Gini, `ratios`) over the compressing layers that have a Gini, and how many those are."""
    if ratios is None:
        return None, 0
    pairs = [(layer.gini, r) for layer, r in zip(profile.layers, ratios) if layer.compress and layer.gini is not None]
    return correlation([g for g, _ in pairs], [r for _, r in pairs]), len(pairs)


def gini_json(profile: Profile, papers: PrefixKV | None = None) -> dict[str, Any]:
    """The `--json` contract other tools read: keep these keys stable.

    Per layer: the shipped `ratio` and its `source` (`ratio_source`), the Gini, the spread of the
    ratio across calibration samples, the measured `loss` at the shipped ratio (`layer_loss`; null
    where the profile has none), the layer's `kind` (null where unrecorded), the `window` of a
    sliding layer kept as one, and `prefixkv_ratio`, PrefixKV's ratio at the profile's budget from
    its Lorenz curves (null where the profile stores no curves). Calibrations with images add
    `image_share` to every layer (null where kvtool leaves the layer alone): the mean share of the
    layer's kept prompt entries that are image tokens. At the top, `p` is the profile's own
    retention level, `prefixkv_p` PrefixKV's, and the correlations are over the compressing layers.
    """
    info = profile.calibration
    images = has_image_share(profile)
    theirs = papers.profile.ratios if papers is not None else None
    layers = []
    for i, layer in enumerate(profile.layers):
        entry = {"layer": i, "ratio": layer.ratio, "gini": layer.gini, "ratio_std": layer.ratio_std}
        if images:
            entry["image_share"] = layer.image_share
        entry["loss"] = layer_loss(profile, layer)
        entry["kind"] = layer_kind(profile, i)
        entry["source"] = ratio_source(profile, layer)
        entry["window"] = layer.window
        entry["prefixkv_ratio"] = None if theirs is None else theirs[i]
        layers.append(entry)
    return {
        "budget": profile.budget,
        "p": info.retention_p if info is not None else None,
        "truncation_distance": profile.method.truncation_distance,
        "budget_tokens": profile.budget_tokens,
        "ratios": profile.method.ratios,
        "scorer": profile.method.scorer,
        "prefixkv_p": papers.p if papers is not None else None,
        "corr_gini_ratio": _correlated(profile, profile.ratios)[0],
        "corr_gini_prefixkv": _correlated(profile, theirs)[0],
        "layers": layers,
    }


def _ratio_cell(layer) -> str:
    """A ratio, or `w=N` for a sliding layer kept as a window of N entries."""
    return f"w={layer.window}" if layer.window is not None else f"{layer.ratio:.3f}"


def gini_table(profile: Profile, title: str, papers: PrefixKV | None = None, *, shipped: bool = True) -> Table:
    """Per layer: kind, Gini, PrefixKV's ratio and, for a profile (`shipped`), its own ratio with
    where that came from and the measured loss; measured on a model, the spread across samples."""
    table = Table(title=title, title_justify="left")
    table.add_column("Layer", justify="right")
    table.add_column("Kind")
    table.add_column("Gini", justify="right")
    table.add_column("PrefixKV", justify="right")
    if shipped:
        table.add_column("Shipped", justify="right")
        table.add_column("Source")
        table.add_column("Loss", justify="right")
    else:
        table.add_column("Spread", justify="right")
    images = has_image_share(profile)
    if images:
        table.add_column("Image", justify="right", no_wrap=True)
    stored = shipped and is_quantized(profile)
    if stored:
        table.add_column("Stored")
    for index, layer in enumerate(profile.layers):
        theirs = _MISSING if papers is None else _ratio_cell(papers.profile.layers[index])
        cells = [
            str(index),
            layer_kind(profile, index) or _MISSING,
            _MISSING if layer.gini is None else f"{layer.gini:.3f}",
            Text(theirs, style="magenta"),
        ]
        if shipped:
            loss = layer_loss(profile, layer)
            cells += [
                Text(_ratio_cell(layer), style="cyan"),
                _source_label(profile, layer),
                _MISSING if loss is None else f"+{loss:.3f}",
            ]
        else:
            cells.append(_MISSING if layer.ratio_std is None else f"±{layer.ratio_std:.3f}")
        if images:
            cells.append(_MISSING if layer.image_share is None else f"{layer.image_share:.1%}")
        if stored:
            cells.append(storage_name(layer) if layer.compress else _MISSING)
        table.add_row(*cells, style=None if layer.compress else "dim")
    return table


def _caption(profile: Profile, papers: PrefixKV | None, *, shipped: bool = True) -> list[str]:
    """The lines under the table: the budget and both allocations, the correlations, the legends."""
    info = profile.calibration
    parts = [f"budget {profile.budget:g}"]
    if profile.budget_tokens is not None and any(layer.window is not None for layer in profile.layers):
        parts[0] += f" of the whole cache at {profile.budget_tokens} tokens"
    if papers is None:
        layer = missing_curve(profile)
        parts.append("PrefixKV: no ratios" + (f" (layer {layer} stores no priority curve)" if layer is not None else ""))
    else:
        level = f"retention p {papers.p:.4f}" if papers.p is not None else "every layer at the floor"
        parts.append(f"PrefixKV: {level}, from the attention-sum Lorenz curves at the budget")
    if shipped:
        parts.append(f"shipped: {_shipped_phrase(profile)}")
    parts.append(f"truncation distance {profile.method.truncation_distance}")
    if info is not None:
        parts.append(f"{info.samples} samples")
    lines = [" · ".join(parts)]

    ours, n = _correlated(profile, profile.ratios)
    theirs, _ = _correlated(profile, papers.profile.ratios if papers is not None else None)
    if n:
        corr = [] if not shipped else [f"corr(Gini, shipped ratio) {_fmt_corr(ours)}"]
        corr.append(f"corr(Gini, PrefixKV ratio) {_fmt_corr(theirs)}")
        lines.append(" · ".join(corr) + f" over the {n} compressing layers")

    notes = []
    windows = sorted({layer.window for layer in profile.layers if layer.window is not None})
    if windows:
        full = [layer.ratio for layer in profile.layers if layer.compress]
        share = f" (mean ratio {np.mean(full):.3f})" if full else ""
        size = str(windows[0]) if len(windows) == 1 else "N"
        notes.append(
            f"w={size}: a sliding layer kept as a window of {size} entries, in both; the full-attention "
            f"layers share what the windows leave of the budget{share}"
        )
    if has_image_share(profile):
        notes.append("Image = share of kept prompt entries that are image tokens (prompts with images)")
    if shipped and profile.loss_ratios:
        notes.append("Loss = measured rise of NLL per token were the layer alone to keep its shipped ratio")
    if notes:
        lines.append(" · ".join(notes))
    return lines


def _shipped_phrase(profile: Profile) -> str:
    """Where the profile's own ratios come from, in words."""
    method = profile.method
    if method.ratios == "measured":
        return "ratios from measured loss"
    if method.ratios == "uniform":
        return "the budget in every layer"
    info = profile.calibration
    level = f" (retention p {info.retention_p:.4f})" if info is not None and info.retention_p is not None else ""
    curves = "attention-sum" if method.ratios == "attention-sum" else method.scorer
    return f"ratios from the {curves} Lorenz curves{level}"


def _fmt_corr(value: float | None) -> str:
    return _MISSING if value is None else f"{value:+.2f}"


@inspect_app.command("gini")
def inspect_gini(
    target: Annotated[str, typer.Argument(help="Profile YAML, or a model (alias, directory, .gguf) to measure now.")],
    data: Annotated[Path | None, typer.Option("--data", help="JSONL prompts when TARGET is a model.")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Prompts drawn when TARGET is a model.")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sample draw (model only).")] = 0,
    budget: Annotated[float, typer.Option("--budget", help="Kept fraction to solve for (model only).")] = 0.2,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", help="Prompt length limit (model only).")] = 1024,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write Lorenz curves and both ratios and the Gini per layer to this PNG.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the per-layer statistics as JSON.")] = False,
) -> None:
    """Per-layer Gini coefficient and PrefixKV's kept ratio beside the profile's own, from a profile or measured on a model."""
    if plot is not None:
        from kvtool.cli.gini_plot import require_matplotlib

        require_matplotlib()  # before any slow work
    shipped = is_profile_path(target)
    if shipped:
        profile = read_profile(target)
        title = f"Importance concentration per layer: {target}"
    else:
        profile = _measure(target, data, samples, seed, budget, max_prompt_tokens)
        title = f"Importance concentration per layer: {target} (measured now, D not tuned)"
    papers = prefixkv(profile, source=target)
    if plot is not None:
        from kvtool.cli.gini_plot import plot_profile

        plot_profile(profile, plot, papers.profile if papers is not None else None,
                     papers.p if papers is not None else None, shipped=shipped)
    if as_json:
        # Plain echo, not rich: the output must stay parseable JSON.
        typer.echo(json.dumps(gini_json(profile, papers)))
        return
    console = Console()
    console.print(gini_table(profile, title, papers, shipped=shipped))
    for line in _caption(profile, papers, shipped=shipped):
        console.print(Text(line, style="dim"), soft_wrap=True)
    if plot is not None:
        console.print(Text(f"plot written to {plot}"), soft_wrap=True)


def _measure(model: str, data: Path | None, samples: int, seed: int, budget: float, max_prompt_tokens: int) -> Profile:
    """Calibrate without writing and without the truncation search (the curves are what is shown)."""
    from kvtool.calibration.runner import calibrate
    from kvtool.cli.progress import StageBars

    with StageBars(Console(stderr=True)) as bars:
        result = calibrate(
            model,
            budget,
            data=data,
            samples=samples,
            seed=seed,
            max_prompt_tokens=max_prompt_tokens,
            candidates=(),
            progress=bars,
        )
    return result.profile
