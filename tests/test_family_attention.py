"""Attention that is not plain softmax: Gemma 2's logit soft-capping and gpt-oss's learned sink logits.

Every path kvtool computes probabilities on (the prompt pass's CPU and portable paths, a decode step,
the observation window, the expected-attention estimate, the Triton kernels in the interpreter) is
checked against a float64 brute force that soft-caps and appends the sink column as the models do;
the uncompressed attention against the models' own eager functions; and whole models: budget 1.0
generates what the unmodified model generates, a padded batch at 0.5 what each sequence alone does,
and a calibration at 0.2 writes a profile that applies (the default recipe search too, with
KVTOOL_FULL_FAMILIES=1: about 100 s).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtool.models.forward import with_cache
from kvtool.profiles import MethodSettings
from kvtool.profiles.fingerprint import SLIDING_ATTENTION
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.importance import ScoreRequest, attention_with_scores, chunked, decode_attention_with_scores
from kvtool.runtime.importance.logits import LogitScale, dense_attention, expected_capped
from kvtool.runtime.importance.window import window_sums
from kvtool.runtime.kernels import triton_scores
from tiny_models import GREEDY, left_pad, prompts, tiny_gemma2, tiny_gpt_oss

FAMILIES = {"softcap": dict(softcap=1.5), "sinks": dict(sinks=True), "both": dict(softcap=1.5, sinks=True)}


def scale_for(family: str, heads: int = 4, seed: int = 0) -> LogitScale:
    spec = FAMILIES[family]
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64) * 2 if spec.get("sinks") else None
    return LogitScale(0.5, spec.get("softcap"), sinks)


def brute(query, keys, values, allowed, scaling):
    """float64, the whole map: logits scaled, soft-capped, masked; the sinks a last column, dropped after."""
    groups = query.shape[1] // keys.shape[1]
    q, k, v = query.double(), keys.double().repeat_interleave(groups, 1), values.double().repeat_interleave(groups, 1)
    logits = q @ k.transpose(-1, -2) * float(scaling)
    if scaling.softcap is not None:
        logits = scaling.softcap * torch.tanh(logits / scaling.softcap)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if scaling.sinks is not None:
        sink = scaling.sinks.double().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    probs = probs.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    return (probs @ v).transpose(1, 2), probs


def padded_prompt(bsz=2, heads=4, kv=2, n=23, dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(bsz, h, n, dim, generator=g, dtype=dtype) * 2 for h in (heads, kv, kv))
    starts = torch.tensor([0, 6][:bsz])
    idx = torch.arange(n)
    real = idx[None, :] >= starts[:, None]
    allowed = (real[:, None, :, None] & real[:, None, None, :] & (idx[None, :] <= idx[:, None]))  # [B, 1, n, n]
    return q, k, v, starts, real, allowed


def column_sums(probs, real, kv, window):
    bsz, heads, n, _ = probs.shape
    per_head = probs.sum(dim=2).view(bsz, kv, heads // kv, n)
    in_window = real & (torch.arange(n)[None, :] >= n - window)
    windowed = (probs * in_window[:, None, :, None]).sum(dim=2).view(bsz, kv, heads // kv, n)
    return per_head.sum(dim=(1, 2)) / heads, per_head.mean(dim=2), windowed.mean(dim=2)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("path", ["cpu", "chunked"])
def test_prompt_pass_matches_brute_force(family, path):
    q, k, v, _, real, allowed = padded_prompt()
    scaling = scale_for(family)
    request = ScoreRequest(heads=True, window=5)
    if path == "cpu":
        out, scores = attention_with_scores(q, k, v, allowed, scaling, request)
    else:
        out, scores = chunked.chunked_scores(q, k, v, allowed, scaling, 3 * 4 * 23, request)  # many chunks
    ref_out, probs = brute(q, k, v, allowed, scaling)
    importance, heads, window = column_sums(probs, real, 2, 5)
    rows = real[:, :, None, None].expand_as(out)
    torch.testing.assert_close(out[rows], ref_out[rows], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scores.importance, importance, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scores.heads, heads, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scores.window, window, rtol=1e-10, atol=1e-12)
    if family != "softcap":  # the sinks take their share: a column sum over n rows stays below n
        assert float(scores.importance.sum(dim=1).max()) < real.sum(dim=1).max().item() - 0.1


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("per_head", [False, True])
def test_decode_step_matches_brute_force(family, per_head):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    valid = torch.rand(2, 11, generator=g) > 0.3
    mask = valid[:, None, None, :]
    scaling = scale_for(family)
    out, received = decode_attention_with_scores(q, k, v, mask, scaling, per_head=per_head)
    ref_out, probs = brute(q, k, v, mask, scaling)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    expected = probs[:, :, 0].view(2, 2, 2, 11).mean(dim=2) if per_head else probs[:, :, 0].mean(dim=1)
    torch.testing.assert_close(received, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_observation_window_matches_brute_force(family):
    q, k, _, _, real, allowed = padded_prompt()
    scaling = scale_for(family)
    _, probs = brute(q, k, k, allowed, scaling)
    torch.testing.assert_close(window_sums(q[:, :, -9:], k, real, scaling, 4), column_sums(probs, real, 2, 4)[2])


def _models_eager(family: str):
    if family == "softcap":
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    return eager_attention_forward


@pytest.mark.parametrize("family", ["softcap", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uncompressed_attention_is_the_models_own_eager_attention(family, dtype):
    """What budget 1.0 runs is the model's own arithmetic, bit for bit on the rows that are real."""
    q, k, v, _, real, allowed = padded_prompt(dtype=dtype)
    scaling = scale_for(family)
    if scaling.sinks is not None:
        scaling = LogitScale(0.5, None, scaling.sinks.to(dtype))
    module = SimpleNamespace(num_key_value_groups=2, head_dim=8, training=False, sinks=scaling.sinks)
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    theirs, _ = _models_eager(family)(module, q, k, v, additive, scaling=float(scaling), softcap=scaling.softcap)
    ours = dense_attention(q, k, v, allowed, scaling)
    rows = real[:, :, None, None].expand_as(ours)
    assert torch.equal(ours[rows], theirs[rows])


