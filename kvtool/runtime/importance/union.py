"""`union`: the tokens the whole prompt leans on together with the ones the question asks for.

`attention-sum` (H2O's and PrefixKV's column sums) keeps what every row reads, which a long
continuation needs; the observation window (`window`, SnapKV) keeps what the last prompt rows read,
which an exact answer needs (a needle the rest of the prompt never looked at). Each loses what the
other keeps. The union ranks a token by the better of its two ranks: as a share of the real
columns, rank 1.0 is a row's top token under either score. The top k by that score are the union of
the two top lists, each as long as the union leaves room for (ties broken by position, the same in
a padded batch as alone). The window part is max-pooled as the window scorer pools it.

`window_share` sets how the two lists share the room: a token's distance from the top of each list
(0 = top) is divided by that list's share, and the smaller quotient ranks it, so with share f about
f of the kept tokens come from the window's list and 1 - f from the column sums' (0.5: the better
rank, the two lists equally long). The needles of a retrieval prompt want more of the window's
list, a long continuation more of the sums'; calibration searches it when `SearchSpace.window_shares`
lists several (its default keeps 0.5: recipes.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.importance.scores import PromptScores, ScoreRequest
from kvtool.runtime.importance.window import WindowScorer


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


def distance_from_top(score: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
    """How many real columns of its row rank above each real column (0 = top score; ties by
    position, as `rank_share`), as float64; 0 on padding."""
    share = rank_share(score.double(), token_valid)
    valid = token_valid if score.dim() == 2 else token_valid[:, None, :].expand_as(score)
    real = valid.sum(dim=-1, keepdim=True).double()
    # share = (real - distance) / real exactly enough to round back to the integer distance.
    return torch.where(valid, torch.round(real - share * real), torch.zeros_like(share))


@dataclass(frozen=True)
class UnionScorer(WindowScorer):
    window_share: float = 0.5
    name = "union"

    def __post_init__(self) -> None:
        super().__post_init__()
        share = self.window_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share < 1.0:
            raise KvtoolError(f"the union's window share must be a fraction strictly between 0 and 1, got {share!r}")

    def request(self, per_head: bool) -> ScoreRequest:
        return ScoreRequest(heads=per_head, window=self.window)

    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor:
        asked = super().score(scores, token_valid, per_head)
        read = scores.heads if per_head else scores.importance
        if self.window_share == 0.5:
            return torch.maximum(rank_share(asked, token_valid), rank_share(read, token_valid))
        # Each list's distance from its top over its share: the smaller quotient ranks the token.
        # Integer distances divided by one float each keep exact ties exact (a padded batch ranks as
        # its rows alone); 1 / (1 + cost) turns the cost into a score in (0, 1], 0 on padding.
        cost = torch.minimum(
            distance_from_top(asked, token_valid) / self.window_share,
            distance_from_top(read, token_valid) / (1.0 - self.window_share),
        )
        valid = token_valid if asked.dim() == 2 else token_valid[:, None, :].expand_as(asked)
        return torch.where(valid, 1.0 / (1.0 + cost), torch.zeros_like(cost)).to(asked.dtype)
