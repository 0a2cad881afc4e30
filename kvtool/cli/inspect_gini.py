"""`kvtool inspect gini PROFILE|MODEL`: how concentrated each layer's attention importance is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtool.cli.app import inspect_app
from kvtool.cli.inspect_cmd import ratio_bar
from kvtool.profiles import Profile, read_profile
from kvtool.profiles.loss_budget import interpolate

_PROFILE_SUFFIXES = (".yaml", ".yml")
_MISSING = "—"
_IMAGE_BAR_WIDTH = 12


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


def gini_json(profile: Profile) -> dict[str, Any]:
    """The `--json` contract other tools read: keep these keys stable.

    Calibrations with images add `image_share` to every layer (null where kvtool leaves the layer
    alone): the mean share of the layer's kept prompt entries that are image tokens. Profiles whose
    ratios come from measured loss add `loss` (`layer_loss`).
    """
    info = profile.calibration
    images = has_image_share(profile)
    layers = []
    for i, layer in enumerate(profile.layers):
        entry = {"layer": i, "ratio": layer.ratio, "gini": layer.gini, "ratio_std": layer.ratio_std}
        if images:
            entry["image_share"] = layer.image_share
        if profile.loss_ratios:
            entry["loss"] = layer_loss(profile, layer)
        layers.append(entry)
    return {
        "budget": profile.budget,
        "p": info.retention_p if info is not None else None,
        "truncation_distance": profile.method.truncation_distance,
        "layers": layers,
    }


def gini_table(profile: Profile, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("Layer", justify="right")
    table.add_column("Gini", justify="right")
    table.add_column("", no_wrap=True)
    table.add_column("Kept", justify="right")
    table.add_column("", no_wrap=True)
    table.add_column("Spread", justify="right")
    images = has_image_share(profile)
    # With the image or loss column the bars are shorter (shorter still with both), so the table
    # still fits 80 columns.
    extra = int(images) + int(bool(profile.loss_ratios))
    bar = () if not extra else (_IMAGE_BAR_WIDTH if extra == 1 else _IMAGE_BAR_WIDTH - 3,)
    if images:
        table.add_column("Image", justify="right", no_wrap=True)
    if profile.loss_ratios:
        table.add_column("Loss", justify="right")
    for index, layer in enumerate(profile.layers):
        gini = _MISSING if layer.gini is None else f"{layer.gini:.3f}"
        gini_bar = "" if layer.gini is None else ratio_bar(layer.gini, *bar)
        spread = _MISSING if layer.ratio_std is None else f"±{layer.ratio_std:.3f}"
        cells = [
            str(index),
            gini,
            Text(gini_bar, style="magenta"),
            f"{layer.ratio:.3f}",
            Text(ratio_bar(layer.ratio, *bar), style="cyan"),
            spread,
        ]
        if images:
            cells.append(_MISSING if layer.image_share is None else f"{layer.image_share:.1%}")
        if profile.loss_ratios:
            loss = layer_loss(profile, layer)
            cells.append(_MISSING if loss is None else f"+{loss:.3f}")
        table.add_row(*cells, style=None if layer.compress else "dim")
    return table


def _caption(profile: Profile) -> str:
    info = profile.calibration
    parts = [f"budget {profile.budget:g}"]
    if info is not None and info.retention_p is not None:
        parts.append(f"retention p {info.retention_p:.4f}")
    parts.append(f"truncation distance {profile.method.truncation_distance}")
    if info is not None:
        parts.append(f"{info.samples} samples")
    if has_image_share(profile):
        parts.append("Image = share of kept prompt entries that are image tokens (prompts with images)")
    if profile.loss_ratios:
        parts.append("Loss = measured rise of NLL per token were the layer alone to keep its ratio")
    return " · ".join(parts)


@inspect_app.command("gini")
def inspect_gini(
    target: Annotated[str, typer.Argument(help="Profile YAML, or a model (alias, directory, .gguf) to measure now.")],
    data: Annotated[Path | None, typer.Option("--data", help="JSONL prompts when TARGET is a model.")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Prompts drawn when TARGET is a model.")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sample draw (model only).")] = 0,
    budget: Annotated[float, typer.Option("--budget", help="Kept fraction to solve for (model only).")] = 0.2,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", help="Prompt length limit (model only).")] = 1024,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write Lorenz curves and ratio/Gini per layer to this PNG.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the per-layer statistics as JSON.")] = False,
) -> None:
    """Per-layer Gini coefficient, kept ratio and spread, from a profile or measured on a model."""
    if plot is not None:
        from kvtool.cli.gini_plot import require_matplotlib

        require_matplotlib()  # before any slow work
    if is_profile_path(target):
        profile = read_profile(target)
        title = f"Importance concentration per layer: {target}"
    else:
        profile = _measure(target, data, samples, seed, budget, max_prompt_tokens)
        title = f"Importance concentration per layer: {target} (measured now, D not tuned)"
    if plot is not None:
        from kvtool.cli.gini_plot import plot_profile

        plot_profile(profile, plot)
    if as_json:
        # Plain echo, not rich: the output must stay parseable JSON.
        typer.echo(json.dumps(gini_json(profile)))
        return
    console = Console()
    console.print(gini_table(profile, title))
    console.print(Text(_caption(profile), style="dim"), soft_wrap=True)
    if plot is not None:
        console.print(Text(f"plot written to {plot}"), soft_wrap=True)


def _measure(model: str, data: Path | None, samples: int, seed: int, budget: float, max_prompt_tokens: int) -> Profile:
    """Calibrate without writing and without the truncation search (the curves are what is shown)."""
    from kvtool.cli.calibrate import StageBars
    from kvtool.cli.openmp import choose_openmp_wait

    choose_openmp_wait()
    from kvtool.calibrate.runner import calibrate

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
