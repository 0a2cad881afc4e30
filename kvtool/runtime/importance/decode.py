"""One new token's attention over the cached slots, with the probabilities it gave them."""

from __future__ import annotations

import torch

from kvtool.runtime.importance.scores import accumulation_dtype


def decode_attention_with_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    per_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token's attention over the cached slots, with the probabilities it gave them.

    query: [B, Hq, 1, D]; keys/values: [B, Hkv, S, D]; mask: boolean [B, 1, 1, S], or None when
    every slot holds an entry.
    Returns the output in sdpa_attention_forward's layout [B, 1, Hq, D] and the probabilities:
    [B, S] averaged over all query heads (what H2O accumulates and shared TOVA ranks), or with
    `per_head` [B, Hkv, S] averaged over each KV head's query heads (per-head layers, whose slots
    hold different entries in each KV head). Used only by rules that need the scores.
    """
    bsz, n_heads, _, head_dim = query.shape
    n_kv_heads = keys.shape[1]
    acc = accumulation_dtype(query.dtype)
    q = query.reshape(bsz, n_kv_heads, n_heads // n_kv_heads, head_dim).to(acc) * scaling
    scores = torch.matmul(q, keys.to(acc).transpose(-1, -2))  # [B, Hkv, g, S]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.to(acc))  # [B, Hkv, g, D]
    out = out.reshape(bsz, 1, n_heads, -1).to(query.dtype)
    if per_head:
        return out, probs.mean(dim=2)
    return out, probs.sum(dim=(1, 2)) / n_heads
