"""The scorer interface: what a prompt token is worth to a layer, from the fused prompt pass."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvtool.runtime.importance.scores import PromptScores, ScoreRequest


class Scorer(ABC):
    """Turns the prompt pass's scores into the score selection ranks by.

    Shared layers get [B, n] (averaged over all query heads), per-head layers [B, Hkv, n] (averaged
    over each KV head's query heads). Both stay at most n (a probability summed over at most n rows),
    which selection's protected classes rely on. Padded columns score 0.
    """

    name: ClassVar[str]

    @abstractmethod
    def request(self, per_head: bool) -> ScoreRequest:
        """What the prompt pass must compute beside the layer-averaged column sums."""

    @abstractmethod
    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor: ...

    def protected_recent(self, recent_window: int) -> int:
        """The recent window selection protects (inside the budget)."""
        return recent_window
