"""`text-prior`: LOOK-M's text-prior eviction for vision-language prompts.

Per sequence, every text token's importance gets the sequence's maximum importance added
(LOOK-M eq. 5, `T_p = max(A_s)`), so text ranks above every image token; then the usual anchors are
chosen from that score: the sink tokens, the recent window (the profile's `recent_window`, LOOK-M's
`M`), and the true top-k of the rest (LOOK-M's `N`). Ranking is all the prior does: each sequence
keeps exactly `keep[b]` entries, so when the text alone exceeds the share, only the best-scoring
text stays (the LOOK-M reference code keeps every text token even past the budget; kvtool does not).

Importance is strictly positive for every real prompt token (each one attends at least to itself),
so a boosted text score is strictly above every image score in practice.

Sequences without image tokens (and text-only prompts, `image_mask=None`) get no boost: there the
rule is exactly the `importance` rule, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtool.runtime.selection.base import Selection, SelectRule, select_tokens


def text_prior_score(importance: torch.Tensor, token_valid: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
    """Importance with the row's maximum added to its text tokens, in rows that hold an image token."""
    if image_mask is None:
        return importance
    image = image_mask & token_valid
    has_image = image.any(dim=1, keepdim=True)
    if not bool(has_image.any()):
        return importance
    top = importance.masked_fill(~token_valid, float("-inf")).amax(dim=1, keepdim=True).clamp(min=0)
    text = token_valid & ~image & has_image
    return torch.where(text, importance + top, importance)


class TextPrior(SelectRule):
    name = "text-prior"

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
        # Importance is a column sum over at most n rows (<= n), so the boosted score stays <= 2n,
        # below the classes select_tokens protects (recent window and sinks rank above 2n + 2).
        score = text_prior_score(importance, token_valid, image_mask)
        return select_tokens(score, token_valid, keep, sink_tokens=sink_tokens, recent_window=recent_window)
