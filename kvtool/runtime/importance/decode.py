"""One new token's attention over the cached slots, with the probabilities it gave them."""

from __future__ import annotations

import torch

from kvtool.runtime.importance.logits import cap_, sink_view, softmax_
from kvtool.runtime.importance.scores import accumulation_dtype
from kvtool.runtime.settings import current_settings

# On a GPU the product of the probabilities with the values is split into chunks of this many slots:
# it has a single query row per query head, so as one matrix product per head it keeps a handful of
# the GPU's cores busy walking thousands of slots. Fixed slots (layer/fixed.py) round a buffer of
# SPLIT_FROM slots or more to a multiple of it (at most 1/8 more slots; smaller buffers are not split).
SLOT_CHUNK = 64
SPLIT_FROM = 8 * SLOT_CHUNK


def decode_attention_with_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    per_head: bool = False,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token's attention over the cached slots, with the probabilities it gave them.

    query: [B, Hq, 1, D]; keys/values: [B, Hkv, S, D]; mask: boolean [B, 1, 1, S], or None when
    every slot holds an entry.
    Returns the output in sdpa_attention_forward's layout [B, 1, Hq, D] and the probabilities:
    [B, S] averaged over all query heads (what H2O accumulates and shared TOVA ranks), or with
    `per_head` [B, Hkv, S] averaged over each KV head's query heads (per-head layers, whose slots
    hold different entries in each KV head). Used by rules that need the scores, and by layers whose
    storage folds (`EntryStorage.read_scaled`): then keys and values are codes and `key_scale` /
    `value_scale` [B, Hkv, S] their scales, so each slot's logit is (q . codes) x its key's scale and
    each probability enters the values' product times its value's scale: the same products as over
    the decoded entries, in another order. A soft-capping or sink layer's `scaling` is a LogitScale
    (logits.py): its probabilities are the model's.

    Scores and probabilities are float32 (float64 for float64 models). A half-precision model on a
    GPU multiplies its own keys and values with float32 results, as FlashAttention does (the
    probabilities enter the second product in the values' precision), instead of copying the
    whole cache to float32 at every step.
    """
    bsz, n_heads, _, head_dim = query.shape
    n_kv_heads, slots = keys.shape[1], keys.shape[2]
    group = n_heads // n_kv_heads
    acc = accumulation_dtype(query.dtype)
    q = query.reshape(bsz, n_kv_heads, group, head_dim)
    if _mixed(keys, acc):
        scores = _bmm(q, keys.transpose(-1, -2), acc).mul_(scaling)
    else:
        scores = torch.matmul(q.to(acc) * scaling, keys.to(acc).transpose(-1, -2))  # [B, Hkv, g, S]
    if key_scale is not None:
        scores.mul_(key_scale[:, :, None, :])
    cap_(scores, scaling)  # a soft-capping layer's (`scaling` a LogitScale, logits.py)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = softmax_(scores, sink_view(scaling, (1, n_kv_heads, group, 1), acc, scores.device))
    weights = probs if value_scale is None else probs * value_scale[:, :, None, :]
    if _mixed(values, acc):
        out = _weighted_values(weights, values, acc)
    else:
        out = torch.matmul(weights, values.to(acc))  # [B, Hkv, g, D]
    out = out.reshape(bsz, 1, n_heads, -1).to(query.dtype)
    if per_head:
        return out, probs.mean(dim=2)
    return out, probs.sum(dim=(1, 2)) / n_heads


def _mixed(tensor: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether half-precision `tensor` is multiplied straight into `acc` results (CUDA's bmm with an
    output dtype, where torch has it and `RuntimeSettings.mixed_precision_decode` is on)."""
    return tensor.is_cuda and tensor.dtype != acc and HAS_MIXED_BMM and current_settings().mixed_precision_decode


def _bmm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b over the leading dims, inputs in b's dtype, results in `acc`."""
    lead = a.shape[:-2]
    a, b = a.to(b.dtype).reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    # Off CUDA (the tests' CPU runs of this path): the same products through copies in `acc`.
    out = torch.bmm(a, b, out_dtype=acc) if a.is_cuda else torch.bmm(a.to(acc), b.to(acc))
    return out.view(*lead, *out.shape[-2:])


def _weighted_values(probs: torch.Tensor, values: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """probs [B, Hkv, g, S] @ values [B, Hkv, S, D], in SLOT_CHUNK chunks of slots summed after."""
    bsz, heads, group, slots = probs.shape
    if slots < SPLIT_FROM or slots % SLOT_CHUNK:
        return _bmm(probs, values, acc)
    chunks = slots // SLOT_CHUNK
    p = probs.view(bsz, heads, group, chunks, SLOT_CHUNK).transpose(2, 3)  # [B, Hkv, c, g, chunk]
    v = values.reshape(bsz, heads, chunks, SLOT_CHUNK, values.shape[-1])
    return _bmm(p, v, acc).sum(dim=2)


# Whether this torch has CUDA's bmm with an output dtype (the mixed-precision products above).
HAS_MIXED_BMM = torch._C._dispatch_has_kernel_for_dispatch_key("aten::bmm.dtype", "CUDA")
