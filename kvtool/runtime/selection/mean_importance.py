"""`importance-mean`: anchors by the mean attention a token receives from the rows that can see it.

Causal column sums favour early tokens (token i is summed over n - i rows); dividing by that count
removes the bias, so the end of the prompt (usually the question) competes on equal terms.
Sinks and the recent window are protected as in `importance`.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.selection.base import Selection, SelectRule, select_tokens


def mean_importance(importance: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
    """Column sums divided by the number of real query rows at or after each real column."""
    real_rank = torch.cumsum(token_valid.long(), dim=1) - 1
    n_real = token_valid.sum(dim=1, keepdim=True)
    seen_by = (n_real - real_rank).clamp(min=1).to(importance.dtype)
    return torch.where(token_valid, importance / seen_by, torch.zeros_like(importance))


class MeanImportance(SelectRule):
    name = "importance-mean"

    def select(
        self,
        importance: torch.Tensor | None,
        token_valid: torch.Tensor,
        keep: np.ndarray,
        *,
        sink_tokens: int,
        recent_window: int,
        image_mask: torch.Tensor | None = None,
    ) -> Selection:
        return select_tokens(
            mean_importance(importance, token_valid), token_valid, keep, sink_tokens=sink_tokens, recent_window=recent_window
        )
