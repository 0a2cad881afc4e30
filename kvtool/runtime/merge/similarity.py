"""Shared machinery of LOOK-M's merging by key similarity (`similarity-avg`, `-pivot`, `-weighted`).

Matching (LOOK-M eq. 9). Per sequence and KV head, every evicted prompt entry (a real token the
selection does not keep) goes to the kept entry whose key has the highest cosine similarity with its
own key (ties: the earliest kept entry). Keys are compared after rotary embedding, as they sit in
the cache. Kept entries are never matched to anything, padded positions take no part (neither as
evicted entries nor as anchors), and unused selection slots are never anchors. Values follow the
keys: a value is merged into the same anchor, with the same weight, as its key.

Combining. Each evicted entry `e` matched to anchor `c` carries a mass `m_e >= 0` and is first
mixed with its anchor into `p_e = (1 - rho) k_e + rho k_c` (rho = 0: the entry itself; rho = 1/2:
LOOK-M's "pivotal token"). The anchor becomes the mass-weighted mean of itself (mass 1) and the
`p_e` of everything matched to it:

    k_c' = (k_c + sum_e m_e p_e) / (1 + sum_e m_e)

Written as weights on the original entries, `k_c'` gets `(1 + rho sum_e m_e) / (1 + sum_e m_e)` and
each matched `k_e` gets `(1 - rho) m_e / (1 + sum_e m_e)`: non-negative weights that sum to one.
An anchor nothing matched stays as it was. Each rule (one file each) picks `m_e` and `rho`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from kvtool.runtime.importance import accumulation_dtype
from kvtool.runtime.merge.base import MergeRule, gather_tokens
from kvtool.runtime.selection import Selection

# Elements of one chunk's [B, H, rows, K] similarity block (2**24 floats = 64 MiB in float32).
CHUNK_ELEMENTS = 2**24


def kept_columns(selection: Selection, n: int) -> torch.Tensor:
    """[B, n] bool: the prompt columns a valid selection slot keeps."""
    kept = torch.zeros(selection.index.shape[0], n, dtype=torch.bool, device=selection.index.device)
    # Selected columns are distinct within a row, so the scatter has no conflicting writes.
    return kept.scatter_(1, selection.index, selection.valid)


def match_by_similarity(
    keys: torch.Tensor,
    selection: Selection,
    token_valid: torch.Tensor,
    *,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor slot and cosine similarity of every prompt entry, per KV head.

    keys: [B, H, n, D]. Returns `slot` [B, H, n] long, the selection slot (0..K-1) each evicted entry
    merges into, K ("none") for kept entries and padding; and `similarity` [B, H, n], the cosine
    with that anchor (0 where slot is K). Works on blocks of rows; no loop over heads or tokens.
    """
    bsz, heads, n, _ = keys.shape
    width = selection.index.shape[1]
    evicted = token_valid & ~kept_columns(selection, n)  # [B, n]
    unit = F.normalize(keys.to(accumulation_dtype(keys.dtype)), dim=-1)
    anchors = gather_tokens(unit, selection.index)  # [B, H, K, D]
    no_anchor = ~selection.valid[:, None, None, :]  # [B, 1, 1, K]
    slot = torch.full((bsz, heads, n), width, dtype=torch.long, device=keys.device)
    similarity = unit.new_zeros(bsz, heads, n)
    rows = max(1, (chunk_elements or CHUNK_ELEMENTS) // max(1, bsz * heads * width))
    for start in range(0, n, rows):
        block = unit[:, :, start:start + rows] @ anchors.transpose(-1, -2)  # [B, H, rows, K]
        best, best_slot = block.masked_fill(no_anchor, float("-inf")).max(dim=-1)
        slot[:, :, start:start + rows] = best_slot
        similarity[:, :, start:start + rows] = best
    evicted_h = evicted[:, None, :].expand(bsz, heads, n)
    slot = torch.where(evicted_h, slot, torch.full_like(slot, width))
    similarity = torch.where(evicted_h, similarity, torch.zeros_like(similarity))
    return slot, similarity


def merge_into_anchors(
    states: torch.Tensor,
    selection: Selection,
    slot: torch.Tensor,
    mass: torch.Tensor,
    rho: float,
) -> torch.Tensor:
    """k_c' = (k_c (1 + rho M_c) + (1 - rho) sum_e m_e k_e) / (1 + M_c), M_c = sum of masses matched to c.

    states: [B, H, n, Dv] (keys or values; Dv may differ from the keys' width); slot, mass: [B, H, n]
    (mass is ignored where slot == K). Returns [B, H, K, Dv] aligned with `selection.index`.
    """
    bsz, heads, n, dim = states.shape
    width = selection.index.shape[1]
    dtype = accumulation_dtype(states.dtype)
    mass = torch.where(slot < width, mass.to(dtype), torch.zeros((), dtype=dtype, device=mass.device))
    total = mass.new_zeros(bsz, heads, width + 1).scatter_add_(2, slot, mass)[:, :, :width, None]
    sums = mass.new_zeros(bsz, heads, width + 1, dim)
    sums.scatter_add_(2, slot[..., None].expand(bsz, heads, n, dim), mass[..., None] * states.to(dtype))
    anchors = gather_tokens(states, selection.index).to(dtype)
    merged = (anchors * (1 + rho * total) + (1 - rho) * sums[:, :, :width]) / (1 + total)
    return merged.to(states.dtype)


class SimilarityMerge(MergeRule):
    """Base of the three LOOK-M merge modes: match by key similarity, combine with `mass` and `rho`."""

    rho: ClassVar[float] = 0.0  # share of each evicted entry's mass that goes to its anchor's own key

    def mass(self, similarity: torch.Tensor) -> torch.Tensor:
        """Mass of each evicted entry given its cosine similarity with its anchor."""
        return torch.ones_like(similarity)

    def merge(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        selection: Selection,
        token_valid: torch.Tensor,
        importance: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slot, similarity = match_by_similarity(keys, selection, token_valid)
        mass = self.mass(similarity)
        return (
            merge_into_anchors(keys, selection, slot, mass, self.rho),
            merge_into_anchors(values, selection, slot, mass, self.rho),
        )
