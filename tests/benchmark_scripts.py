"""The benchmark scripts as modules, for the tests that check them (they are files, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, as_name: str | None = None) -> ModuleType:
    """A fresh module of `benchmarks/{name}.py`, under `as_name` (default: `name`). It is in
    `sys.modules` only while it runs: dataclasses look their module up there as they are built."""
    module_name = as_name or name
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[module_name]
    return module
