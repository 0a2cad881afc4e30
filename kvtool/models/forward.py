"""How a model's forward and `generate` take the KV cache: under `cache` or `past_key_values`.

transformers 5.24 renamed the argument to `cache`; `past_key_values` still works there with a
FutureWarning and goes away in 5.40 (forward) and 6.0 (`generate`). Earlier 5.x releases know only
`past_key_values`. kvtool passes its cache under the name the installed model's forward declares,
so every 5.x release runs it without warnings, and reads both names where a call may carry either.
"""

from __future__ import annotations

import inspect
from typing import Any

CACHE_NAMES = ("cache", "past_key_values")


def cache_keyword(model: Any) -> str:
    """`cache` when `model.forward` declares it (transformers >= 5.24), else `past_key_values`."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to `model`'s forward or `generate`."""
    return {cache_keyword(model): cache}


def passed_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a forward call was given, under either name (None without one)."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None
