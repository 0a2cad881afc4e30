"""The compressed forward equals an independent reference on the full cache.

The reference is written from methods.md with plain Python and the model's own modules:
importance from eager attention weights, brute-force top-k, nearest-anchor buckets by a loop,
fixed-point eviction on a list, and a hand-written Llama decoding step over each layer's entries.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from kvtool.runtime import attach
from kvtool.models.forward import with_cache
from tiny_models import profile_with, prompts, tiny_llama

SINK, RECENT, DIST = 2, 3, 4
RATIOS = [0.3, 0.5, 0.2]


def eager_importance(model, ids: torch.Tensor) -> list[list[float]]:
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return [att[0].sum(dim=1).mean(dim=0).tolist() for att in out.attentions]  # heads averaged


def brute_force_anchors(importance: list[float], keep: int) -> list[int]:
    n = len(importance)
    protected = list(range(min(SINK, keep)))
    recent = [t for t in range(n - 1, n - 1 - RECENT, -1) if t not in protected]
    protected += recent[: keep - len(protected)]
    rest = sorted((t for t in range(n) if t not in protected), key=lambda t: -importance[t])
    return sorted(protected + rest[: keep - len(protected)])


def buckets(anchors: list[int], n: int) -> dict[int, list[int]]:
    groups = {a: [] for a in anchors}
    for t in range(n):
        left = max((a for a in anchors if a <= t), default=None)
        right = min((a for a in anchors if a >= t), default=None)
        if left is None or (right is not None and right - t < t - left):
            groups[right].append(t)
        else:
            groups[left].append(t)
    return groups


def reference_entries(keys, values, anchors, merge: str):
    """[(position, key [H, D], value [H, D])] per kept entry, in position order."""
    n = keys.shape[2]
    entries = []
    for anchor, members in buckets(anchors, n).items():
        if merge == "none":
            members = [anchor]
        entries.append((anchor, keys[0, :, members].mean(dim=1), values[0, :, members].mean(dim=1)))
    return entries


def reference_step(model, entries_per_layer, token: int, position: int) -> torch.Tensor:
    """One decoding step of Llama over explicit per-layer entries; appends the new token's KV."""
    inner = model.model
    hidden = inner.embed_tokens(torch.tensor([[token]]))
    pos = torch.tensor([[position]])
    cos, sin = inner.rotary_emb(hidden, pos)
    for layer, entries in zip(inner.layers, entries_per_layer):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        entries.append((position, k[0, :, 0], v[0, :, 0]))
        keys = torch.stack([e[1] for e in entries], dim=1)[None]
        vals = torch.stack([e[2] for e in entries], dim=1)[None]
        keys, vals = repeat_kv(keys, attn.num_key_value_groups), repeat_kv(vals, attn.num_key_value_groups)
        probs = torch.softmax(q @ keys.transpose(-1, -2) * attn.scaling, dim=-1)
        out = (probs @ vals).transpose(1, 2).reshape(1, 1, -1)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))[0, -1]


@pytest.mark.parametrize("merge", ["position", "none"])
def test_compressed_decoding_matches_reference(merge):
    model = tiny_llama()
    ids = prompts([30])[0][None]
    n = ids.shape[1]
    profile = profile_with(model, RATIOS, merge=merge, sink_tokens=SINK, recent_window=RECENT, truncation_distance=DIST)
    steps = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(7)).tolist()

    with torch.no_grad():
        full = DynamicCache(config=model.config)
        model(input_ids=ids, **with_cache(model, full))
        importance = eager_importance(model, ids)
        entries, frozen = [], []
        for layer, ratio in enumerate(RATIOS):
            keep = math.ceil(ratio * n - 1e-9)
            anchors = brute_force_anchors(importance[layer], keep)
            kv = full.layers[layer]
            entries.append(reference_entries(kv.keys, kv.values, anchors, merge))
            frozen.append(max(keep - DIST, min(SINK, keep)))

        with attach(model, profile) as handle:
            cache = handle.new_cache()
            model(input_ids=ids, **with_cache(model, cache))
            for step, token in enumerate(steps):
                seen = n + step + 1
                got = model(input_ids=torch.tensor([[token]]), **with_cache(model, cache)).logits[0, -1]
                want = reference_step(model, entries, token, position=n + step)
                assert (got - want).abs().max().item() < 1e-6, f"step {step}"
                for layer, ratio in enumerate(RATIOS):
                    if len(entries[layer]) > math.ceil(ratio * seen - 1e-9):
                        entries[layer].pop(frozen[layer])  # fixed point: oldest entry after the frozen prefix
                    assert int(cache.layers[layer].kept[0]) == len(entries[layer])
