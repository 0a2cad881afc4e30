"""`importance`: Elastic Cache / PrefixKV anchors: sinks, the recent window, then the true top-k by
attention received."""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.selection.base import Selection, SelectRule, select_tokens


class TopImportance(SelectRule):
    name = "importance"

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
        return select_tokens(importance, token_valid, keep, sink_tokens=sink_tokens, recent_window=recent_window)
