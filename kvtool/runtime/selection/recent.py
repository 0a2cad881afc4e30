"""`recent`: StreamingLLM's "local" cache: the sink tokens plus the most recent ones, no scoring."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.selection.base import Selection, SelectRule, select_tokens


class Recent(SelectRule):
    name = "recent"
    needs_importance = False

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
        # Rank by position: the top-k of "how late" is the most recent window of any size.
        lateness = (torch.cumsum(token_valid.long(), dim=1) - 1).to(torch.float32)
        return select_tokens(lateness, token_valid, keep, sink_tokens=sink_tokens, recent_window=0)
