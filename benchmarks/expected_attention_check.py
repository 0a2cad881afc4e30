"""Expected Attention on a real model, checked against the model's own attention.

With the statistics of one known query (its pre-RoPE value as the mean, zero covariance, one future
position) the expected-attention score of every prompt key is that query's real attention times the
relative value norm. This runs the model eagerly over a short prompt and compares, per full-attention
layer: the tap, RoPE's pairing and base per layer type, and the logit scale on the real config.

    .venv/bin/python benchmarks/expected_attention_check.py gemma3-270m
"""

from __future__ import annotations

import sys

import torch

from kvtool.models import load_model, use_offline_defaults
from kvtool.models.queries import future_rotations, query_taps
from kvtool.runtime.importance import LayerQueries, expected_scores


def main(spec: str) -> float:
    use_offline_defaults()
    loaded = load_model(spec)
    model = loaded.model
    model.set_attn_implementation("eager")
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt").input_ids
    n = ids.shape[1]
    text = model.config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    layers = [i for i in range(text.num_hidden_layers) if not types or types[i] == "full_attention"]
    taps, captured = query_taps(model), {}
    hooks = [taps[i].module.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(i, taps[i].shape(o, n))) for i in layers]
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    rotations = future_rotations(model)
    worst = 0.0
    for i in layers:
        cache = out.past_key_values.layers[i]
        keys, values = cache.keys[:, :, : n - 1], cache.values[:, :, : n - 1]
        query = captured[i][0, n - 1].float()  # the last token's query: "the future" of the first n - 1
        heads, dim = query.shape
        got = expected_scores(keys, values, torch.ones(1, n - 1, dtype=torch.bool), LayerQueries(query, torch.zeros(heads, dim, dim), rotations[i], 1))
        attention = out.attentions[i][0, :, n - 1, : n - 1].float()
        attention = attention / attention.sum(-1, keepdim=True)
        kv = keys.shape[1]
        norm = values[0].float().norm(dim=-1)
        want = attention.view(kv, heads // kv, n - 1).mean(1) * norm / norm.mean(-1, keepdim=True)
        error = float((got[0] - want).abs().max())
        worst = max(worst, error)
        print(f"layer {i:2d} ({rotations[i].layer_type or 'rope'}, scale {rotations[i].scaling:g}): max |error| {error:.2e} of scores up to {float(want.max()):.3f}")
    print(f"{spec}: worst {worst:.2e} over {len(layers)} layers, {n - 1} keys")
    return worst


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
