"""`position`: Elastic Cache's importance-driven merging.

Every token that is not kept joins the bucket of its nearest kept token by position (midpoint rule,
ties to the left); each kept entry becomes the mean of its bucket's keys and values, per head.
Keys are merged after rotary embedding, as in the paper.
"""

from __future__ import annotations

import torch

from kvtool.runtime.merge.base import MergeRule
from kvtool.runtime.selection import Selection


def nearest_anchor(selection: Selection, token_valid: torch.Tensor) -> torch.Tensor:
    """Bucket (slot in `selection`) of every prompt token; padding goes to the extra slot K."""
    bsz, n = token_valid.shape
    width = selection.index.shape[1]
    far = n * 4 + 4  # beyond any real position, so unused slots are never nearest
    anchors = torch.where(selection.valid, selection.index, torch.full_like(selection.index, far))
    positions = torch.arange(n, device=anchors.device).expand(bsz, n).contiguous()
    right = torch.searchsorted(anchors, positions)  # first anchor at or after the token
    left = right - 1
    right_pos = anchors.gather(1, right.clamp(max=width - 1))
    left_pos = anchors.gather(1, left.clamp(min=0))
    has_right = (right < width) & (right_pos < far)
    has_left = left >= 0
    go_left = has_left & (~has_right | (positions - left_pos <= right_pos - positions))
    bucket = torch.where(go_left, left, right)
    return torch.where(token_valid, bucket, torch.full_like(bucket, width))


def bucket_mean(states: torch.Tensor, bucket: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    bsz, heads, n, dim = states.shape
    sums = states.new_zeros(bsz, heads, width + 1, dim)
    sums.scatter_add_(2, bucket[:, None, :, None].expand(bsz, heads, n, dim), states)
    return sums[:, :, :width] / counts[:, None, :width, None]


class PositionMerge(MergeRule):
    name = "position"

    def merge(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        selection: Selection,
        token_valid: torch.Tensor,
        importance: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = selection.index.shape[1]
        bucket = nearest_anchor(selection, token_valid)
        counts = torch.zeros(bucket.shape[0], width + 1, dtype=keys.dtype, device=keys.device)
        counts.scatter_add_(1, bucket, token_valid.to(keys.dtype))
        counts = counts.clamp(min=1)  # unused slots: avoid 0/0, they are masked anyway
        return bucket_mean(keys, bucket, counts, width), bucket_mean(values, bucket, counts, width)
