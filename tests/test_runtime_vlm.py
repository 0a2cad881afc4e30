"""The runtime on vision-language models (LLaVA, Qwen2-VL, Gemma 3 with vision) and LOOK-M's text prior.

The same API as for text models: `attach(model, profile)`, `handle.new_cache()`,
`model.generate(**inputs, past_key_values=cache)` with `pixel_values` and whatever else the model
takes. The language model runs kvtool attention, the vision tower its own; the cache learns which
prompt positions are image tokens from the input ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kvtool.profiles import fingerprint_of
from kvtool.runtime import KvtoolCache, attach, method_profile, uniform_profile
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.selection import TopImportance, select_rule
from kvtool.models.forward import with_cache
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_llama
from tiny_vlms import BUILDERS, IMAGE_TOKEN

NEW = 10
NAMES = list(BUILDERS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread is fastest, and avoids oversubscription on a busy machine
    (two threads on two loaded cores made these tests ~50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=NAMES)
def vlm(request, one_thread):
    return BUILDERS[request.param]()


def max_score_diff(a, b, row_a=slice(None), row_b=slice(None)) -> float:
    return max((x[row_a] - y[row_b]).abs().max().item() for x, y in zip(a.scores, b.scores))


def with_method(profile, **settings):
    return dataclasses.replace(profile, method=dataclasses.replace(profile.method, **settings))


def lookm(model, budget: float, **settings):
    return with_method(method_profile("lookm", model, budget), **settings)


# ----- plumbing ------------------------------------------------------------------------------


def test_language_model_gets_kvtool_vision_tower_keeps_its_own(vlm):
    model = vlm.model
    config = model.config
    before = len(model._forward_pre_hooks)
    with attach(model, uniform_profile(model, 0.5)) as handle:
        assert config.get_text_config(decoder=True)._attn_implementation == "kvtool"
        assert config.vision_config._attn_implementation == "sdpa"
        assert len(model._forward_pre_hooks) == before + 1
        cache = handle.new_cache()
    assert config.get_text_config(decoder=True)._attn_implementation == "sdpa"
    assert len(model._forward_pre_hooks) == before  # detach removes the hook that hands the cache to the attention
    text = config.get_text_config(decoder=True)
    fingerprint = fingerprint_of(model)
    assert (fingerprint.num_layers, fingerprint.num_kv_heads, fingerprint.vocab_size) == (
        text.num_hidden_layers, text.num_key_value_heads, text.vocab_size)
    # Below budget 1.0 a sliding layer is a kvtool window of its share (tests/test_hybrid.py).
    assert all(isinstance(layer, CompressingLayer) for layer in cache.layers)
    windows = [layer.plan.cap is not None for layer in cache.layers]
    assert windows == [kind == "sliding_attention" for kind in fingerprint.layer_types]


def test_budget_one_equals_vanilla_generation(vlm):
    model = vlm.model
    inputs = vlm.batch([23, 12])
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max_score_diff(ref, out) < 1e-6


def test_compressing_prompt_forward_equals_vanilla_in_row_chunks(vlm, monkeypatch):
    """The prompt forward's output does not depend on the budget (compression follows each layer's
    attention), also when the scoring pass works in row chunks: Gemma 3's image tokens attend to the
    whole image block, later tokens included, so a chunk may not assume causality."""
    from kvtool.runtime.importance import chunked

    model = vlm.model
    inputs = vlm.batch([20, 9])
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 2 * 4 * 30 * 3)
    with torch.no_grad():
        ref = model(**inputs).logits
        with attach(model, uniform_profile(model, 0.5)) as handle:
            out = model(**inputs, **with_cache(model, handle.new_cache())).logits
    real = inputs["attention_mask"].bool()
    assert (ref - out)[real].abs().max().item() < 1e-10


@pytest.mark.parametrize("method", ["elastic", "lookm"])
def test_padded_batch_equals_single_runs(vlm, method):
    model = vlm.model
    lengths = [30, 17]
    profile = with_method(method_profile(method, model, 0.5), sink_tokens=2, recent_window=3, truncation_distance=5)
    with torch.no_grad(), attach(model, profile) as handle:
        batch = model.generate(**vlm.batch(lengths), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
        for i, n in enumerate(lengths):
            single = model.generate(**vlm.batch([n], seed=1 + i), max_new_tokens=NEW,
                                    **with_cache(model, handle.new_cache()), **GREEDY)
            assert torch.equal(single.sequences[0, -NEW:], batch.sequences[i, -NEW:]), f"sequence {i}"
            assert max_score_diff(single, batch, 0, i) < 1e-6


class CacheProbe(LogitsProcessor):
    """Runs `check(cache)` after every forward of `generate` (prompt and each new token)."""

    def __init__(self, cache, check):
        self.cache, self.check, self.calls = cache, check, 0

    def __call__(self, input_ids, scores):
        self.check(self.cache)
        self.calls += 1
        return scores


def test_memory_within_each_layers_share_at_every_step(vlm):
    model = vlm.model
    profile = lookm(model, 0.3, sink_tokens=2, recent_window=3, truncation_distance=4)
    inputs = vlm.batch([26, 9])
    real = inputs["attention_mask"].sum(1).numpy()

    def check(cache):
        for layer in cache.compressing_layers().values():
            share = np.ceil(0.3 * layer.tokens - 1e-9)
            assert (layer.valid.sum(1).numpy() == layer.kept).all()
            assert (layer.kept <= np.maximum(share, 1)).all()
            assert (layer.tokens == real + layer.seen - inputs["input_ids"].shape[1]).all()

    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        probe = CacheProbe(cache, check)
        model.generate(**inputs, max_new_tokens=3 * NEW, **with_cache(model, cache),
                       logits_processor=LogitsProcessorList([probe]), **GREEDY)
    assert probe.calls == 3 * NEW


# ----- image-token awareness and the text prior ------------------------------------------------


def test_cache_learns_the_image_positions(vlm):
    model = vlm.model
    inputs = vlm.batch([20, 8])
    expected = (inputs["input_ids"] == IMAGE_TOKEN) & inputs["attention_mask"].bool()
    with torch.no_grad(), attach(model, uniform_profile(model, 0.5)) as handle:
        cache = handle.new_cache()
        model.generate(**inputs, max_new_tokens=2, **with_cache(model, cache), **GREEDY)
    assert torch.equal(cache.image_mask, expected)
    assert expected.sum(1).tolist() == [vlm.image_tokens, vlm.image_tokens]
    for layer in cache.compressing_layers().values():
        assert torch.equal(layer.prompt_image, expected)
        assert (layer.kept_image <= layer.kept).all()
    kept_image = cache.kept_image()
    assert set(kept_image) == set(cache.compressing_layers())
    assert all(counts.shape == (2,) for counts in kept_image.values())


def test_text_prior_keeps_text_before_image_within_the_budget(vlm):
    """Few text tokens: all text stays and image entries fill the rest by importance. Many text
    tokens: no image entry survives, and the layer still keeps exactly its share."""
    model = vlm.model
    budget = 0.6
    profile = lookm(model, budget, sink_tokens=1, recent_window=2)
    with torch.no_grad(), attach(model, profile) as handle:
        for length in (3, 40):
            inputs = vlm.batch([length])
            cache = handle.new_cache(record_importance=True)
            model.generate(**inputs, max_new_tokens=1, **with_cache(model, cache), **GREEDY)
            image = cache.image_mask[0]
            n = image.numel()
            keep = int(np.ceil(budget * n - 1e-9))
            for layer in cache.compressing_layers().values():
                if layer.plan.cap is not None:
                    continue  # a sliding layer's window: sinks and the most recent tokens, not the text prior
                kept = sorted(layer.order[0][layer.valid[0]].tolist())
                assert len(kept) == keep == int(layer.kept[0])
                text = [c for c in range(n) if not image[c]]
                images = [c for c in range(n) if image[c]]
                importance = layer.prompt_importance[0]
                if len(text) <= keep:
                    assert keep > len(text)  # some image entries compete for the rest
                    best = sorted(images, key=lambda c: -float(importance[c]))[: keep - len(text)]
                    assert kept == sorted(text + best)
                    assert int(layer.kept_image[0]) == keep - len(text)
                else:
                    assert int(layer.kept_image[0]) == 0
                    assert set(kept) <= set(text)


def test_text_prior_without_images_is_the_importance_rule():
    g = torch.Generator().manual_seed(0)
    importance = torch.rand(3, 20, generator=g, dtype=torch.float64)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, :5] = False
    keep = np.array([6, 4, 9])
    args = dict(sink_tokens=2, recent_window=3)
    want = TopImportance().select(importance, valid, keep, **args)
    rule = select_rule("text-prior")
    for image_mask in (None, torch.zeros(3, 20, dtype=torch.bool)):
        got = rule.select(importance, valid, keep, image_mask=image_mask, **args)
        assert torch.equal(got.index, want.index) and torch.equal(got.valid, want.valid)
    # Padding flagged as image is ignored: the row has no real image token.
    only_padding = torch.zeros(3, 20, dtype=torch.bool)
    only_padding[1, :5] = True
    got = rule.select(importance, valid, keep, image_mask=only_padding, **args)
    assert torch.equal(got.index, want.index)


def test_text_prior_generation_on_text_only_model_equals_importance():
    llama = tiny_llama()
    inputs = left_pad(prompts([40, 25], seed=2))
    outs = []
    with torch.no_grad():
        for selection in ("importance", "text-prior"):
            profile = profile_with(llama, 0.3, selection=selection, merge="similarity-pivot",
                                   sink_tokens=2, recent_window=3)
            with attach(llama, profile) as handle:
                outs.append(llama.generate(**inputs, max_new_tokens=NEW, **with_cache(llama, handle.new_cache()), **GREEDY))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max_score_diff(outs[0], outs[1]) == 0.0


def test_image_mask_set_only_on_the_prompt_forward():
    vlm = BUILDERS["llava"]()
    model = vlm.model
    inputs = vlm.batch([12])
    with torch.no_grad(), attach(model, uniform_profile(model, 0.5)) as handle:
        cache = handle.new_cache()
        assert isinstance(cache, KvtoolCache) and cache.awaiting_prompt and cache.image_mask is None
        model(**inputs, **with_cache(model, cache))
        first = cache.image_mask
        assert first is not None and not cache.awaiting_prompt
        # A decode forward with an image-token id as input does not touch the prompt's mask.
        mask = torch.cat([inputs["attention_mask"], torch.ones(1, 1, dtype=torch.long)], dim=1)
        model(input_ids=torch.tensor([[IMAGE_TOKEN - 1]]), attention_mask=mask, **with_cache(model, cache))
        assert cache.image_mask is first
