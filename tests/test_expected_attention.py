"""The expected-attention scorer against a float64 brute force, and against a real model's attention:
with the statistics of one known query (its mean, zero covariance, one future position) it is that
query's attention, so the tap, RoPE's pairing, its base per layer type and the logit scale are right.
TriAttention's score against a brute force in complex numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.models.queries import future_rotations, output_grams, query_taps
from kvtool.runtime.importance import LayerQueries, expected_scores
from kvtool.runtime.importance.expected import expected_output_scores
from tiny_models import prompts, tiny_gemma3, tiny_llama


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The D x D matrix of x -> x*cos + rotate_half(x)*sin."""
    dim = cos.shape[-1]
    half = dim // 2
    turn = torch.zeros(dim, dim, dtype=torch.float64)
    turn[:half, half:] = -torch.eye(half, dtype=torch.float64)  # rotate_half: first half gets -x2
    turn[half:, :half] = torch.eye(half, dtype=torch.float64)
    return torch.diag(cos) + torch.diag(sin) @ turn


def brute_force(keys, values, valid, mean, cov, rotation, future, out_proj=None, starts=None):
    """Per query head q: its softmax over the prompt of the Gaussian's expected logits, times each
    value's weight relative to the row's mean, the weight ‖v‖ or, with `out_proj` (o_proj's weight),
    ‖W_q v‖; summed into the KV head over its query heads / their count. The future queries sit at
    the positions after `starts[b]` (default: the row's valid count, a prompt's length)."""
    bsz, kv_heads, n, dim = keys.shape
    heads = mean.shape[0]
    out = torch.zeros(bsz, kv_heads, n, dtype=torch.float64)
    for b in range(bsz):
        start = int(valid[b].sum()) if starts is None else int(starts[b])
        positions = torch.arange(start, start + future)[None]
        cos, sin = rotation.rotary(torch.zeros(1), positions, *(() if rotation.layer_type is None else (rotation.layer_type,)))
        turn = sum(rotation_matrix(cos[0, t].double(), sin[0, t].double()) for t in range(future)) / future
        real = [j for j in range(n) if valid[b, j]]
        for q in range(heads):
            h = q // (heads // kv_heads)
            written = lambda v: v.double().norm() if out_proj is None else (out_proj[:, q * dim : (q + 1) * dim].double() @ v.double()).norm()  # noqa: E731
            norms = {h: torch.stack([written(values[b, h, j]) for j in real])}
            mu, sigma = turn @ mean[q].double(), turn @ cov[q].double() @ turn.T
            s = rotation.scaling
            logits = torch.stack([s * mu @ keys[b, h, j].double() + s * s / 2 * keys[b, h, j].double() @ sigma @ keys[b, h, j].double() for j in real])
            probs = torch.softmax(logits, dim=0)
            out[b, h, real] += probs / (heads // kv_heads) * norms[h] / norms[h].mean()
    return out


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_expected_scores_match_a_float64_brute_force(make):
    model = make()
    layer = next(i for i, t in enumerate(getattr(model.config, "layer_types", None) or ["full_attention"] * 3) if t == "full_attention")
    rotation = future_rotations(model)[layer]
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, model.model.layers[layer].self_attn.head_dim
    keys = torch.randn(2, kv_heads, 9, dim, generator=g, dtype=torch.float64)
    values = torch.randn(2, kv_heads, 9, dim, generator=g, dtype=torch.float64)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    mean = torch.randn(heads, dim, generator=g, dtype=torch.float64)
    root = torch.randn(heads, dim, dim, generator=g, dtype=torch.float64) / dim
    cov = root @ root.transpose(-1, -2)
    queries = LayerQueries(mean, cov, rotation, future=5)
    got = expected_scores(keys, values, valid, queries)
    want = brute_force(keys, values, valid, mean, cov, rotation, 5)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert bool((got[1, :, :3] == 0).all())
    assert float(got.max()) <= 9  # at most n: selection's protected classes rank above it
    # Weighted by what each query head writes through its slice of the output projection instead.
    out_proj = model.model.layers[layer].self_attn.o_proj.weight
    written = expected_output_scores(keys, values, valid, LayerQueries(mean, cov, rotation, 5, output_grams(model)[layer]))
    torch.testing.assert_close(written, brute_force(keys, values, valid, mean, cov, rotation, 5, out_proj), rtol=1e-9, atol=1e-12)
    assert bool((written[1, :, :3] == 0).all()) and float(written.max()) <= 9
    assert not torch.allclose(written, got)  # the output projection turns values of equal norm apart


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_one_known_query_gives_its_own_attention(make):
    model = make()
    model.set_attn_implementation("eager")
    config = model.config
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layers = [i for i, t in enumerate(types) if t == "full_attention"]
    (tokens,) = prompts([12])
    captured = {}
    taps = query_taps(model)
    hooks = [
        taps[i].module.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, taps[i].shape(out, 12)))
        for i in layers
    ]
    try:
        with torch.no_grad():
            out = model(tokens[None], output_attentions=True, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    rotations = future_rotations(model)
    cache = out.past_key_values
    for i in layers:
        # Keys of the first 11 tokens; the 12th token's query is the "future" one at position 11.
        keys, values = cache.layers[i].keys[:, :, :11], cache.layers[i].values[:, :, :11]
        query = captured[i][0, 11]  # [Hq, D], pre-RoPE
        heads = query.shape[0]
        queries = LayerQueries(query, torch.zeros(heads, query.shape[1], query.shape[1], dtype=query.dtype), rotations[i], future=1)
        got = expected_scores(keys, values, torch.ones(1, 11, dtype=torch.bool), queries)
        attention = out.attentions[i][0, :, 11, :11].double()  # [Hq, 11]
        attention = attention / attention.sum(dim=-1, keepdim=True)  # over the prompt's columns, as the scorer
        kv_heads = keys.shape[1]
        expected = attention.view(kv_heads, heads // kv_heads, 11).mean(dim=1)
        norm = values[0].double().norm(dim=-1)
        torch.testing.assert_close(got[0], expected * norm / norm.mean(dim=-1, keepdim=True), rtol=1e-7, atol=1e-10)


def brute_force_triattention(keys, valid, mean, pair_norm, rotation, starts=None):
    """TriAttention per query head, in complex numbers: pair f of a head is the complex number
    x_i + j·x_{i+D/2}; a query at position P turns the centre by e^{j·ω_f·P} (angle and length read
    off the rotary module at P), so the series is Re(q̄_f e^{jω_f P} conj(k_f)) summed over f and
    averaged over P = start - 1 + 2^t (t = 0 ... 16), plus Σ_f (E|q_f| - |q̄_f|)|k_f|; the logit scale
    times that is softmaxed over the valid keys and averaged over the KV head's query heads."""
    bsz, kv_heads, n, dim = keys.shape
    heads, half = mean.shape[0], dim // 2
    out = torch.zeros(bsz, kv_heads, n, dtype=torch.float64)
    for b in range(bsz):
        start = int(valid[b].sum()) if starts is None else int(starts[b])
        positions = torch.tensor([[start - 1 + 2**t for t in range(17)]])
        cos, sin = rotation.rotary(torch.zeros(1), positions, *(() if rotation.layer_type is None else (rotation.layer_type,)))
        turns = torch.complex(cos[0, :, :half].double(), sin[0, :, :half].double())  # [17, D/2]
        real = [j for j in range(n) if valid[b, j]]
        for q in range(heads):
            h = q // (heads // kv_heads)
            centre = torch.complex(mean[q, :half].double(), mean[q, half:].double())
            logits = []
            for j in real:
                key = torch.complex(keys[b, h, j, :half].double(), keys[b, h, j, half:].double())
                series = torch.stack([(centre * turn * key.conj()).real.sum() for turn in turns]).mean()
                norm = ((pair_norm[q].double() - centre.abs()) * key.abs()).sum()
                logits.append(rotation.scaling * (series + norm))
            out[b, h, real] += torch.softmax(torch.stack(logits), dim=0) / (heads // kv_heads)
    return out


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_triattention_scores_match_a_float64_brute_force(make):
    from kvtool.runtime.importance.triattention import triattention_probs

    model = make()
    layer = next(i for i, t in enumerate(getattr(model.config, "layer_types", None) or ["full_attention"] * 3) if t == "full_attention")
    rotation = future_rotations(model)[layer]
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, model.model.layers[layer].self_attn.head_dim
    keys = torch.randn(2, kv_heads, 9, dim, generator=g, dtype=torch.float64)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    mean = torch.randn(heads, dim, generator=g, dtype=torch.float64)
    centre_norm = torch.hypot(mean[:, : dim // 2], mean[:, dim // 2 :])
    pair_norm = centre_norm + torch.rand(heads, dim // 2, generator=g, dtype=torch.float64)  # E|q_f| >= |E q_f|
    queries = LayerQueries(mean, torch.zeros(heads, dim, dim, dtype=torch.float64), rotation, future=5, pair_norm=pair_norm)
    got = triattention_probs(keys, valid, queries)
    torch.testing.assert_close(got, brute_force_triattention(keys, valid, mean, pair_norm, rotation), rtol=1e-9, atol=1e-12)
    assert bool((got[1, :, :3] == 0).all()) and float(got.max()) <= 1
    # From another position (a generation step's): the series moves with the distance.
    starts = torch.tensor([40, 23])
    moved = triattention_probs(keys, valid, queries, start=starts)
    torch.testing.assert_close(moved, brute_force_triattention(keys, valid, mean, pair_norm, rotation, starts), rtol=1e-9, atol=1e-12)
    assert not torch.allclose(moved, got)
    # Without the norm term the ranking changes: it is part of the score.
    plain = triattention_probs(keys, valid, dataclasses.replace(queries, pair_norm=centre_norm))
    assert not torch.allclose(plain, got)


def test_triattention_without_pair_norms_is_a_one_line_error():
    from kvtool.errors import KvtoolError
    from kvtool.runtime.importance.triattention import triattention_probs

    model = tiny_llama()
    rotation = future_rotations(model)[0]
    heads, dim = model.config.num_attention_heads, model.config.head_dim
    queries = LayerQueries(torch.zeros(heads, dim), torch.zeros(heads, dim, dim), rotation, future=5)
    with pytest.raises(KvtoolError, match="per-frequency query norms"):
        triattention_probs(torch.zeros(1, model.config.num_key_value_heads, 4, dim), torch.ones(1, 4, dtype=torch.bool), queries)


def test_with_expected_adds_only_the_named_scores():
    """A profile ranking by one query scorer gets that score alone (the expected softmax and its
    covariance form run only for the scores that read them), each equal to its own function."""
    from kvtool.runtime.importance.queried import QUERY_FIELDS, added, with_expected
    from kvtool.runtime.importance.scores import PromptScores
    from kvtool.runtime.importance.triattention import triattention_probs

    model = tiny_llama()
    rotation = future_rotations(model)[0]
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    keys = torch.randn(2, kv_heads, 6, dim, generator=g, dtype=torch.float64)
    values = torch.randn(2, kv_heads, 6, dim, generator=g, dtype=torch.float64)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, :2] = False
    mean = torch.randn(heads, dim, generator=g, dtype=torch.float64)
    pair_norm = torch.hypot(mean[:, : dim // 2], mean[:, dim // 2 :]) + 0.5
    queries = LayerQueries(mean, 0.1 * torch.eye(dim, dtype=torch.float64).expand(heads, dim, dim), rotation, future=4,
                           output=torch.eye(dim, dtype=torch.float64).expand(heads, dim, dim), pair_norm=pair_norm)
    base = PromptScores(importance=torch.zeros(2, 6, dtype=torch.float64))
    direct = {
        "expected": expected_scores(keys, values, valid, queries),
        "expected_output": expected_output_scores(keys, values, valid, queries),
        "triattention": triattention_probs(keys, valid, queries),
    }
    assert not added(base)
    for name in QUERY_FIELDS:
        got = with_expected(base, keys, values, valid, queries, (name,))
        assert added(got)
        for other in QUERY_FIELDS:
            if other == name:
                torch.testing.assert_close(getattr(got, other), direct[other], rtol=0, atol=0)
            else:
                assert getattr(got, other) is None
    every = with_expected(base, keys, values, valid, queries, QUERY_FIELDS)
    for name in QUERY_FIELDS:
        torch.testing.assert_close(getattr(every, name), direct[name], rtol=0, atol=0)
