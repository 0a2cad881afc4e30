"""Today's vision-language families on tiny random configs: Qwen2.5-VL, Qwen3-VL, Idefics3, SmolVLM,
LLaVA-OneVision and Mistral 3 (Pixtral). The language model runs kvtool attention, the vision tower its
own; budget 1.0 is the model, a padded batch is its rows alone, every layer holds its share, and
LOOK-M's text prior finds each family's image tokens from the family's own config field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvtool.models.forward import with_cache
from kvtool.models.vision import image_token_ids
from kvtool.runtime import attach, method_profile, uniform_profile
from tiny_models import GREEDY
from tiny_vlms import IMAGE_TOKEN, MORE_BUILDERS

NEW = 8
# The config field each family's processor fills with its image token (read by models.vision).
IMAGE_FIELD = {
    "qwen2.5-vl": "image_token_id", "qwen3-vl": "image_token_id", "idefics3": "image_token_id",
    "smolvlm": "image_token_id", "llava-onevision": "image_token_index", "mistral3": "image_token_index",
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(MORE_BUILDERS))
def vlm(request):
    return MORE_BUILDERS[request.param]()


def max_score_diff(a, b, row_a=slice(None), row_b=slice(None)) -> float:
    return max((x[row_a] - y[row_b]).abs().max().item() for x, y in zip(a.scores, b.scores))


def lookm(model, budget: float, **settings):
    profile = method_profile("lookm", model, budget)
    return dataclasses.replace(profile, method=dataclasses.replace(profile.method, **settings))


def test_budget_one_equals_the_model_and_the_vision_tower_keeps_its_attention(vlm):
    model = vlm.model
    inputs = vlm.batch([23, 12])
    vision = model.config.vision_config._attn_implementation
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            assert model.config.get_text_config(decoder=True)._attn_implementation == "kvtool"
            assert model.config.vision_config._attn_implementation == vision
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max_score_diff(ref, out) < 1e-9


def test_padded_batch_equals_single_runs_and_each_layer_holds_its_share(vlm):
    model = vlm.model
    lengths = [30, 17]
    profile = lookm(model, 0.5, sink_tokens=2, recent_window=3, truncation_distance=5)
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        batch = model.generate(**vlm.batch(lengths), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        for layer in cache.compressing_layers().values():
            assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
        for i, n in enumerate(lengths):
            single = model.generate(**vlm.batch([n], seed=1 + i), max_new_tokens=NEW,
                                    **with_cache(model, handle.new_cache()), **GREEDY)
            assert torch.equal(single.sequences[0, -NEW:], batch.sequences[i, -NEW:]), f"sequence {i}"
            assert max_score_diff(single, batch, 0, i) < 1e-9


def test_the_image_tokens_come_from_the_familys_own_config(vlm):
    model = vlm.model
    config = model.config
    assert getattr(config, IMAGE_FIELD[vlm.name]) == IMAGE_TOKEN
    assert IMAGE_TOKEN in image_token_ids(config)
    inputs = vlm.batch([20, 8])
    expected = (inputs["input_ids"] == IMAGE_TOKEN) & inputs["attention_mask"].bool()
    with torch.no_grad(), attach(model, uniform_profile(model, 0.5)) as handle:
        cache = handle.new_cache()
        model.generate(**inputs, max_new_tokens=2, **with_cache(model, cache), **GREEDY)
    assert torch.equal(cache.image_mask, expected)
    assert expected.sum(1).tolist() == [vlm.image_tokens, vlm.image_tokens]
    for layer in cache.compressing_layers().values():
        assert torch.equal(layer.prompt_image, expected)


def test_text_prior_keeps_text_before_image_within_the_budget(vlm):
    """Few text tokens: all text stays and image entries fill the rest by importance. Many text
    tokens: no image entry survives, and each layer still keeps exactly its share."""
    model = vlm.model
    budget = 0.6
    profile = lookm(model, budget, sink_tokens=1, recent_window=2)
    with torch.no_grad(), attach(model, profile) as handle:
        for length in (3, 60):  # three text tokens: the sink and the two recent ones are text
            inputs = vlm.batch([length])
            cache = handle.new_cache(record_importance=True)
            model.generate(**inputs, max_new_tokens=1, **with_cache(model, cache), **GREEDY)
            image = cache.image_mask[0]
            n = image.numel()
            keep = int(np.ceil(budget * n - 1e-9))
            text = [c for c in range(n) if not image[c]]
            images = [c for c in range(n) if image[c]]
            for layer in cache.compressing_layers().values():
                kept = sorted(layer.order[0][layer.valid[0]].tolist())
                assert len(kept) == keep == int(layer.kept[0])
                if len(text) <= keep:
                    importance = layer.prompt_importance[0]
                    best = sorted(images, key=lambda c: -float(importance[c]))[: keep - len(text)]
                    assert kept == sorted(text + best)
                    assert int(layer.kept_image[0]) == keep - len(text) > 0
                else:
                    assert int(layer.kept_image[0]) == 0 and set(kept) <= set(text)


def test_calibration_writes_a_profile_that_applies_to_image_prompts(vlm, tmp_path):
    """The papers' recipe calibrated on text prompts (image prompts need the family's processor,
    tests/test_calibrate_vlm.py), written, read back and applied to prompts with an image."""
    from kvtool.profiles import fingerprint_of
    from kvtool.runtime import load_profile
    from tiny_models import calibration_run

    model = vlm.model
    out = tmp_path / "profile.yaml"
    calibration_run(MORE_BUILDERS[vlm.name]().model.float(), 0.2, search=None, out=out)  # float32, as models load
    profile = load_profile(out)
    assert profile.model.layer_types == fingerprint_of(model).layer_types and profile.model.model_type == model.config.model_type
    assert np.mean([layer.ratio for layer in profile.layers]) == pytest.approx(0.2, abs=2e-3)
    inputs = vlm.batch([30, 17])
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
    assert cache.image_mask.sum(1).tolist() == [vlm.image_tokens] * 2
    for layer in cache.compressing_layers().values():
        assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
