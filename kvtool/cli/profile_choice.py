"""`--budget` / `--profile` to the profile a command runs with, the same way in every command."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from kvtool.cli.calibrate import StageBars
from kvtool.errors import KvtoolError

if TYPE_CHECKING:  # heavy imports stay out of `kvtool --help`
    from kvtool.profiles import Profile


def check_choice(budget: float | None, profile_path: Path | None) -> None:
    """The cheap checks, before any model is loaded."""
    if budget is not None and not 0.0 < budget <= 1.0:
        raise KvtoolError(f"--budget must be a kept fraction in (0, 1], got {budget:g}")
    if profile_path is not None and not profile_path.is_file():
        raise KvtoolError(f"profile file not found: {profile_path}")


def choose_cache_profile(loaded: Any, budget: float | None, profile_path: Path | None) -> tuple[Profile, str] | None:
    """The profile and a line saying where it came from; None = the plain full cache.

    `--profile` alone runs that profile as calibrated; with a budget (and for `--budget` alone)
    `kvtool.calibrate.choose` decides, as it does for `kvtool eval`: the same budget means the same
    cache in every command.
    """
    # Imported here so `kvtool --help` does not pay for torch/transformers.
    from kvtool.calibrate.choose import choose_profile
    from kvtool.runtime import load_profile

    check_choice(budget, profile_path)
    if budget is None and profile_path is None:
        return None
    if budget is None:
        profile = load_profile(profile_path)
        return profile, f"profile {profile_path} (budget {profile.budget:g})"
    err = Console(stderr=True)
    with StageBars(err) as bars:
        chosen = choose_profile(
            loaded, budget, profile_path=profile_path, progress=bars,
            notify=lambda line: err.print(f"[yellow]{line}[/]", soft_wrap=True),
        )
    return chosen.profile, chosen.source
