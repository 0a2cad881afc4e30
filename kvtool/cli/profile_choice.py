"""`--budget` / `--profile` to the profile a command runs with, the same way in every command."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from kvtool.cli.progress import StageBars
from kvtool.errors import KvtoolError
from kvtool.profiles.kept_fraction import check_budget

if TYPE_CHECKING:  # heavy imports stay out of `kvtool --help`
    from kvtool.profiles import Profile


# `--kv-format`'s help, the same in every command that takes it.
KV_FORMAT_HELP = (
    "How kept entries are stored in every compressed layer: native, int8, fp8, int4, int4-g32, int2-g32, or "
    "KEYS/VALUES (int8/int4-g32). Default: as the profile was calibrated. The budget stays a share of the "
    "native cache's bytes, so a lower precision keeps more entries."
)


# The model argument and the profile options of the commands that run a cache (generate, serve), the same in each.
ModelArgument = Annotated[
    str, typer.Argument(help="Alias (smollm2, gemma3-270m), HF model directory, .gguf file, or cached hub id.")
]
BudgetOption = Annotated[
    float | None,
    typer.Option(help="Kept share of the KV cache's bytes in (0, 1]: the calibrated profile for the model (built-in, else calibrated now)."),
]
ProfileOption = Annotated[
    Path | None, typer.Option(help="Profile YAML from `kvtool calibrate` (with --budget: re-derived for it).")
]
KvFormatOption = Annotated[str | None, typer.Option("--kv-format", help=KV_FORMAT_HELP)]
MinKeptOption = Annotated[
    int,
    typer.Option(
        "--min-kept", min=0,
        help="Entries every compressing layer keeps at least (all of a shorter prompt): short prompts at a "
        "small budget leave some layers a handful of entries. 0 (default): the budget alone.",
    ),
]


def check_choice(budget: float | None, profile_path: Path | None, kv_format: str | None = None) -> None:
    """The cheap checks, before any model is loaded."""
    if budget is not None:
        check_budget(budget)
    if profile_path is not None and not profile_path.is_file():
        raise KvtoolError(f"profile file not found: {profile_path}")
    if kv_format is not None:
        from kvtool.runtime.precision import KVStorage

        if KVStorage.parse(kv_format).quantized and budget is None and profile_path is None:
            raise KvtoolError("--kv-format needs --budget or --profile (the full cache keeps the model's own precision)")


def choose_cache_profile(
    loaded: Any, budget: float | None, profile_path: Path | None, kv_format: str | None = None
) -> tuple[Profile, str] | None:
    """The profile and a line saying where it came from; None = the plain full cache.

    `--profile` alone runs that profile as calibrated; with a budget (and for `--budget` alone)
    `kvtool.calibration.choose` decides, as it does for `kvtool eval`: the same budget means the same
    cache in every command. Without `kv_format` each layer stores what its profile says; with one,
    every compressed layer stores that format at the same bytes (a lower precision keeps more
    entries): the profile comes from the calibrated one nearest that share of entries
    (`precision.at_storage`).
    """
    # Imported here so `kvtool --help` does not pay for torch/transformers.
    from kvtool.calibration.choose import choose_profile
    from kvtool.runtime import load_profile
    from kvtool.runtime.precision import KVStorage, at_storage, entries_for

    check_choice(budget, profile_path, kv_format)
    storage = None if kv_format is None else KVStorage.parse(kv_format)
    if budget is None and profile_path is None:
        return None
    if budget is None:
        profile = load_profile(profile_path)
        stored = at_storage(profile, storage, loaded.model, source=str(profile_path))
        return stored, f"profile {profile_path} (budget {profile.budget:g}{_stored_as(storage)})"
    err = Console(stderr=True)
    with StageBars(err) as bars:
        chosen = choose_profile(
            loaded, entries_for(budget, storage, loaded.model), profile_path=profile_path, progress=bars,
            notify=lambda line: err.print(f"[yellow]{line}[/]", soft_wrap=True),
        )
    if storage is None:
        return chosen.profile, chosen.source
    return at_storage(chosen.profile, storage, loaded.model, budget=budget), chosen.source + _stored_as(storage)


def _stored_as(storage: Any) -> str:
    return f"; entries stored as {storage.name}" if storage is not None else ""
