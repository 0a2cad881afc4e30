"""The `measured` ratio source: the allocation by measured loss against a brute force, its re-budgeting,
and calibration's layer-loss measurement (`kvtool.calibration.layer_loss`) against independent
computations: the scores against eager attention's probabilities, the masked reference against
head_budgets' one-forward probe (itself checked against a float64 loop), the layer skip against a
whole forward, and nothing masked against the model's own logits."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AttentionInterface

from kvtool.calibration import layer_loss
from kvtool.calibration.layer_loss import WINDOW, POOL, _Attention, _Layers, keep_mask, measure_layer_losses, nll_per_token
from kvtool.errors import KvtoolError
from kvtool.profiles import MethodSettings
from kvtool.profiles.whole_cache import rebudget
from kvtool.profiles.loss_budget import clean_curves, interpolate, solve_by_loss
from kvtool.runtime.importance.union import rank_share
from tiny_models import left_pad, profile_with, prompts, tiny_gemma3, tiny_llama

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_allocation_is_the_least_loss_of_every_split():
    rng = np.random.default_rng(4)
    ratios = (0.1, 0.2, 0.4)
    grid = np.round(np.arange(0.1, 1.05, 0.1), 6)
    for _ in range(5):
        curves = clean_curves(rng.gamma(1.0, 1.0, size=(3, 3)) * rng.uniform(0.1, 3, size=(3, 1)))
        got = solve_by_loss(curves, ratios, budget=0.3, step=0.1)
        cost = lambda alloc: sum(interpolate(curves[i], ratios, np.array([r]))[0] for i, r in enumerate(alloc))  # noqa: E731
        splits = [s for s in itertools.product(grid, repeat=3) if abs(sum(s) - 0.9) < 1e-9]
        assert sum(got) == pytest.approx(0.9, abs=1e-9)
        assert cost(got) == pytest.approx(min(cost(s) for s in splits), abs=1e-12)


def test_allocation_holds_any_budget_exactly():
    curves = clean_curves(np.random.default_rng(0).uniform(0, 0.2, size=(7, 4)))
    for budget in (0.03, 0.05, 0.125, 0.2, 0.37, 1.0):
        got = solve_by_loss(curves, (0.05, 0.1, 0.2, 0.4), budget)
        assert got.mean() == pytest.approx(budget, abs=1e-12)
        assert got.min() >= min(0.05, budget) - 1e-12 and got.max() <= 1.0


def test_loss_curves_never_rise_with_the_ratio_and_stay_at_least_zero():
    curves = clean_curves(np.array([[0.5, 0.7, -0.1], [0.2, 0.1, 0.05]]))
    np.testing.assert_allclose(curves, [[0.7, 0.7, 0.0], [0.2, 0.1, 0.05]])


def _measured_profile(model, budget=0.3):
    curves = [(0.30, 0.10, 0.02), (0.01, 0.0, 0.0), (0.05, 0.04, 0.03)]
    profile = profile_with(model, budget)
    profile = dataclasses.replace(profile, method=dataclasses.replace(profile.method, ratios="measured"))
    layers = tuple(dataclasses.replace(layer, loss_curve=curve) for layer, curve in zip(profile.layers, curves))
    return dataclasses.replace(profile, layers=layers, loss_ratios=(0.1, 0.2, 0.4))


def test_a_measured_profile_rebudgets_from_its_loss_curves(tmp_path):
    from kvtool.profiles import read_profile, save_profile

    model = tiny_llama()
    profile = _measured_profile(model)
    save_profile(profile, tmp_path / "p.yaml")
    loaded = read_profile(tmp_path / "p.yaml")
    assert loaded.loss_ratios == (0.1, 0.2, 0.4) and loaded.layers[0].loss_curve == (0.3, 0.1, 0.02)
    for budget in (0.15, 0.3, 0.5):
        updated, _ = rebudget(loaded, budget)
        curves = np.array([layer.loss_curve for layer in loaded.layers])
        np.testing.assert_allclose(updated.ratios, solve_by_loss(curves, (0.1, 0.2, 0.4), budget))
        assert updated.ratios[0] > updated.ratios[1]  # the layer that loses most keeps most
    broken = dataclasses.replace(profile, loss_ratios=None)
    with pytest.raises(KvtoolError, match="measured loss"):
        rebudget(broken, 0.2)


def _load_head_budgets():
    spec = importlib.util.spec_from_file_location("head_budgets_for_layer_loss", BENCHMARKS / "head_budgets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _union(probs: torch.Tensor, group: int) -> torch.Tensor:
    """[Hkv, n] the union ranks from a layer's [1, Hq, n, n] probabilities (float64, by hand)."""
    n = probs.shape[-1]
    per_kv = probs[0].double().view(-1, group, n, n)
    sums = per_kv.sum(dim=2).mean(dim=1)
    window = per_kv[:, :, -WINDOW:, :].sum(dim=2).mean(dim=1)
    pooled = torch.stack([window[:, max(0, j - POOL // 2) : j + POOL // 2 + 1].max(dim=1).values for j in range(n)], dim=1)
    valid = torch.ones(1, n, dtype=torch.bool)
    return torch.maximum(rank_share(sums[None], valid), rank_share(pooled[None], valid))[0]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_masked_reference_matches_independent_computations(build):
    model = build()
    config = model.config
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    full_layers = [i for i, k in enumerate(kinds) if k == "full_attention"]
    windows = {i: config.sliding_window for i, k in enumerate(kinds) if k == "sliding_attention"}
    ids = prompts([26])[0]
    n, ref = 20, ids[20:]
    plain = model(ids[None]).logits[:, n:]
    model.set_attn_implementation("eager")
    eager = model(ids[None, :n], output_attentions=True).attentions
    attention = _Attention(full_layers, windows)
    AttentionInterface.register("layer_loss_test", attention)
    heads = _load_head_budgets()
    one = heads.Probe()
    AttentionInterface.register("layer_loss_test_one", one)
    runner = _Layers(model)
    try:
        torch.set_grad_enabled(False)
        model.set_attn_implementation("layer_loss_test")
        model(ids[None, :n], use_cache=False)
        group = config.num_attention_heads // config.num_key_value_heads
        for layer in full_layers:
            torch.testing.assert_close(attention.scores[layer].double(), _union(eager[layer], group))
        attention.mode, attention.keep = "mask", {}
        positions = torch.arange(n, len(ids))[None]
        whole = runner.record(input_ids=ref[None], position_ids=positions, use_cache=False)
        torch.testing.assert_close(whole, plain)  # nothing masked: the model's own logits, positions and windows
        for first in range(config.num_hidden_layers):
            torch.testing.assert_close(runner.from_layer(first), whole)
        method = MethodSettings(sink_tokens=2, recent_window=3)
        for layer in full_layers:
            keep = keep_mask(attention.scores[layer], 0.3, method)
            assert keep[:, :2].all() and keep[:, -3:].all() and int(keep.sum()) == keep.shape[0] * 6
            attention.keep = {layer: keep}
            skipped = runner.from_layer(layer)
            torch.testing.assert_close(skipped, runner.record(input_ids=ref[None], position_ids=positions, use_cache=False))
            if not windows:  # the one-forward probe knows no sliding windows
                model.set_attn_implementation("layer_loss_test_one")
                one.mode, one.prompt_len = "mask", n
                one.keep = {i: keep if i == layer else torch.ones_like(keep) for i in range(config.num_hidden_layers)}
                expected = model(ids[None]).logits[:, n:]
                model.set_attn_implementation("layer_loss_test")
                assert nll_per_token(skipped, ref) == pytest.approx(nll_per_token(expected, ref), abs=1e-9)
            assert nll_per_token(skipped, ref) != pytest.approx(nll_per_token(whole, ref), abs=1e-6)
            attention.keep = {}
            runner.record(input_ids=ref[None], position_ids=positions, use_cache=False)  # the unmasked inputs again
    finally:
        torch.set_grad_enabled(True)
        model.set_attn_implementation("sdpa")


@torch.no_grad()
def test_measurement_over_padded_batches_gives_each_layer_its_curve():
    model = tiny_llama()
    seqs = prompts([24, 30], seed=3)
    prompts_only = [s[:-6] for s in seqs]
    batch = SimpleNamespace(**left_pad(prompts_only), extras={})
    tokens = torch.stack([s[-6:] for s in seqs])
    scored = torch.ones_like(tokens, dtype=torch.bool)
    scored[0, 4:] = False  # a shorter reference: its scored tokens alone
    state = SimpleNamespace(batch=batch, references=SimpleNamespace(tokens=tokens, scored=scored))
    method = MethodSettings(sink_tokens=2, recent_window=3)
    losses = measure_layer_losses(model, [state], method, [0, 2], ratios=(0.2, 0.5), tokens=5)
    assert losses.deltas.shape == (2, 2, 2)
    assert model.config._attn_implementation == "sdpa"  # restored
    # Each delta is the masked reference's NLL minus the full one's, computed here without the layer skip.
    attention = _Attention([0, 2], {})
    AttentionInterface.register("layer_loss_test_again", attention)
    runner = _Layers(model)
    try:
        model.set_attn_implementation("layer_loss_test_again")
        for row, (prompt, seq) in enumerate(zip(prompts_only, seqs)):
            ref = seq[-6:][: 4 if row == 0 else 5]
            attention.mode = "score"
            model(prompt[None], use_cache=False)
            attention.mode, attention.keep = "mask", {}
            positions = torch.arange(len(prompt), len(prompt) + len(ref))[None]
            base = nll_per_token(runner.record(input_ids=ref[None], position_ids=positions, use_cache=False), ref)
            assert losses.full_nll[row] == pytest.approx(base, abs=1e-12)
            for j, layer in enumerate([0, 2]):
                for r, ratio in enumerate((0.2, 0.5)):
                    attention.keep = {layer: keep_mask(attention.scores[layer], ratio, method)}
                    got = nll_per_token(runner.record(input_ids=ref[None], position_ids=positions, use_cache=False), ref)
                    assert losses.deltas[row, j, r] == pytest.approx(got - base, abs=1e-9)
    finally:
        model.set_attn_implementation("sdpa")
    np.testing.assert_allclose(losses.curves, clean_curves(losses.deltas.mean(axis=0)))


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@torch.no_grad()
def test_nothing_masked_is_the_models_own_loss_with_soft_capping_and_sinks(family):
    """The measurement's attention is the model's: soft-capped logits (Gemma 2) and sink logits
    (gpt-oss) included, so with every column kept the reference's NLL is the model's own, and keeping
    fewer columns changes it."""
    import tiny_models

    model = getattr(tiny_models, f"tiny_{family}")()
    seq = prompts([30], seed=6)[0]
    prompt, ref = seq[:24], seq[24:]
    state = SimpleNamespace(
        batch=SimpleNamespace(**left_pad([prompt]), extras={}),
        references=SimpleNamespace(tokens=ref[None], scored=torch.ones(1, 6, dtype=torch.bool)),
    )
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    losses = measure_layer_losses(model, [state], MethodSettings(sink_tokens=1, recent_window=2), full, ratios=(0.2, 1.0), tokens=6)
    own = nll_per_token(model(seq[None]).logits[:, 24:], ref)
    assert losses.full_nll[0] == pytest.approx(own, abs=1e-5)
    assert np.abs(losses.deltas[0, :, -1]).max() < 1e-5  # ratio 1.0 keeps every column
    assert np.abs(losses.deltas[0, :, 0]).max() > 1e-4


def test_nll_per_token_matches_a_float64_log_softmax():
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 9, 5000, generator=generator)
    ref = torch.randint(0, 5000, (9,), generator=generator)
    expected = [
        float(-torch.log_softmax(logits[b, :-1].double(), dim=-1)[torch.arange(8), ref[1:]].mean()) for b in range(3)
    ]
    assert nll_per_token(logits, ref) == pytest.approx(expected, abs=1e-6)
    assert nll_per_token(logits[:1], ref) == pytest.approx(expected[0], abs=1e-6)


def test_text_models_only():
    assert layer_loss.measurable(tiny_llama()) is None


def test_inspect_gini_shows_each_layers_measured_loss(tmp_path, monkeypatch, capsys):
    import json

    from cli_runner import run
    from kvtool.profiles import save_profile

    profile = _measured_profile(tiny_llama())
    path = save_profile(profile, tmp_path / "p.yaml")
    code, stdout, stderr = run(monkeypatch, capsys, "inspect", "gini", str(path), "--json")
    assert code == 0, stderr
    losses = [layer["loss"] for layer in json.loads(stdout)["layers"]]
    # At ratio 0.3, halfway between the measured 0.2 and 0.4.
    assert losses == pytest.approx([0.06, 0.0, 0.035])
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(path))
    assert code == 0 and "Loss" in stdout and "+0.060" in stdout


def test_calibration_ships_ratios_from_measured_loss(tmp_path):
    from test_calibrate import FAST, loaded, word_prompts

    from kvtool.calibration.runner import calibrate
    from kvtool.profiles import read_profile

    model = loaded(tiny_llama(dtype=torch.float32, layers=3, seed=3))
    method = MethodSettings(ratios="measured")
    run = calibrate(model, 0.3, data=word_prompts(4), out=tmp_path / "p.yaml", samples=4, method=method, **FAST)
    profile = read_profile(tmp_path / "p.yaml")
    assert profile.method.ratios == "measured" and profile.loss_ratios == run.losses.ratios
    assert run.losses.deltas.shape == (4, 3, 4)  # every prompt, layer and ratio
    curves = np.array([layer.loss_curve for layer in profile.layers])
    np.testing.assert_allclose(curves, run.losses.curves, atol=1e-6)  # as written, 6 digits
    np.testing.assert_allclose(profile.ratios, solve_by_loss(run.losses.curves, run.losses.ratios, 0.3))
    assert np.mean(profile.ratios) == pytest.approx(0.3, abs=1e-9)
    at_half, _ = rebudget(profile, 0.5)
    np.testing.assert_allclose(at_half.ratios, solve_by_loss(curves, profile.loss_ratios, 0.5))
    with pytest.raises(KvtoolError, match="measured loss"):
        calibrate(model, 0.3, data=word_prompts(4), samples=4, method=method, **{**FAST, "candidates": ()})


def test_a_hybrid_model_measures_its_full_attention_layers_and_its_windows_rebudget_them():
    from test_calibrate import loaded, word_prompts

    from kvtool.calibration.runner import calibrate
    from kvtool.profiles import whole_cache

    gemma = tiny_gemma3(dtype=torch.float32)
    run = calibrate(
        loaded(gemma), 0.3, data=word_prompts(6), samples=4, budget_tokens=160, long_prompt_tokens=120,
        reference_tokens=6, candidates=(0,), draft=None, search=None, method=MethodSettings(ratios="measured"),
    )
    profile = run.profile
    assert run.losses.layers == (1, 3)  # the full-attention layers, the ones the ratios share
    full = [layer for layer in profile.layers if layer.compress]
    assert [layer.loss_curve is not None for layer in profile.layers] == [False, True, False, True]
    assert profile.method.ratios == "measured"
    assert whole_cache.shares(profile)["all"] == pytest.approx(0.3, abs=0.01)
    curves = np.array([layer.loss_curve for layer in full])
    share = np.mean([layer.ratio for layer in full])
    np.testing.assert_allclose([layer.ratio for layer in full], solve_by_loss(curves, profile.loss_ratios, share), atol=1e-9)


def test_no_reference_to_measure_on_is_a_one_line_error():
    tokens = torch.tensor([[5, 6]])
    state = SimpleNamespace(
        batch=SimpleNamespace(input_ids=torch.tensor([[7, 8, 9]]), attention_mask=torch.ones(1, 3), extras={}),
        references=SimpleNamespace(tokens=tokens, scored=torch.tensor([[True, False]])),
    )
    with pytest.raises(KvtoolError, match="2 tokens or more") as err:
        measure_layer_losses(tiny_llama(), [state], MethodSettings(), [0])
    assert "\n" not in str(err.value)
