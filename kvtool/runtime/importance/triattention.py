"""`triattention`: TriAttention's distance-aware key score (2026), from per-head query statistics
calibration learned offline.

RoPE turns each pair of a head's dimensions (i, i + D/2) as one complex number, at a frequency ω_f.
With the query centre q̄_f of pair f (the calibrated pre-RoPE mean) and a key k_f at position p, a
query at position p + Δ scores Σ_f |q̄_f||k_f| cos(ω_f Δ + arg q̄_f − arg k_f): a trigonometric series
in the distance. TriAttention averages it over future offsets spaced geometrically (1, 2, 4, ...,
65536 after the newest token, so far and near queries both count) and adds a norm term
Σ_f (E|q_f| − |q̄_f|)·|k_f|: the part of a query's length that its centre does not predict the
direction of, times the key's length in that pair. The keys kvtool holds are rotated to their true
positions, so the averaged series is the centre rotated by RoPE averaged over those positions, dotted
with the key (`models.queries.FutureRotation.mean_at`).

The paper ranks a head's keys by that estimate of the coming logit. A KV head serves several query
heads here: each query head's estimates, at the layer's logit scale, become its softmax over the
prompt's keys, and the KV head's score is their mean (as every kvtool scorer averages attention over
a KV head's query heads), so a score stays at most n. No value norm: TriAttention has none.
"""

from __future__ import annotations

import torch

from kvtool.errors import KvtoolError
from kvtool.models.queries import rotated
from kvtool.runtime.importance.expected import ExpectedAttention, LayerQueries, check_fit, full_width
from kvtool.runtime.importance.logits import cap_, sink_view, softmax_
from kvtool.runtime.importance.scores import accumulation_dtype

# The future offsets after the newest token: 2^0 ... 2^16 (TriAttention's 1 ... 65536, geometric).
OFFSET_POWERS = 17


def triattention_probs(
    keys: torch.Tensor, token_valid: torch.Tensor, queries: LayerQueries, start: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, Hkv, n]: per KV head the mean over its query heads of the softmax, over the valid columns,
    of TriAttention's logit estimate; 0 on padding. keys [B, Hkv, n, D] (after RoPE, at their true
    positions), token_valid [B, n]; `start` [B]: the position of each row's next token (default: the
    valid columns' count, a prompt's length)."""
    if queries.pair_norm is None:
        raise KvtoolError(
            "the triattention rules need per-frequency query norms, which this profile's query statistics lack "
            "(calibrated before they were recorded); recalibrate with kvtool calibrate"
        )
    bsz, kv_heads, n, dim = keys.shape
    heads = check_fit(keys, queries)
    dtype = accumulation_dtype(keys.dtype)
    valid = token_valid.bool()
    start = valid.sum(dim=1) if start is None else start
    # The newest token sits at start - 1; the future queries at start - 1 + 2^j.
    offsets = torch.pow(2, torch.arange(OFFSET_POWERS, device=keys.device)) - 1
    cos, sin = full_width(*queries.rotation.mean_at(start, offsets, dtype), dim)  # [B, D]
    mean = queries.mean.to(keys.device, dtype)
    centre = rotated(mean[None], cos[:, None, :], sin[:, None, :])  # [B, Hq, D]
    half = dim // 2
    centre_norm = torch.hypot(mean[..., :half], mean[..., half:])  # [Hq, D/2]
    spread = queries.pair_norm.to(keys.device, dtype) - centre_norm  # E|q_f| - |q̄_f| >= 0
    key = keys.to(dtype)
    key_norm = torch.hypot(key[..., :half], key[..., half:])  # [B, Hkv, n, D/2]: RoPE leaves it as it is
    group = heads // kv_heads
    series = torch.einsum("bgnd,bghd->bghn", key, centre.view(bsz, kv_heads, group, dim))
    norm_term = torch.einsum("bgnf,ghf->bghn", key_norm, spread.view(kv_heads, group, half))
    scaling = queries.rotation.scaling
    # The estimate is of the coming logit, so a soft-capping layer's is capped as its logits are,
    # and a sink layer's sink joins the softmax (logits.py).
    logits = cap_(scaling * (series + norm_term), scaling)  # [B, Hkv, group, n]
    sink = sink_view(scaling, (1, kv_heads, group, 1), dtype, keys.device)
    probs = softmax_(logits.masked_fill(~valid[:, None, None, :], float("-inf")), sink).nan_to_num(0.0)
    return probs.mean(dim=2)


class TriAttention(ExpectedAttention):
    name = "triattention"
    field = "triattention"  # added to the prompt's scores by `queried.with_expected`
