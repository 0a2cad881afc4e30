"""`union`: the tokens the whole prompt leans on together with the ones the question asks for.

`attention-sum` (H2O's and PrefixKV's column sums) keeps what every row reads, which a long
continuation needs; the observation window (`window`, SnapKV) keeps what the last prompt rows read,
which an exact answer needs (a needle the rest of the prompt never looked at). Each loses what the
other keeps. The union ranks a token by the better of its two ranks: as a share of the real
columns, rank 1.0 is a row's top token under either score. The top k by that score are the union of
the two top lists, each as long as the union leaves room for (ties broken by position, the same in
a padded batch as alone). The window part is max-pooled as the window scorer pools it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.runtime.importance import PromptScores, ScoreRequest
from kvtool.runtime.scoring.window import WindowScorer


def rank_share(score: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
    """Each real column's rank among its row's real columns, as a share in (0, 1] (1 = top score);
    0 on padding. score: [B, n] or [B, H, n]; token_valid: [B, n]."""
    valid = token_valid if score.dim() == 2 else token_valid[:, None, :].expand_as(score)
    order = torch.sort(score.masked_fill(~valid, float("-inf")), dim=-1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))
    real = valid.sum(dim=-1, keepdim=True)
    # Padding sorts first, so a real column's rank among real columns is its rank minus the padding.
    share = (rank - (score.shape[-1] - real) + 1).to(score.dtype) / real.clamp(min=1).to(score.dtype)
    return torch.where(valid, share, torch.zeros_like(share))


@dataclass(frozen=True)
class UnionScorer(WindowScorer):
    name = "union"

    def request(self, per_head: bool) -> ScoreRequest:
        return ScoreRequest(heads=per_head, window=self.window)

    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor:
        asked = super().score(scores, token_valid, per_head)
        read = scores.heads if per_head else scores.importance
        return torch.maximum(rank_share(asked, token_valid), rank_share(read, token_valid))
