"""Merge rules by name; a new rule is one new module registered here."""

from __future__ import annotations

from kvtool.errors import KvtoolError
from kvtool.runtime.merge.base import MergeRule
from kvtool.runtime.merge.none import NoMerge
from kvtool.runtime.merge.position import PositionMerge
from kvtool.runtime.merge.similarity_avg import SimilarityAvgMerge
from kvtool.runtime.merge.similarity_pivot import SimilarityPivotMerge
from kvtool.runtime.merge.similarity_weighted import SimilarityWeightedMerge

MERGE_RULES: dict[str, type[MergeRule]] = {
    rule.name: rule
    for rule in (PositionMerge, NoMerge, SimilarityAvgMerge, SimilarityPivotMerge, SimilarityWeightedMerge)
}


def merge_rule(name: str) -> MergeRule:
    try:
        return MERGE_RULES[name]()
    except KeyError:
        raise KvtoolError(f"unknown merge mode {name!r} (known: {', '.join(MERGE_RULES)})") from None


__all__ = ["MERGE_RULES", "MergeRule", "merge_rule"]
