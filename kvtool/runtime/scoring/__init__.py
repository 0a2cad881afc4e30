"""Scorers by name (what a prompt token is worth to a layer); a new scorer is one new module registered here."""

from __future__ import annotations

from kvtool.errors import KvtoolError
from kvtool.runtime.scoring.attention_sum import AttentionSum
from kvtool.runtime.scoring.base import Scorer
from kvtool.runtime.scoring.union import UnionScorer
from kvtool.runtime.scoring.window import WindowScorer, pool_before_window

SCORERS: dict[str, type[Scorer]] = {rule.name: rule for rule in (AttentionSum, WindowScorer, UnionScorer)}


def make_scorer(name: str, *, window: int, pool: int, window_share: float = 0.5) -> Scorer:
    """The scorer `name`; `window` and `pool` configure the scorers that read the observation
    window (`window`, `union`) and are ignored by the others, `window_share` the union's lists."""
    try:
        rule = SCORERS[name]
    except KeyError:
        raise KvtoolError(f"unknown scorer {name!r} (known: {', '.join(SCORERS)})") from None
    if issubclass(rule, UnionScorer):
        return rule(window=window, pool=pool, window_share=window_share)
    return rule(window=window, pool=pool) if issubclass(rule, WindowScorer) else rule()


__all__ = ["SCORERS", "AttentionSum", "Scorer", "UnionScorer", "WindowScorer", "make_scorer", "pool_before_window"]
