"""Where a model's attention layers make their queries, and how RoPE turns them: what Expected
Attention (runtime.importance.expected) and its calibration (calibrate.queries) need of a model.

transformers' attention modules project the query (`q_proj`), optionally normalise it per head
(`q_norm`: Gemma 3, Qwen3), then rotate it with the (cos, sin) the decoder's rotary embedding
computed for the positions: q·cos + rotate_half(q)·sin. The output of the last module before the
rotation is the pre-RoPE query a forward hook can read, and the decoder's rotary embedding module
gives (cos, sin) for any positions, future ones included.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from kvtool.errors import KvtoolError


@dataclass(frozen=True)
class QueryTap:
    """One attention layer's pre-RoPE query: `module`'s forward output, [B, n, Hq, D] once `shape`d."""

    module: torch.nn.Module
    heads: int
    head_dim: int

    def shape(self, output: torch.Tensor, tokens: int) -> torch.Tensor:
        """The output of a forward over `tokens` positions as [B, n, Hq, D]: models normalise the
        query before or after moving the heads first (Qwen3 [B, n, Hq, D], Gemma 3 [B, Hq, n, D]),
        or over the whole projection ([B, n, Hq * D])."""
        if output.dim() == 4 and output.shape[1] == self.heads and output.shape[2] == tokens:
            # As many positions as heads: the layout shows in the strides, as a heads-first query is
            # the projection's [B, n, Hq, D] transposed (and a norm keeps its input's strides).
            if tokens != self.heads or output.stride(1) < output.stride(2):
                return output.transpose(1, 2)
        return output.reshape(output.shape[0], tokens, self.heads, self.head_dim)


def _decoder(model) -> torch.nn.Module:
    """The text decoder: the module holding the decoder layers and their rotary embedding."""
    for module in model.modules():
        if isinstance(getattr(module, "layers", None), torch.nn.ModuleList) and hasattr(module, "rotary_emb"):
            return module
    raise KvtoolError(f"{type(model).__name__}: cannot find its decoder's rotary embedding (expected-attention needs RoPE)")


def unsupported(model) -> str | None:
    """Why the expected-attention scorer cannot run on `model` (one line), or None."""
    text = model.config.get_text_config(decoder=True)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("mrope_section"):
        return f"{model.config.model_type}: multimodal RoPE (3-D positions) is not supported by the expected-attention scorer"
    try:
        decoder = _decoder(model)
    except KvtoolError as error:
        return str(error)
    for index, block in enumerate(decoder.layers):
        attn = getattr(block, "self_attn", None)
        if attn is None:  # a linear-attention or Mamba layer (Qwen3-Next, Jamba, ...): no query to tap
            return f"{model.config.model_type}: layer {index} has no attention module (expected-attention needs one per layer)"
        if callable(getattr(attn, "expand_kv", None)):  # MLA: the cached keys are latents, not per-head keys
            return f"{model.config.model_type}: multi-head latent attention is not supported by the expected-attention scorer"
        if not hasattr(attn, "q_proj") or not hasattr(attn, "head_dim"):
            return f"{model.config.model_type}: layer {index} has no q_proj / head_dim (expected-attention needs them)"
    if _complex_rotary(decoder.rotary_emb):
        return f"{model.config.model_type}: complex-valued RoPE is not supported by the expected-attention scorer (it reads cos and sin)"
    return None


def _complex_rotary(rotary: torch.nn.Module) -> bool:
    """Whether the rotary embedding gives one complex tensor (Llama 4's freqs_cis), not (cos, sin)."""
    buffer = next(rotary.buffers(), None)
    device = buffer.device if buffer is not None else None
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    try:
        with torch.no_grad():
            out = rotary(probe, torch.zeros(1, 1, dtype=torch.long, device=device))
    except (TypeError, ValueError, RuntimeError, KeyError):  # needs more than positions: it gives (cos, sin)
        return False
    return torch.is_tensor(out) and torch.is_complex(out)


def _check_rope(model) -> None:
    reason = unsupported(model)
    if reason is not None:
        raise KvtoolError(reason)


def query_taps(model) -> dict[int, QueryTap]:
    """Every decoder layer's pre-RoPE query tap, by layer index."""
    _check_rope(model)
    taps = {}
    for index, block in enumerate(_decoder(model).layers):
        attn = getattr(block, "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj"):
            raise KvtoolError(f"{type(model).__name__}: layer {index} has no q_proj (expected-attention needs one)")
        head_dim = int(attn.head_dim)
        heads = attn.q_proj.out_features // head_dim
        taps[index] = QueryTap(getattr(attn, "q_norm", None) or attn.q_proj, heads, head_dim)
    return taps


@dataclass(frozen=True)
class FutureRotation:
    """RoPE of one layer averaged over the `span` positions after each row's prompt."""

    rotary: torch.nn.Module
    layer_type: str | None
    scaling: float  # the attention module's logit scale (1/sqrt(d), or Gemma's query_pre_attn_scalar)

    def mean(self, start: torch.Tensor, span: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, D], [B, D]): cos and sin averaged over positions start[b] ... start[b] + span - 1
        (the rotary module's attention scaling included, as it multiplies every query)."""
        return self.mean_at(start, torch.arange(span, device=start.device), dtype)

    def mean_at(self, start: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, D], [B, D]): cos and sin averaged over positions start[b] + offsets[j]."""
        positions = start.long()[:, None] + offsets.long().to(start.device)
        probe = torch.zeros(1, device=start.device, dtype=torch.float32)
        args = (probe, positions) if self.layer_type is None else (probe, positions, self.layer_type)
        cos, sin = self.rotary(*args)
        return cos.to(dtype).mean(dim=1), sin.to(dtype).mean(dim=1)


def future_rotations(model) -> dict[int, FutureRotation]:
    """Every decoder layer's `FutureRotation`, by layer index."""
    _check_rope(model)
    decoder = _decoder(model)
    rotary = decoder.rotary_emb
    typed = "layer_type" in inspect.signature(rotary.forward).parameters
    text = model.config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    out = {}
    for index, block in enumerate(decoder.layers):
        attn = block.self_attn
        layer_type = (types[index] if types else "full_attention") if typed else None
        scaling = float(getattr(attn, "scaling", attn.head_dim**-0.5))
        out[index] = FutureRotation(rotary, layer_type, scaling)
    return out


def output_grams(model) -> dict[int, torch.Tensor]:
    """Every decoder layer's [Hq, D, D] Gram matrices of its output projection's per-head slices,
    W_hᵀW_h (W_h: the o_proj columns head h writes through), so ‖W_h v‖² = vᵀ(W_hᵀW_h)v."""
    _check_rope(model)
    out = {}
    for index, block in enumerate(_decoder(model).layers):
        attn = block.self_attn
        weight = getattr(getattr(attn, "o_proj", None), "weight", None)
        if weight is None:
            raise KvtoolError(f"{type(model).__name__}: layer {index} has no o_proj (expected-output needs one)")
        head_dim = int(attn.head_dim)
        accumulation = torch.float64 if weight.dtype == torch.float64 else torch.float32
        slices = weight.detach().double().view(weight.shape[0], -1, head_dim).transpose(0, 1)  # [Hq, hidden, D]
        out[index] = (slices.transpose(1, 2) @ slices).to(accumulation)
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE pairing: dimension i turns with dimension i + D/2."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin along the last dimension: RoPE, or its average over positions."""
    return x * cos + rotate_half(x) * sin
