"""Eviction rules by name (which entry goes when generation pushes a layer over its share).

A new rule is one new module in this package (an `EvictRule` subclass: see base.py) and one line in
`EVICT_RULES` below; nothing else lists the rules. A profile's `eviction` names one of them (the
runtime checks it on load, `attach.check_rule_names`), and calibration's recipe search tries every
rule that holds the budget unless the rule opts out (`EvictRule.searched`).
"""

from __future__ import annotations

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction.base import EntryView, EvictRule, oldest_unfrozen, queue_view
from kvtool.runtime.eviction.expected_attention import ExpectedAttentionEvict
from kvtool.runtime.eviction.fixed_point import FixedPoint, frozen_prefix
from kvtool.runtime.eviction.heavy_hitter import HeavyHitter
from kvtool.runtime.eviction.heavy_hitter_window import HeavyHitterWindow
from kvtool.runtime.eviction.prompt_only import PromptOnly
from kvtool.runtime.eviction.sliding import Sliding
from kvtool.runtime.eviction.tova import Tova
from kvtool.runtime.eviction.triattention import TriAttentionEvict

EVICT_RULES: dict[str, type[EvictRule]] = {
    rule.name: rule for rule in (
        FixedPoint, Sliding, HeavyHitter, HeavyHitterWindow, Tova, ExpectedAttentionEvict, TriAttentionEvict, PromptOnly,
    )
}


def evict_rule(name: str) -> EvictRule:
    try:
        return EVICT_RULES[name]()
    except KeyError:
        raise KvtoolError(f"unknown eviction rule {name!r} (known: {', '.join(EVICT_RULES)})") from None


__all__ = [
    "EVICT_RULES", "EntryView", "EvictRule", "FixedPoint", "PromptOnly", "Tova", "evict_rule", "frozen_prefix", "oldest_unfrozen",
    "queue_view",
]
