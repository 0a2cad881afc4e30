"""Calibrated profiles that ship inside the package (kvtool/profiles/builtin/<model>-b<budget>.yaml)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def builtin_dir() -> Path:
    return Path(str(files("kvtool.profiles").joinpath("builtin")))


def builtin_name(model_name: str, budget: float) -> str:
    return f"{model_name}-b{budget:g}.yaml"


def builtin_profile(model_name: str, budget: float) -> Path | None:
    """The shipped profile for this model alias and budget, if there is one."""
    path = builtin_dir() / builtin_name(model_name, budget)
    return path if path.is_file() else None


def builtin_profiles(model_name: str) -> list[Path]:
    """Every shipped profile for this model alias (any budget), sorted by file name."""
    prefix = f"{model_name}-b"
    return sorted(p for p in builtin_dir().iterdir() if p.name.startswith(prefix) and p.suffix == ".yaml")
