"""`heavy-hitter`: H2O's prompt split: half of each sequence's share is the recent window, the other
half the tokens with the most accumulated attention (no sink tokens: they win on score if they matter)."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.selection.base import Selection, SelectRule, select_tokens


class HeavyHitter(SelectRule):
    name = "heavy-hitter"

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
        return select_tokens(importance, token_valid, keep, sink_tokens=0, recent_window=np.asarray(keep) // 2)
