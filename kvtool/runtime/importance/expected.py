"""`expected-attention`: the attention the answer's queries are expected to give each prompt token
(Expected Attention, kvpress), from per-head query statistics calibration learned offline.

A head's future query is modelled as a Gaussian: the mean μ and covariance Σ of its pre-RoPE
queries on the calibration prompts (`kvtool.profiles.queries`), rotated by RoPE averaged over the
`future` positions after the prompt (R̄: cos and sin averaged, so μ̄ = R̄μ and Σ̄ = R̄ΣR̄ᵀ). For a
Gaussian q, E[exp(s·qᵀk)] = exp(s·μ̄ᵀk + s²·kᵀΣ̄k/2), so a key's expected logit is that exponent
(s: the layer's logit scale, 1/√d for most models); the softmax over the prompt's keys, averaged
over the KV head's query heads, is the attention it expects. Each entry's score is that times its
value's norm (what the entry can move the output by), the norm taken relative to the row's mean
norm in that head so a score stays at most n as selection's protected classes need. No extra
forward: the statistics are data, the keys and values are the prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.errors import KvtoolError
from kvtool.models.queries import FutureRotation, rotated
from kvtool.runtime.importance.base import Scorer
from kvtool.runtime.importance.scores import PromptScores, ScoreRequest, accumulation_dtype


@dataclass(frozen=True, eq=False)
class LayerQueries:
    """One layer's query statistics and how RoPE turns them: mean [Hq, D], cov [Hq, D, D]."""

    mean: torch.Tensor
    cov: torch.Tensor
    rotation: FutureRotation
    future: int


def expected_scores(keys: torch.Tensor, values: torch.Tensor, token_valid: torch.Tensor, queries: LayerQueries) -> torch.Tensor:
    """[B, Hkv, n]: each KV head's expected attention to every prompt column times its relative value
    norm; 0 on padding. keys [B, Hkv, n, D] (after RoPE, at positions 0 .. T_b - 1 of each row's real
    tokens), values [B, Hkv, n, Dv], token_valid [B, n]."""
    bsz, kv_heads, n, dim = keys.shape
    heads = queries.mean.shape[0]
    if queries.mean.shape[-1] != dim or heads % kv_heads:
        raise KvtoolError(f"query statistics of {heads} heads x {queries.mean.shape[-1]} do not fit keys of {kv_heads} x {dim}")
    dtype = accumulation_dtype(keys.dtype)
    valid = token_valid.bool()
    cos, sin = queries.rotation.mean(valid.sum(dim=1), queries.future, dtype)  # [B, D]
    cos, sin = cos[:, None, :], sin[:, None, :]
    mean = rotated(queries.mean.to(keys.device, dtype)[None], cos, sin)  # [B, Hq, D]
    cov = queries.cov.to(keys.device, dtype)[None]  # [1, Hq, D, D]
    # R̄ΣR̄ᵀ: R̄ on Σ's rows, then (Σ symmetric) on the rows of the transpose.
    turn = lambda m: rotated(m.transpose(-1, -2), cos[..., None, :], sin[..., None, :])  # noqa: E731
    cov = turn(turn(cov))  # [B, Hq, D, D]
    key = keys.to(dtype).repeat_interleave(heads // kv_heads, dim=1)  # [B, Hq, n, D]
    s = queries.rotation.scaling
    logits = s * torch.einsum("bhnd,bhd->bhn", key, mean)
    logits = logits + (s * s / 2) * torch.einsum("bhnd,bhde,bhne->bhn", key, cov, key)
    probs = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    expected = probs.view(bsz, kv_heads, heads // kv_heads, n).mean(dim=2)
    norm = values.to(dtype).norm(dim=-1).masked_fill(~valid[:, None, :], 0.0)  # [B, Hkv, n]
    mean_norm = norm.sum(dim=-1, keepdim=True) / valid.sum(dim=1).clamp(min=1)[:, None, None]
    return expected * norm / mean_norm.clamp(min=torch.finfo(dtype).tiny)


class ExpectedAttention(Scorer):
    name = "expected-attention"

    def request(self, per_head: bool) -> ScoreRequest:
        return ScoreRequest(expected=True)

    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor:
        if scores.expected is None:
            raise KvtoolError("internal: the expected-attention scorer was handed no expected scores")
        return scores.expected if per_head else scores.expected.mean(dim=1)
