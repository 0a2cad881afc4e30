"""The selection-rule interface: which prompt tokens a layer keeps, and the shared top-k machinery."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch


def kept_count(ratio: float, n_tokens: np.ndarray, floor: int = 0) -> np.ndarray:
    """ceil(ratio * n) per sequence, at least `floor` (and 1) and at most n (0 for an empty sequence).

    The epsilon keeps float noise (0.2 * 10 = 2.0000000000000004) from adding an entry.
    """
    n = np.asarray(n_tokens, dtype=np.int64)
    k = np.maximum(np.ceil(ratio * n - 1e-9).astype(np.int64), floor)
    return np.clip(k, np.minimum(n, 1), n)


@dataclass(frozen=True)
class Selection:
    """Kept token indices per sequence, sorted by position; `valid` is False on padding slots."""

    index: torch.Tensor  # [B, K] long, prompt column of each kept token
    valid: torch.Tensor  # [B, K] bool


def select_tokens(
    importance: torch.Tensor,
    token_valid: torch.Tensor,
    keep: np.ndarray,
    *,
    sink_tokens: int,
    recent_window: int | np.ndarray,
) -> Selection:
    """Top-`keep[b]` tokens of each sequence, sinks and the recent window protected (inside the count).

    When `keep` is smaller than the protected set, sinks win over the recent window.
    `recent_window` may differ per sequence (an array of B counts).
    """
    bsz, n = importance.shape
    device = importance.device
    real_rank = torch.cumsum(token_valid.long(), dim=1) - 1
    n_real = token_valid.sum(dim=1, keepdim=True)
    is_sink = token_valid & (real_rank < sink_tokens)
    if isinstance(recent_window, np.ndarray):
        recent_window = torch.as_tensor(recent_window, device=device)[:, None]
    is_recent = token_valid & (real_rank >= n_real - recent_window)
    # Importance is at most n (a column sum of probabilities over n rows), so protected classes sit
    # above it; within the recent window later tokens win, within the sinks earlier ones, so ties
    # never depend on padding or kernel order.
    rank = real_rank.to(importance.dtype)
    score = importance.masked_fill(~token_valid, float("-inf"))
    score = torch.where(is_recent, 2 * n + 2 + rank, score)
    score = torch.where(is_sink, 4 * n + 4 + (n - rank), score)
    width = max(1, int(keep.max())) if keep.size else 1
    # A stable sort, not topk: exact ties (max-pooled scores repeat a neighbour's value) go to the
    # earlier position, so padding, which shifts every position alike, never changes the choice.
    chosen = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :width]
    keep_t = torch.as_tensor(keep, device=device).unsqueeze(1)
    chosen_valid = torch.arange(width, device=device).unsqueeze(0) < keep_t
    # Sort by position; unused slots go last.
    order_key = torch.where(chosen_valid, chosen, chosen.new_full((), n))
    order = torch.argsort(order_key, dim=1, stable=True)
    return Selection(index=chosen.gather(1, order), valid=chosen_valid.gather(1, order))


class SelectRule(ABC):
    """Chooses the `keep[b]` prompt entries each sequence keeps in one layer.

    importance: [B, n] attention received (None when the rule does not need it); token_valid: [B, n].
    image_mask: [B, n] True at image-token positions of vision-language prompts (never on padding),
    None for text-only prompts; rules that do not care about modality ignore it.
    Returns the kept prompt columns sorted by position. Protected tokens count inside `keep`.
    """

    name: ClassVar[str]
    needs_importance: ClassVar[bool] = True

    @abstractmethod
    def select(
        self,
        importance: torch.Tensor | None,
        token_valid: torch.Tensor,
        keep: np.ndarray,
        *,
        sink_tokens: int,
        recent_window: int,
        image_mask: torch.Tensor | None = None,
    ) -> Selection: ...
