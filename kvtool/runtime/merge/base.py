"""The merge-rule interface: how the prompt tokens a layer does not keep are folded into those it keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvtool.runtime.selection import Selection


class MergeRule(ABC):
    """Turns a layer's full prompt KV and a selection into the compressed KV, one entry per kept token.

    keys/values: [B, Hkv, n, D]; token_valid: [B, n]; importance: [B, n].
    Returns keys/values [B, Hkv, K, D] aligned with `selection.index` (slots with
    `selection.valid == False` hold anything: they are masked).
    """

    name: ClassVar[str]

    @abstractmethod
    def merge(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        selection: Selection,
        token_valid: torch.Tensor,
        importance: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def gather_tokens(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """states [B, H, n, D], index [B, K] -> [B, H, K, D]."""
    bsz, heads, _, dim = states.shape
    return states.gather(2, index[:, None, :, None].expand(bsz, heads, index.shape[1], dim))
