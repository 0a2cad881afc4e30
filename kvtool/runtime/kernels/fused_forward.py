"""The prompt pass's attention output from torch's own fused kernel, with the row log-sum-exp that
the column-sum kernel needs (kernels/triton_scores.py, `forward="sdpa"`).

The Triton forward streams the same blocks as FlashAttention but ran slower than torch's default
SDPA kernel on an H100 (cuDNN attention there: 2.78 s against 3.52 s for the whole 32768 x 2 prefill
with it off); at 32k the two Triton kernels cost 2.3x one SDPA call, keeping the prompt phase at 1.46x
(docs/results.md, on a GPU). cuDNN's and the CPU flash kernel's private entry points return each
row's log-sum-exp beside the output, so only the column-sum pass remains kvtool's own. On an H100
it is the faster of the two (one layer at 32768 x 2: 53 ms with the column sums against 66 ms; the
no-draft prompt phase 1.34x the full cache's against 1.48x), so it is the default
(`triton_scores.FORWARD`); the Triton forward serves left-padded prompts and float32.
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634


def applies(query: torch.Tensor, starts: torch.Tensor | None) -> bool:
    """Whether the fused forward can serve `query`: a 16-bit CUDA tensor (cuDNN) or a CPU one (the
    CPU flash kernel, which the tests use), and no padding (neither kernel takes left padding)."""
    if query.is_cuda:
        supported = query.dtype in (torch.float16, torch.bfloat16)
    else:
        supported = query.device.type == "cpu"
    return supported and (starts is None or not bool(starts.any()))


def forward_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of an unpadded prompt: the output [B, n, Hq, D] (sdpa_attention_forward's
    layout) and each row's log-sum-exp of its scaled scores in base 2, [B, Hq, n] float32 (what
    `_attn_fwd` writes). Keys and values are repeated per query head, as transformers' sdpa does."""
    bsz, n_heads, n, _ = query.shape
    groups = n_heads // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    if query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, keys, values, None, True, 0.0, True, False, scale=scaling
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, True, scale=scaling)
    return out.transpose(1, 2).contiguous(), (lse.reshape(bsz, n_heads, n).float() * LOG2E).contiguous()
