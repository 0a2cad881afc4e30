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

A soft-capping layer (Gemma 2) computes E[exp(c·tanh(x/c))] of the same Gaussian logit x instead
(by quadrature, `logits.expected_capped`), and a sink layer's sink logit (gpt-oss) joins each head's
softmax as the model's does: `rotation.scaling` is then a LogitScale (attach.layer_queries).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvtool.errors import KvtoolError
from kvtool.models.queries import FutureRotation, rotated
from kvtool.runtime.importance.base import Scorer
from kvtool.runtime.importance.logits import expected_capped, sink_view, softmax_
from kvtool.runtime.importance.scores import PromptScores, ScoreRequest, accumulation_dtype


@dataclass(frozen=True, eq=False)
class LayerQueries:
    """One layer's query statistics and how RoPE turns them: mean [Hq, D], cov [Hq, D, D]; `output`
    [Hq, Dv, Dv], the Gram matrices of the output projection's per-head slices
    (`models.queries.output_grams`; the expected-output scorer reads them); `pair_norm` [Hq, D/2],
    the mean norm of each RoPE pair of the queries (the triattention rules read it)."""

    mean: torch.Tensor
    cov: torch.Tensor
    rotation: FutureRotation
    future: int
    output: torch.Tensor | None = None
    pair_norm: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "LayerQueries":
        """The same statistics on `device` (a decode step must not copy them in from the host)."""
        moved = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self, mean=self.mean.to(device), cov=self.cov.to(device), output=moved(self.output), pair_norm=moved(self.pair_norm)
        )


def check_fit(keys: torch.Tensor, queries: LayerQueries) -> int:
    """The query heads of `queries`; a one-line KvtoolError unless they fit `keys` [B, Hkv, n, D]."""
    kv_heads, dim = keys.shape[1], keys.shape[-1]
    heads = queries.mean.shape[0]
    if queries.mean.shape[-1] != dim or heads % kv_heads:
        raise KvtoolError(f"query statistics of {heads} heads x {queries.mean.shape[-1]} do not fit keys of {kv_heads} x {dim}")
    return heads


def expected_probs(
    keys: torch.Tensor, token_valid: torch.Tensor, queries: LayerQueries, start: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, Hq, n]: each query head's expected attention to every prompt column (0 on padding).
    keys [B, Hkv, n, D] (after RoPE, each at its row's true position), token_valid [B, n]; `start` [B]:
    the position of each row's next token, from which the future queries are averaged (default: the
    valid columns' count, a prompt's length)."""
    heads, kv_heads = check_fit(keys, queries), keys.shape[1]
    dtype = accumulation_dtype(keys.dtype)
    valid = token_valid.bool()
    start = valid.sum(dim=1) if start is None else start
    cos, sin = full_width(*queries.rotation.mean(start, queries.future, dtype), keys.shape[-1])  # [B, D]
    cos, sin = cos[:, None, :], sin[:, None, :]
    mean = rotated(queries.mean.to(keys.device, dtype)[None], cos, sin)  # [B, Hq, D]
    cov = queries.cov.to(keys.device, dtype)[None]  # [1, Hq, D, D]
    # R̄ΣR̄ᵀ: R̄ on Σ's rows, then (Σ symmetric) on the rows of the transpose.
    turn = lambda m: rotated(m.transpose(-1, -2), cos[..., None, :], sin[..., None, :])  # noqa: E731
    cov = turn(turn(cov))  # [B, Hq, D, D]
    key = keys.to(dtype).repeat_interleave(heads // kv_heads, dim=1)  # [B, Hq, n, D]
    s = queries.rotation.scaling
    centre = s * torch.einsum("bhnd,bhd->bhn", key, mean)
    logits = expected_capped(centre, (s * s) * torch.einsum("bhnd,bhde,bhne->bhn", key, cov, key), s)
    sink = sink_view(s, (1, heads, 1), dtype, keys.device)
    return softmax_(logits.masked_fill(~valid[:, None, :], float("-inf")), sink).nan_to_num(0.0)


def full_width(cos: torch.Tensor, sin: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) over all `dim` dimensions: gpt-oss's rotary module gives each pair's angle
    once (dim / 2 values, turning dimension i with i + dim / 2 alike), which is the same rotation with
    the values repeated for the second half."""
    if cos.shape[-1] * 2 == dim:
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos, sin


def _relative(norm: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`norm` [B, H, n] over its row's mean over the valid columns (0 on padding): at most n."""
    norm = norm.masked_fill(~valid[:, None, :], 0.0)
    mean = norm.sum(dim=-1, keepdim=True) / valid.sum(dim=1).clamp(min=1)[:, None, None]
    return norm / mean.clamp(min=torch.finfo(norm.dtype).tiny)


def expected_scores(keys: torch.Tensor, values: torch.Tensor, token_valid: torch.Tensor, queries: LayerQueries) -> torch.Tensor:
    """[B, Hkv, n]: each KV head's expected attention to every prompt column (averaged over its query
    heads) times its value's norm relative to the row's mean; 0 on padding. values [B, Hkv, n, Dv]."""
    return value_weighted(expected_probs(keys, token_valid, queries), values, token_valid.bool())


def expected_output_scores(
    keys: torch.Tensor, values: torch.Tensor, token_valid: torch.Tensor, queries: LayerQueries
) -> torch.Tensor:
    """[B, Hkv, n]: per query head, its expected attention to a column times ‖W_h v‖ (what that head
    writes to the residual stream through the output projection), relative to the row's mean, then
    averaged over each KV head's query heads; 0 on padding."""
    return output_weighted(expected_probs(keys, token_valid, queries), values, token_valid.bool(), queries)


def value_weighted(probs: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    bsz, kv_heads, n, _ = values.shape
    expected = probs.view(bsz, kv_heads, -1, n).mean(dim=2)
    return expected * _relative(values.to(probs.dtype).norm(dim=-1), valid)


def output_weighted(probs: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, queries: LayerQueries) -> torch.Tensor:
    if queries.output is None:
        raise KvtoolError("internal: the expected-output scorer was handed no output projection")
    bsz, kv_heads, n, _ = values.shape
    value = values.to(probs.dtype).repeat_interleave(probs.shape[1] // kv_heads, dim=1)  # [B, Hq, n, Dv]
    gram = queries.output.to(value.device, probs.dtype)
    written = torch.einsum("bhnd,hde,bhne->bhn", value, gram, value).clamp(min=0).sqrt()
    return (probs * _relative(written, valid)).view(bsz, kv_heads, -1, n).mean(dim=2)


class ExpectedAttention(Scorer):
    name = "expected-attention"
    field = "expected"  # the PromptScores field it ranks by

    def request(self, per_head: bool) -> ScoreRequest:
        return ScoreRequest(expected=True)

    def score(self, scores: PromptScores, token_valid: torch.Tensor, per_head: bool) -> torch.Tensor:
        score = getattr(scores, self.field)
        if score is None:
            raise KvtoolError(f"internal: the {self.name} scorer was handed no {self.field} scores")
        return score if per_head else score.mean(dim=1)
