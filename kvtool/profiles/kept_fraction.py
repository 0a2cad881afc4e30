"""What a budget is: the kept share of the KV cache's bytes, a number in (0, 1].

Every path that takes a budget from a user (the CLI, `attach`'s profiles, the budget mathematics)
checks it here, so a bad budget reads the same wherever it is caught.
"""

from __future__ import annotations

from kvtool.errors import KvtoolError


def check_budget(budget: object) -> float:
    """`budget` as a float in (0, 1]; a one-line KvtoolError otherwise (NaN and non-numbers too)."""
    try:
        value = float(budget)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = float("nan")
    if not (0.0 < value <= 1.0):  # NaN fails too
        raise KvtoolError(f"budget must be a kept fraction in (0, 1] (0.2 keeps 20% of the KV cache), got {budget!r}")
    return value
