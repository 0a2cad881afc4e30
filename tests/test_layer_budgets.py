"""benchmarks/layer_budgets.py, the measured-loss layer allocation probe: its cached masked forward
against head_budgets' one-forward one (itself checked against a float64 loop in
test_head_budgets.py). Its allocation is kvtool's (tests/test_layer_loss.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from kvtool.models.forward import with_cache
from tiny_models import prompts, tiny_llama

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probes():
    added = [p for p in [str(BENCHMARKS)] if p not in sys.path]
    sys.path[:0] = added
    try:
        heads = _load("head_budgets")
        layers = _load("layer_budgets")
    finally:
        for p in added:
            sys.path.remove(p)
        sys.modules.pop("head_budgets", None)
        sys.modules.pop("layer_budgets", None)
    return heads, layers


def test_cached_masked_reference_matches_the_one_forward_probe(probes):
    heads, probe = probes
    model = tiny_llama()
    ids = prompts([18])[0].tolist()
    n, ref = 12, ids[12:]
    one = heads.Probe()
    cached = probe.CachedProbe()
    AttentionInterface.register("layer_budgets_test_one", one)
    AttentionInterface.register("layer_budgets_test_cached", cached)
    try:
        model.set_attn_implementation("layer_budgets_test_one")
        one.mode, one.prompt_len = "score", n
        model(torch.tensor([ids[:n]]))
        model.set_attn_implementation("layer_budgets_test_cached")
        cached.mode, cached.prompt_len = "score", n
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:n]]), use_cache=True, **with_cache(model, cache))
        for layer in one.scores:
            for name in ("attention-sum", "window"):
                torch.testing.assert_close(cached.scores[layer][name], one.scores[layer][name])

        def one_forward(keep):
            model.set_attn_implementation("layer_budgets_test_one")
            one.mode = "mask"
            one.keep = {layer: keep.get(layer, torch.ones_like(s["window"], dtype=torch.bool)) for layer, s in one.scores.items()}
            logits = model(torch.tensor([ids])).logits[0, n:-1].double()
            model.set_attn_implementation("layer_budgets_test_cached")
            target = torch.tensor(ids[n + 1 :])
            return float(-torch.log_softmax(logits, dim=-1).gather(1, target[:, None]).mean())

        full = probe.reference_nll(model, cached, cache, ref, {})
        plain = model(torch.tensor([ids])).logits[0, n:-1]
        assert full == pytest.approx(float(-torch.log_softmax(plain, -1).gather(1, torch.tensor(ids[n + 1 :])[:, None]).mean()), abs=1e-9)
        for layer_ratios in ({1: 0.5}, {0: 0.3, 2: 0.6}):
            keep = probe.layer_masks(cached.scores, layer_ratios, n)
            for layer, mask in keep.items():
                assert int(mask.sum()) == mask.shape[0] * int(np.ceil(layer_ratios[layer] * n))
            got = probe.reference_nll(model, cached, cache, ref, keep)
            assert got == pytest.approx(one_forward(keep), abs=1e-9)
            assert got != pytest.approx(full, abs=1e-6)
            assert cache.get_seq_length() == n  # cut back to the prompt
    finally:
        model.set_attn_implementation("sdpa")
