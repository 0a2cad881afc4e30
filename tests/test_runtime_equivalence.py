"""Budget 1.0 is the unmodified model; a padded batch is exactly its sequences run alone."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvtool.errors import KvtoolError
from kvtool.runtime import KvtoolCache, attach, uniform_profile
from kvtool.runtime.layer import CompressingLayer
from kvtool.models.forward import with_cache
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_gemma3, tiny_llama

NEW = 24


def max_score_diff(a, b, row_a=slice(None), row_b=slice(None)) -> float:
    return max((x[row_a] - y[row_b]).abs().max().item() for x, y in zip(a.scores, b.scores))


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.mark.parametrize("lengths", [[40], [40, 23, 31]])
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama-gqa", "gemma3-hybrid"])
def test_budget_one_equals_unmodified(build, lengths):
    model = build()
    inputs = left_pad(prompts(lengths))
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max_score_diff(ref, out) < 1e-6


@pytest.mark.parametrize("merge", ["position", "none"])
@pytest.mark.parametrize("budget", [0.2, 0.5])
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama-gqa", "gemma3-hybrid"])
def test_padded_batch_equals_single_runs(build, budget, merge):
    model = build()
    seqs = prompts([61, 37, 50])
    profile = profile_with(model, budget, merge=merge, sink_tokens=2, recent_window=3, truncation_distance=5)
    with torch.no_grad(), attach(model, profile) as handle:
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            alone = single.sequences[0, len(seq):]  # may stop early at EOS; the batch pads after it
            assert torch.equal(alone, batch.sequences[i, -NEW:][: len(alone)]), f"sequence {i}"
            assert max_score_diff(single, batch, 0, i) < 1e-6


def test_gemma3_sliding_layers_are_windows_below_budget_one():
    """At 1.0 the sliding layers stay transformers' own; below it each keeps a window of its share
    (tests/test_hybrid.py checks those windows against brute force)."""
    model = tiny_gemma3()
    with attach(model, uniform_profile(model, 1.0)) as handle:
        kinds = [type(layer) for layer in handle.new_cache().layers]
    assert kinds == [DynamicSlidingWindowLayer, CompressingLayer, DynamicSlidingWindowLayer, CompressingLayer]
    with attach(model, uniform_profile(model, 0.3)) as handle:
        cache = handle.new_cache()
    assert all(isinstance(layer, CompressingLayer) for layer in cache.layers)
    assert [layer.plan.cap for layer in cache.layers] == [3, None, 3, None]  # ceil(0.3 * 7) of the 7 it stores


def test_forward_without_kvtool_cache_is_sdpa(llama):
    inputs = left_pad(prompts([30, 18]))
    with torch.no_grad():
        before = llama(**inputs).logits
        with attach(llama, uniform_profile(llama, 0.2)):
            during = llama(**inputs).logits
        after = llama(**inputs).logits
    assert torch.equal(before, during) and torch.equal(before, after)
    assert llama.config._attn_implementation == "sdpa"


def test_profile_for_another_model_is_refused(llama):
    other = tiny_gemma3()
    with pytest.raises(KvtoolError) as err:
        attach(llama, uniform_profile(other, 0.5))
    message = str(err.value)
    assert "\n" not in message and "num_layers" in message


def test_new_cache_is_kvtool_cache(llama):
    with attach(llama, uniform_profile(llama, 0.5)) as handle:
        assert isinstance(handle.new_cache(), KvtoolCache)
    with pytest.raises(KvtoolError):
        handle.new_cache()


@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5, float("nan")])
def test_uniform_profile_rejects_bad_budget(llama, budget):
    with pytest.raises(KvtoolError):
        uniform_profile(llama, budget)
