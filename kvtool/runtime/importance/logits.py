"""What an attention layer does to its logits besides scaling them: soft-capping and sink logits.

Most models' attention is softmax(s·qᵀk + mask) v. Two families compute something else, and every
probability kvtool computes (the attention output, the prompt's scores, a decode step's, the
observation window's, the expected ones) must be the model's own:

- Gemma 2 soft-caps its logits before the mask: l = c·tanh(s·qᵀk / c) (`attn_logit_softcapping`,
  reaching the attention function as its `softcap` argument);
- gpt-oss adds one learned logit per query head to every row's softmax, a column with no value
  (`module.sinks`, reaching the attention function as `s_aux`): p_j = e^{l_j} / (e^{sink} + Σ e^{l_i}),
  so a row's probabilities sum to less than one.

`LogitScale` is the layer's scale s, a float as transformers passes it, that also carries the cap and
the sinks: it travels wherever the scale does (the layer's recorded rows, the fused decode step,
the query statistics' logit scale), so a path that reads the scale reads the rest with it, and a
plain float means plain attention. `dense_attention` is the model's own eager arithmetic for these
families, op for op, which is what an uncompressed layer runs so budget 1.0 stays the model exactly.
"""

from __future__ import annotations

import math

import torch

from kvtool.errors import KvtoolError


class LogitScale(float):
    """An attention layer's logit scale, with its soft-cap (None: none) and its sink logits ([Hq]
    tensor, None: none). Arithmetic on it is a plain float's."""

    softcap: float | None
    sinks: torch.Tensor | None

    def __new__(cls, scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> "LogitScale":
        value = super().__new__(cls, scale)
        value.softcap = None if softcap is None else float(softcap)
        value.sinks = None if sinks is None else sinks.detach()
        return value

    def __repr__(self) -> str:
        return f"LogitScale({float(self)!r}, softcap={self.softcap!r}, sinks={'None' if self.sinks is None else 'tensor'})"


def softcap_of(scaling) -> float | None:
    return getattr(scaling, "softcap", None)


def sinks_of(scaling) -> torch.Tensor | None:
    return getattr(scaling, "sinks", None)


def is_plain(scaling) -> bool:
    """Whether `scaling`'s attention is softmax(s·qᵀk + mask) alone."""
    return softcap_of(scaling) is None and sinks_of(scaling) is None


def layer_scale(module: torch.nn.Module, scaling: float | None, query: torch.Tensor, kwargs: dict) -> float:
    """The scale an attention function was called with, as a LogitScale when the call soft-caps
    (`softcap`) or brings sink logits (`s_aux`, or `sinks`): a plain float otherwise."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if softcap is None and sinks is None:
        return scale
    if sinks is not None and sinks.numel() != query.shape[1]:
        raise KvtoolError(f"attention sinks of {sinks.numel()} values do not fit {query.shape[1]} query heads")
    return LogitScale(scale, softcap, sinks)


def logit_terms(model) -> dict[int, tuple[float | None, torch.Tensor | None]]:
    """Per decoder layer whose softmax is not plain: (soft-cap, sink logits [Hq]), from the text
    config's `attn_logit_softcapping` (Gemma 2) and the attention modules' learned `sinks` (gpt-oss);
    what the attention function receives as `softcap` and `s_aux` (`layer_scale`)."""
    text = model.config.get_text_config(decoder=True)
    softcap = getattr(text, "attn_logit_softcapping", None)
    sinks: dict[int, torch.Tensor] = {}
    indices: set[int] = set()
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or not hasattr(module, "head_dim"):
            continue
        indices.add(index)
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            sinks[index] = module.sinks
    if softcap is None and not sinks:
        return {}
    return {index: (softcap, sinks.get(index)) for index in sorted(indices)}


def cap_(scores: torch.Tensor, scaling) -> torch.Tensor:
    """Soft-cap already scaled logits in place (before any mask: tanh would turn -inf into -cap)."""
    cap = softcap_of(scaling)
    if cap is not None:
        scores.div_(cap).tanh_().mul_(cap)
    return scores


def sink_view(scaling, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor | None:
    """The sink logits shaped `shape` (the head axes of a score tensor, ones elsewhere; their
    product is Hq in transformers' head order), in `dtype`; None without sinks."""
    sinks = sinks_of(scaling)
    if sinks is None:
        return None
    return sinks.to(device=device, dtype=dtype).reshape(shape)


def softmax_(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis in place, with `sink` (broadcasting against scores[..., :1]) as one
    more logit in every row's denominator; a row of -inf alone gives zeros (NaN without a sink,
    as torch.softmax, which callers mask)."""
    if sink is None:
        return torch.softmax(scores, dim=-1, out=scores)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    scores.sub_(top).exp_()
    total = scores.sum(dim=-1, keepdim=True).add_((sink - top).exp())
    return scores.div_(total)


def softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """`softmax_` on a copy."""
    return softmax_(scores.clone(), sink) if sink is not None else torch.softmax(scores, dim=-1)


def expected_capped(mean: torch.Tensor, variance: torch.Tensor, scaling) -> torch.Tensor:
    """log E[exp(l(x))] for Gaussian logits x ~ N(mean, variance): mean + variance / 2 for plain
    attention (the Gaussian's moment generating function), and for a soft-capped one, l(x) =
    c·tanh(x / c), the same expectation by Gauss-Hermite quadrature (HERMITE_NODES nodes: within
    1e-5 of the integral even for a cap of 1.5 against logits of standard deviation 2, the tests'
    case, far below the estimate's own error)."""
    cap = softcap_of(scaling)
    if cap is None:
        return mean + variance / 2
    nodes, weights = _hermite(mean.dtype, mean.device)
    x = mean[..., None] + (2 * variance.clamp(min=0))[..., None].sqrt() * nodes
    capped = cap * torch.tanh(x / cap) + weights.log() - 0.5 * math.log(math.pi)
    return torch.logsumexp(capped, dim=-1)


HERMITE_NODES = 24


def _hermite(dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    import numpy as np

    nodes, weights = np.polynomial.hermite.hermgauss(HERMITE_NODES)
    return torch.tensor(nodes, dtype=dtype, device=device), torch.tensor(weights, dtype=dtype, device=device)


def dense_attention(query, key, value, mask, scaling, dropout: float = 0.0) -> torch.Tensor:
    """Attention as the soft-capping and sink families' own eager code computes it, op for op
    (transformers' gemma2 and gpt_oss `eager_attention_forward`): logits in the query's dtype,
    soft-capped, masked; a sinks row's max subtracted and its softmax in the logits' dtype, a
    soft-capped row's in float32. query [B, Hq, q, D], key/value [B, Hkv, k, D], mask boolean
    [B, 1, q, k] or None (causal is the caller's). Returns sdpa_attention_forward's layout [B, q, Hq, D]."""
    if dropout:
        raise KvtoolError("kvtool's attention runs in inference only (attention dropout > 0 given)")
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    weights = torch.matmul(query, key.transpose(2, 3)) * float(scaling)
    cap = softcap_of(scaling)
    if cap is not None:
        weights = torch.tanh(weights / cap) * cap
    if mask is not None:
        # The eager code adds a float mask of 0 and the dtype's minimum: the same on allowed columns.
        weights = weights.masked_fill(~mask, torch.finfo(weights.dtype).min)
    sinks = sinks_of(scaling)
    if sinks is not None:
        sink = sinks.to(weights.dtype).reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        combined = torch.cat([weights, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        probs = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.to(value.dtype), value)
    return out.transpose(1, 2).contiguous()
