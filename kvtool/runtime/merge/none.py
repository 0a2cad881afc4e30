"""`none`: pure eviction (PrefixKV's setting): tokens that are not kept are dropped."""

from __future__ import annotations

import torch

from kvtool.runtime.merge.base import MergeRule, gather_tokens
from kvtool.runtime.selection import Selection


class NoMerge(MergeRule):
    name = "none"

    def merge(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        selection: Selection,
        token_valid: torch.Tensor,
        importance: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_tokens(keys, selection.index), gather_tokens(values, selection.index)