def test_expected_attention_soft_caps_the_gaussian_logit():
    g = torch.Generator().manual_seed(0)
    mean, variance = torch.randn(5, generator=g, dtype=torch.float64) * 3, torch.rand(5, generator=g, dtype=torch.float64) * 4
    # No cap: the moment generating function; a cap far above every logit changes nothing.
    assert torch.allclose(expected_capped(mean, variance, 0.5), mean + variance / 2)
    torch.testing.assert_close(expected_capped(mean, variance, LogitScale(0.5, 1e4)), mean + variance / 2, rtol=1e-6, atol=1e-6)
    # A tight cap: log E[exp(c tanh(x / c))] against a fine trapezoid over ±12 standard deviations.
    cap = 1.5
    x = mean[:, None] + variance.sqrt()[:, None] * torch.linspace(-12, 12, 20001, dtype=torch.float64)[None]
    density = torch.exp(-((x - mean[:, None]) ** 2) / (2 * variance[:, None])) / torch.sqrt(2 * math.pi * variance[:, None])
    integral = torch.trapezoid(density * torch.exp(cap * torch.tanh(x / cap)), x, dim=1).log()
    torch.testing.assert_close(expected_capped(mean, variance, LogitScale(0.5, cap)), integral, rtol=1e-5, atol=1e-5)
    assert bool((integral <= cap).all())


