"""kvtool: calibrate per-layer KV-cache budgets offline, apply them at generation time.

The public API, importable from here::

    from kvtool import attach, builtin_profile, load_model, load_profile, uniform_profile

    loaded = load_model("smollm2")
    profile = load_profile(builtin_profile("smollm2", 0.2))
    with attach(loaded.model, profile) as handle:
        out = handle.generate(**inputs, max_new_tokens=64)

Names resolve on first use, so `import kvtool` stays cheap (no torch) until one is needed. This
module is the package's face: kvtool's own modules never import from it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtool.version import __version__

# Public name -> the module that owns it.
_OWNERS = {
    "attach": "kvtool.runtime",
    "load_profile": "kvtool.runtime",
    "uniform_profile": "kvtool.runtime",
    "method_profile": "kvtool.runtime",
    "KvtoolHandle": "kvtool.runtime",
    "KvtoolCache": "kvtool.runtime",
    "KVStorage": "kvtool.runtime.precision",
    "at_storage": "kvtool.runtime.precision",
    "builtin_profile": "kvtool.profiles.builtin",
    "Profile": "kvtool.profiles",
    "read_profile": "kvtool.profiles",
    "save_profile": "kvtool.profiles",
    "load_model": "kvtool.models",
    "LoadedModel": "kvtool.models",
    "use_offline_defaults": "kvtool.models",
    "calibrate": "kvtool.calibration.runner",
    "CalibrateConfig": "kvtool.calibration.config",
    "evaluate": "kvtool.evaluation",
    "EvalConfig": "kvtool.evaluation",
    "run_bench": "kvtool.bench",
    "BenchConfig": "kvtool.bench",
    "KvtoolError": "kvtool.errors",
}

__all__ = ["__version__", *_OWNERS]

if TYPE_CHECKING:
    from kvtool.bench import BenchConfig, run_bench
    from kvtool.calibration.config import CalibrateConfig
    from kvtool.calibration.runner import calibrate
    from kvtool.errors import KvtoolError
    from kvtool.evaluation import EvalConfig, evaluate
    from kvtool.models import LoadedModel, load_model, use_offline_defaults
    from kvtool.profiles import Profile, read_profile, save_profile
    from kvtool.profiles.builtin import builtin_profile
    from kvtool.runtime import KvtoolCache, KvtoolHandle, attach, load_profile, method_profile, uniform_profile
    from kvtool.runtime.precision import KVStorage, at_storage


def __getattr__(name: str) -> Any:
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
    value = getattr(importlib.import_module(owner), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
