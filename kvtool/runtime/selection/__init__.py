"""Selection rules by name (which prompt tokens a layer keeps); a new rule is one new module registered here."""

from __future__ import annotations

from kvtool.errors import KvtoolError
from kvtool.runtime.selection.base import Selection, SelectRule, kept_count, select_tokens
from kvtool.runtime.selection.heavy_hitter import HeavyHitter
from kvtool.runtime.selection.recent import Recent
from kvtool.runtime.selection.text_prior import TextPrior
from kvtool.runtime.selection.top_importance import TopImportance

SELECT_RULES: dict[str, type[SelectRule]] = {rule.name: rule for rule in (TopImportance, Recent, HeavyHitter, TextPrior)}


def select_rule(name: str) -> SelectRule:
    try:
        return SELECT_RULES[name]()
    except KeyError:
        raise KvtoolError(f"unknown selection rule {name!r} (known: {', '.join(SELECT_RULES)})") from None


__all__ = ["TopImportance", "SELECT_RULES", "SelectRule", "Selection", "kept_count", "select_rule", "select_tokens"]