@pytest.fixture()
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("family,padded", [("softcap", True), ("sinks", True), ("both", True), ("both", False)])
def test_triton_prompt_kernels_match_brute_force(interpreter, family, padded):
    q, k, v, starts, real, allowed = padded_prompt(n=37, dim=16, dtype=torch.float32, seed=2)
    if not padded:
        starts, real = torch.zeros(2, dtype=torch.long), torch.ones_like(real)
        allowed = torch.ones_like(allowed).tril()
    scaling = scale_for(family)
    # Unpadded prompts would take torch's fused forward, which neither soft-caps nor counts sinks.
    out, scores = triton_scores.attention_with_scores_triton(q, k, v, starts, scaling, heads=True, window=5, forward="sdpa")
    ref_out, probs = brute(q, k, v, allowed, scaling)
    importance, heads, window = column_sums(probs, real, 2, 5)
    rows = real[:, :, None, None].expand_as(out)
    torch.testing.assert_close(out[rows].double(), ref_out[rows], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores.importance.double(), importance, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores.heads.double(), heads, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores.window.double(), window, rtol=1e-4, atol=1e-5)
    ref = triton_scores.reference_scores(q, k, v, starts, scaling, heads=True, window=5)
    torch.testing.assert_close(ref[1].importance, importance)


MAKERS = {"gemma2": tiny_gemma2, "gpt-oss": tiny_gpt_oss}
NEW = 10


@pytest.fixture(scope="module", params=list(MAKERS))
def family_model(request):
    return request.param, MAKERS[request.param]()


def test_the_family_runs_its_own_attention(family_model):
    name, model = family_model
    text = model.config.get_text_config(decoder=True)
    if name == "gemma2":
        assert text.attn_logit_softcapping == 2.0
    else:
        assert float(model.model.layers[0].self_attn.sinks.detach().abs().max()) > 0.5
    assert SLIDING_ATTENTION in text.layer_types


def test_budget_one_generates_what_the_model_generates(family_model):
    _, model = family_model
    inputs = left_pad(prompts([40, 23, 31]))
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, out.scores)) < 1e-5  # float32 rounding (slot order)


RECIPES = {
    "attention-sum": MethodSettings(),
    "window scorer, tova": MethodSettings(scorer="window", window=4, pool=3, eviction="tova"),
    "union, per-head heavy-hitter": MethodSettings(scorer="union", window=4, pool=3, heads="per-head", eviction="heavy-hitter"),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_padded_batch_at_half_equals_each_sequence_alone(family_model, recipe):
    _, model = family_model
    seqs = prompts([41, 17, 30], seed=4)
    with torch.no_grad(), attach(model, uniform_profile(model, 0.5, RECIPES[recipe])) as handle:
        cache = handle.new_cache()
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        for layer in cache.compressing_layers().values():
            if layer.plan.native_window is None:
                assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            assert torch.equal(single.sequences[0, len(seq):], batch.sequences[i, -NEW:]), f"sequence {i}"


def test_the_prompt_forward_at_half_is_the_models_own(family_model):
    """Compression starts after the prompt's attention: the prompt forward's logits are the model's."""
    _, model = family_model
    inputs = left_pad(prompts([30, 19], seed=6))
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**inputs).logits
        with attach(model, uniform_profile(model, 0.5)) as handle:
            out = model(**inputs, **with_cache(model, handle.new_cache())).logits
    torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-5)


def test_the_fused_decode_step_soft_caps_and_counts_sinks(family_model, monkeypatch):
    """triton_step's four kernels against the eager fixed-slot step (whose attention the decode test
    above checks by brute force): the same tokens and logits within float32 rounding; the same kernels
    told the attention is plain decode something measurably else."""
    from kvtool.runtime.settings import use_settings
    from kvtool.runtime.kernels import triton_step
    from test_fixed_slots import RECIPES as FIXED_RECIPES, _decode, _prompt

    pytest.importorskip("triton")
    _, model = family_model
    profile = uniform_profile(model, 0.3, FIXED_RECIPES["shipped: heavy-hitter, per-head, union"])
    prompt = _prompt([20, 11])
    calls = []
    step = triton_step.decode_step
    monkeypatch.setattr(triton_step, "decode_step", lambda *args: calls.append(1) or step(*args))
    eager_tokens, eager_logits, _ = _decode(model, profile, prompt, "eager", steps=3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_step, "TARGET_PROGRAMS", 8)  # two splits a row: few programs to interpret
    with use_settings(fused_decode_step=True):
        tokens, logits, _ = _decode(model, profile, prompt, "fixed", steps=3)
        assert len(calls) == 3 * 2  # every step of both global layers went through the kernels
        assert torch.equal(tokens, eager_tokens)
        torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(triton_scores, "logit_terms", lambda scaling, heads, device: (0.0, 0.0, None))
        _, plain, _ = _decode(model, profile, prompt, "fixed", steps=1)
    assert float((plain - eager_logits[:1]).abs().max()) > 1e-3


