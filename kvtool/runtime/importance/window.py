"""`window`: SnapKV's observation window; with `window = 1`, TOVA's prefill score.

A token scores the attention the last `window` real prompt rows (the question, in a chat prompt)
give it, so what the answer needs ranks above what the whole prompt looked at. Optionally
max-pooled over `pool` neighbouring positions (odd; 1 = none), as SnapKV does, so a kept token
brings its neighbours along. Pooling runs over the real columns before the window: the window's
own tokens are always kept (selection protects max(recent_window, window) recent tokens), and
their large self-attention would otherwise spill onto the tokens just before the window. Shared
layers pool the head-averaged score, per-head layers each head's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.errors import KvtoolError
from kvtool.runtime.importance.logits import cap_, sink_view, softmax_
from kvtool.runtime.importance.base import Scorer
from kvtool.runtime.importance.scores import PromptScores, ScoreRequest


def pool_before_window(score: torch.Tensor, token_valid: torch.Tensor, window: int, pool: int) -> torch.Tensor:
    """Max over `pool` neighbouring real columns, for every real column before the last `window`.

    score: [B, n] or [B, H, n]; token_valid: [B, n]. Other columns keep their score.
    """
    if pool == 1:
        return score
    real_rank = torch.cumsum(token_valid.long(), dim=1) - 1
    n_real = token_valid.sum(dim=1, keepdim=True)
    poolable = token_valid & (real_rank < n_real - window)
    if score.dim() == 3:
        poolable = poolable[:, None, :]
    spread = score.masked_fill(~poolable, float("-inf"))
    n = score.shape[-1]
    pooled = F.max_pool1d(spread.reshape(-1, 1, n), pool, stride=1, padding=pool // 2).view_as(score)
    return torch.where(poolable, pooled, score)


@dataclass(frozen=True)
class WindowScorer(Scorer):
    window: int = 32
    pool: int = 7
    name = "window"

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise KvtoolError(f"the observation window must be a whole number of prompt rows >= 1, got {self.window!r}")
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 1 or self.pool % 2 == 0:
            raise KvtoolError(f"the pooling kernel must be an odd whole number >= 1 (1 = no pooling), got {self.pool!r}")

    def request(self, per_head: bool) -> ScoreRequest:
        return ScoreRequest(window=self.window)

    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor:
        received = scores.window if per_head else scores.window.mean(dim=1)
        return pool_before_window(received, token_valid, self.window, self.pool)

    def protected_recent(self, recent_window: int) -> int:
        return max(recent_window, self.window)


def window_sums(
    rows: torch.Tensor, keys: torch.Tensor, token_valid: torch.Tensor, scaling: float, window: int, span: int | None = None,
) -> torch.Tensor:
    """The observation-window scores (`PromptScores.window`) of the last `window` prompt rows,
    brute force from those rows' queries: what a prompt pass asked for `window` would give.

    rows: [B, Hq, R, D], the queries (after rotary) of the prompt's last R >= `window` positions of a
    left-padded causal prompt; keys: [B, Hkv, n, D]; token_valid: [B, n]. Returns [B, Hkv, n], each
    KV head the mean over its query heads of the probabilities the last `window` rows give every
    column; padded columns 0. Calibration records R rows once and serves every window up to R.
    `span`: a sliding-window layer's window W (transformers' mask: a row sees itself and the W - 1
    columns before it); None: causal only.
    """
    if not 1 <= window <= rows.shape[2]:
        raise KvtoolError(f"internal: {rows.shape[2]} recorded rows cannot serve an observation window of {window}")
    batch, heads, _, _ = rows.shape
    n, kv_heads = keys.shape[2], keys.shape[1]
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    query = rows[:, :, -window:].to(dtype)
    key = keys.to(dtype).repeat_interleave(heads // kv_heads, dim=1)
    logits = cap_(torch.matmul(query, key.transpose(-1, -2)) * scaling, scaling)  # [B, Hq, w, n]
    position = torch.arange(n, device=keys.device)
    row_position = torch.arange(n - window, n, device=keys.device)
    seen = position[None, :] <= row_position[:, None]
    if span is not None:
        seen &= position[None, :] > row_position[:, None] - span
    allowed = seen[None, None] & token_valid.bool()[:, None, None, :]
    sink = sink_view(scaling, (1, heads, 1, 1), dtype, keys.device)  # a sink layer's (logits.py)
    probs = softmax_(logits.masked_fill(~allowed, float("-inf")), sink).nan_to_num(0.0)
    summed = probs.sum(dim=2)  # [B, Hq, n]
    return summed.view(batch, kv_heads, heads // kv_heads, n).mean(dim=2)