def _calibrated(name: str, tmp_path, **settings):
    """`kvtool calibrate`'s work on the tiny model at budget 0.2 (the whole cache at 160 tokens),
    written to a profile file and read back as `attach` will."""
    from kvtool.runtime import load_profile
    from test_calibrate import loaded, word_prompts
    from kvtool.calibration.runner import calibrate

    out = tmp_path / f"{name}-b0.2.yaml"
    calibrate(loaded(MAKERS[name]()), 0.2, data=word_prompts(6), samples=4, budget_tokens=160, long_prompt_tokens=120,
              reference_tokens=6, out=out, **settings)
    return load_profile(out)


def _applies(profile, name: str) -> None:
    model = MAKERS[name]()
    assert profile.model.layer_types == tuple(model.config.layer_types)  # each layer's kind, recorded
    sliding = [layer for kind, layer in zip(profile.model.layer_types, profile.layers) if kind == SLIDING_ATTENTION]
    assert sliding and all(not layer.compress for layer in sliding)  # windows, as Gemma 3's
    inputs = left_pad(prompts([60, 41], seed=8))
    with torch.no_grad(), attach(model, profile) as handle:
        out = handle.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 66)


@pytest.mark.parametrize("name", list(MAKERS))
def test_calibration_writes_a_profile_that_applies(name, tmp_path):
    profile = _calibrated(name, tmp_path, candidates=(0,), search=None, draft=None)
    _applies(profile, name)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVTOOL_FULL_FAMILIES", "") in ("", "0"), reason="with KVTOOL_FULL_FAMILIES=1 (about 100 s)")
@pytest.mark.parametrize("name", list(MAKERS))
def test_the_default_search_calibrates_the_family(name, tmp_path):
    """The whole recipe search, expected-attention's soft-capped or sink-counting estimates included."""
    profile = _calibrated(name, tmp_path)
    assert len(profile.calibration.recipes) > 3
    _applies(profile, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expected_attention_is_the_layers_own_softmax(family):
    """The expected-attention probabilities of a soft-capping or sink layer: each query head's
    expected logits (capped by quadrature) in a softmax with the head's sink as one more column."""
    from kvtool.runtime.importance.expected import LayerQueries, expected_probs

    g = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) * 2
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False
    mean = torch.randn(4, 8, generator=g, dtype=torch.float64)
    root = torch.randn(4, 8, 8, generator=g, dtype=torch.float64) * 0.3
    scaling = scale_for(family)
    rotation = SimpleNamespace(scaling=scaling, mean=lambda start, span, dtype: (torch.ones(2, 8, dtype=dtype), torch.zeros(2, 8, dtype=dtype)))
    probs = expected_probs(keys, valid, LayerQueries(mean, root @ root.transpose(-1, -2), rotation, 1))
    key = keys.repeat_interleave(2, dim=1)
    centre = 0.5 * torch.einsum("bhnd,hd->bhn", key, mean)
    variance = 0.25 * torch.einsum("bhnd,hde,bhne->bhn", key, root @ root.transpose(-1, -2), key)
    logits = expected_capped(centre, variance, scaling).masked_fill(~valid[:, None, :], float("-inf"))
    if scaling.sinks is not None:
        column = scaling.sinks.view(1, 4, 1).expand(2, 4, 1)
        reference = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
        assert float(probs.sum(dim=-1).min()) < 1.0 - 1e-3  # the sinks take their share
    else:
        reference = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(probs, reference)
