"""`kvtool calibrate DIR --budget 0.2` with its default settings (the recipe search, the default draft)
on the families whose layers are more than full attention: multi-head latent attention (DeepSeek-V3),
linear-attention and Mamba hybrids (Qwen3-Next, Jamba), Llama 4's chunked layers, and a
vision-language model. Each writes a profile that records every layer's kind and applies, with what
the model's layers cannot do left out and said in one line (no draft where the layers would keep a
draft's rows; no query-statistics rules where the queries cannot be tapped; shared entries on MLA).

Changed from the defaults, for time only: 4 prompts of 30-50 words (the default draws 12), 8-token
references (default 64). Also here: the recipe search's grouped caches on linear-attention layers
decode exactly as each recipe's cache alone, and the layer-loss measurement's chunked masks.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtool.calibration.config import DEFAULT_DRAFT, CalibrateConfig
from kvtool.models.forward import with_cache
from kvtool.models.queries import unsupported
from kvtool.profiles import fingerprint_of
from kvtool.profiles.schema import QUERY_SCORERS
from kvtool.runtime import attach, load_profile
from kvtool.runtime.eviction import EVICT_RULES
from kvtool.runtime.layer.latent import LatentLayer
from cli_runner import run
from conftest import make_word_tokenizer
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_deepseek, tiny_llama, tiny_llama4, tiny_mamba_hybrid, tiny_qwen3_next

WORDS = "the cat dog sat on mat and it ran away to house big small red blue green one two three".split()
SMALL = ("--samples", "4", "--reference-tokens", "8")  # the only settings changed from the CLI's defaults
NEW = 6
TEXT_FAMILIES = {
    "deepseek-v3": (lambda: tiny_deepseek(3, torch.float32), "multi-head latent attention"),
    "qwen3-next": (lambda: tiny_qwen3_next(torch.float32), "linear_attention layers"),
    "jamba": (lambda: tiny_mamba_hybrid("jamba", torch.float32), "linear_attention layers"),
    "llama4": (lambda: tiny_llama4(torch.float32), "chunked_attention layers"),
}
ATTENTION_KINDS = ("full_attention", "sliding_attention")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def records(count: int = 6, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 50)))} for _ in range(count)]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "words.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()), encoding="utf-8")
    return path


def assert_applies(model, profile, inputs: dict) -> None:
    """The profile attaches, a padded batch generates, the full-attention layers are the compressing
    ones and each keeps what its plan says."""
    kinds = fingerprint_of(model).layer_types
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        assert out.sequences.shape[1] == inputs["input_ids"].shape[1] + NEW
        assert set(cache.compressing_layers()) == {i for i, kind in enumerate(kinds) if kind == "full_attention"}
        for layer in cache.compressing_layers().values():
            assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
            assert int(layer.kept.min()) < int(layer.tokens.min())  # something was evicted
    return cache


def assert_records_kinds(model, profile) -> None:
    """Every layer's kind recorded as the model's config gives it; only attention layers compress,
    the full-attention ones at the budget's bytes on average."""
    kinds = fingerprint_of(model).layer_types
    assert profile.model.layer_types == kinds and len(profile.layers) == len(kinds)
    full = [layer for kind, layer in zip(kinds, profile.layers) if kind == "full_attention"]
    assert full and all(layer.compress for layer in full)
    # The budget is bytes: the kept ratio at each layer's storage (int8 where the storage stage chose it).
    from kvtool.profiles.entry_bytes import layer_share

    native = profile.native_bytes or 4
    assert np.mean([layer_share(layer, profile.model.head_dim, native) for layer in full]) == pytest.approx(0.2, abs=2e-3)
    assert all(not layer.compress for kind, layer in zip(kinds, profile.layers) if kind not in ATTENTION_KINDS)


@pytest.mark.parametrize("name", list(TEXT_FAMILIES))
def test_the_cli_defaults_write_a_profile_that_applies(name, data_file, tmp_path, monkeypatch, capsys, caplog):
    """`kvtool calibrate DIR --budget 0.2` on a saved tiny model: a profile, its draft left out in one
    logged line naming the layers that refuse it, and the search kept to the rules the layers run."""
    from kvtool import load_model

    build, refused = TEXT_FAMILIES[name]
    directory = tmp_path / name
    build().save_pretrained(directory)
    make_word_tokenizer().save_pretrained(directory)
    out = tmp_path / "profile.yaml"
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        code, _, stderr = run(monkeypatch, capsys, "calibrate", str(directory), "--budget", "0.2", *SMALL,
                              "--data", str(data_file), "--out", str(out))
    assert code == 0, stderr
    notes = [r.getMessage() for r in caplog.records if "draft is not supported" in r.getMessage()]
    assert len(notes) == 1 and refused in notes[0] and "\n" not in notes[0]
    profile = load_profile(out)
    loaded = load_model(str(directory))
    model = loaded.model
    assert_records_kinds(model, profile)
    assert profile.method.draft is None
    assert profile.calibration.recipes  # the recipe search ran
    if unsupported(model) is not None:  # no rule that reads query statistics was tried or shipped
        assert all(r.scorer not in QUERY_SCORERS for r in profile.calibration.recipes)
        assert profile.method.scorer not in QUERY_SCORERS and not EVICT_RULES[profile.method.eviction].needs_queries
    cache = assert_applies(model, profile, left_pad(prompts([40, 25])))
    kept_native = [r.getMessage() for r in caplog.records if "latent entries are kept" in r.getMessage()]
    if name == "deepseek-v3":
        assert profile.method.heads == "shared"
        assert all(isinstance(layer, LatentLayer) for layer in cache.layers)
        # The default storage stage is left out in one line: latent layers store the model's own entries.
        assert len(kept_native) == 1 and "\n" not in kept_native[0] and profile.calibration.storages is None
    else:
        assert not kept_native and [t.storage for t in profile.calibration.storages][1:] == ["int8"]


def test_a_vision_language_model_calibrates_with_the_defaults(tmp_path, caplog):
    """`calibrate()` with the CLI's settings on a tiny Qwen2.5-VL (multimodal RoPE: no expected-attention
    rules), then applied to prompts with an image. Its layers take a draft, so none is refused (the
    measured cost of the prompt phase may still leave it out, by the clock: not asserted here); the
    profile with the default draft generates from image prompts."""
    from kvtool.calibration.runner import calibrate
    from kvtool.data import Record
    from kvtool.models import LoadedModel, prepare_tokenizer
    from tiny_vlms import MORE_BUILDERS

    vlm = MORE_BUILDERS["qwen2.5-vl"]()
    model = vlm.model.float()  # float32, as models load
    loaded = LoadedModel(model=model, tokenizer=prepare_tokenizer(make_word_tokenizer()), name="tiny", source="test")
    out = tmp_path / "profile.yaml"
    config = CalibrateConfig(samples=4, reference_tokens=8)
    assert config.draft == DEFAULT_DRAFT and config.search is not None  # the CLI's defaults otherwise
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        result = calibrate(loaded, 0.2, data=[Record(prompt=r["prompt"]) for r in records()], out=out, config=config)
    assert result.notes == () and not [r for r in caplog.records if "draft" in r.getMessage()]
    profile = load_profile(out)
    assert_records_kinds(model, profile)
    assert unsupported(model) is not None and "multimodal RoPE" in unsupported(model)
    assert all(r.scorer not in QUERY_SCORERS for r in profile.calibration.recipes)
    assert_applies(model, profile, vlm.batch([30, 17]))
    # Its layers run the default draft: the profile with it generates from image prompts.
    import dataclasses

    drafted = dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=DEFAULT_DRAFT))
    inputs = vlm.batch([30, 17])
    with torch.no_grad(), attach(model, drafted) as handle:
        out = handle.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out.shape == (2, inputs["input_ids"].shape[1] + NEW)


def test_why_query_statistics_cannot_be_tapped_is_one_line():
    """The runner drops the expected-attention rules for these reasons (models.queries.unsupported)."""
    reasons = {
        "deepseek": (tiny_deepseek(3), "latent attention"),
        "qwen3-next": (tiny_qwen3_next(), "no attention module"),
        "llama4": (tiny_llama4(), "complex-valued RoPE"),
        "jamba": (tiny_mamba_hybrid("jamba"), "rotary embedding"),
    }
    for name, (model, named) in reasons.items():
        why = unsupported(model)
        assert why is not None and named in why and "\n" not in why, name
    assert unsupported(tiny_llama()) is None


@pytest.mark.parametrize("build", [tiny_qwen3_next, lambda: tiny_mamba_hybrid("jamba")], ids=["qwen3-next", "jamba"])
def test_recipes_side_by_side_decode_on_linear_attention_layers_exactly_as_each_alone(build):
    """The recipe search's grouped cache stacks a linear-attention layer's conv and recurrent states
    by rows: every block's logits equal its own cache run alone, step after step."""
    from kvtool.calibration.truncation import compress_recorded_prompt
    from kvtool.runtime import uniform_profile
    from kvtool.runtime.grouped import GroupedCache
    from kvtool.scoring import left_pad as pad_batch

    model = build()
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (30, 21, 26)]
    batch = pad_batch(sequences, (0, 1, 2), pad_id=0)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
    profiles = [
        profile_with(model, 0.3, truncation_distance=4, merge="position"),
        profile_with(model, 0.5, eviction="tova", scorer="window", window=4, pool=3, heads="per-head"),
        profile_with(model, 0.4, truncation_distance=4, merge="position"),  # merges with the first
    ]
    with torch.inference_mode():
        full_handle = attach(model, uniform_profile(model, 1.0))
        full = full_handle.new_cache(record_importance=True)
        model(**inputs, **with_cache(model, full), use_cache=True)
        full_handle.detach()
        handle = attach(model, profiles[0])
        alone = [compress_recorded_prompt(handle.cache_for(p), full, batch.attention_mask) for p in profiles]
        parts = [compress_recorded_prompt(handle.cache_for(p), full, batch.attention_mask) for p in profiles]
        grouped = GroupedCache(parts, rows=3, merge=True)
        linear = [i for i, kind in enumerate(model.config.layer_types) if kind != "full_attention"]
        assert linear and all(type(grouped.layers[i]) is type(full.layers[i]) for i in linear)
        mask, position = batch.attention_mask, batch.next_positions
        tokens = torch.randint(3, 90, (3, 8), generator=gen)
        for t in range(8):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
            step = {"input_ids": tokens[:, t : t + 1], "position_ids": position, "use_cache": True}
            together = model(
                input_ids=step["input_ids"].repeat(3, 1), position_ids=position.repeat(3, 1), use_cache=True,
                attention_mask=mask.repeat(3, 1), **with_cache(model, grouped),
            ).logits[:, -1]
            for i, cache in enumerate(alone):
                logits = model(**step, attention_mask=mask, **with_cache(model, cache)).logits[:, -1]
                assert torch.allclose(together[3 * i : 3 * i + 3], logits, atol=1e-10), f"step {t}, recipe {i}"
            position = position + 1
        handle.detach()


def test_layer_losses_on_chunked_layers_see_what_the_model_sees():
    """The layer-loss measurement runs the reference after the prompt with each layer's own mask; on
    Llama 4's chunked layers, with nothing masked, its NLL is the whole sequence's forward's."""
    from kvtool.calibration.layer_loss import _Attention, _Layers, nll_per_token, measurable
    from transformers import AttentionInterface

    model = tiny_llama4()
    assert measurable(model) is None and "linear_attention" in measurable(tiny_qwen3_next())
    ids, ref = prompts([21])[0], prompts([7], seed=4)[0]
    with torch.no_grad():
        whole = model(input_ids=torch.cat([ids, ref])[None]).logits[:, len(ids):]
        config = model.config
        chunks = {i: config.attention_chunk_size for i, kind in enumerate(config.layer_types) if kind == "chunked_attention"}
        attention = _Attention([], {}, chunks)
        AttentionInterface.register("kvtool_test_layer_loss", attention)
        model.set_attn_implementation("kvtool_test_layer_loss")
        try:
            model(input_ids=ids[None], use_cache=False)
            attention.mode = "mask"
            positions = torch.arange(len(ids), len(ids) + len(ref))[None]
            logits = _Layers(model).record(input_ids=ref[None], position_ids=positions, use_cache=False)
        finally:
            model.set_attn_implementation("sdpa")
    assert torch.allclose(logits, whole, atol=1e-9)
    assert nll_per_token(logits, ref) == pytest.approx(nll_per_token(whole, ref), abs=1e-9)


def test_llama4_chunks_are_recorded_and_counted_as_transformers_stores_them(tmp_path):
    """The fingerprint records the chunk (omitted where a model has none, so older profiles read the
    same); the whole cache counts a chunked layer as at most chunk - 1 entries, which kvtool keeps."""
    from kvtool.profiles import read_profile, save_profile, whole_cache
    from kvtool.runtime import uniform_profile

    model = tiny_llama4()
    profile = uniform_profile(model, 0.2)
    assert profile.model.attention_chunk_size == 8 and fingerprint_of(tiny_llama()).attention_chunk_size is None
    save_profile(profile, tmp_path / "llama4.yaml")
    assert read_profile(tmp_path / "llama4.yaml").model == profile.model
    save_profile(uniform_profile(tiny_llama(), 0.2), tmp_path / "llama.yaml")
    assert "attention_chunk_size" not in (tmp_path / "llama.yaml").read_text()
    assert whole_cache.stored("chunked_attention", 4096, profile.model) == 7
    assert whole_cache.stored("chunked_attention", 5, profile.model) == 5
    # Three chunked layers keep their 7 entries, the global one its 20%.
    kept = 3 * 7 + int(np.ceil(0.2 * 4096))
    assert whole_cache.shares(profile, 4096)["all"] == pytest.approx(kept / (3 * 7 + 4096))


@pytest.mark.parametrize("rounds", [1, 2])
def test_a_draft_on_latent_attention_keeps_what_the_appended_forward_keeps(rounds):
    """A draft over MLA's held latents (runtime.held: attention reads their expansion, the refilled
    layer stores the latents), the batch's rows at once: each round keeps exactly the entries of the
    prompt's own forward with that round's draft appended, latents and rotary keys bit for bit, and
    the budget holds. (A profile with a draft is still refused at attach: layer/limits.py.)"""
    import math

    from kvtool.profiles.schema import Draft
    from kvtool.runtime import KvtoolCache
    from kvtool.runtime.draft import drafted, prepare, with_draft
    from kvtool.scoring import left_pad as pad_batch, prompt_forward

    model = tiny_deepseek(3)
    ratios = [0.3, 0.5, 0.4, 0.6]
    profile = profile_with(model, ratios, merge="none", eviction="tova", scorer="window", window=4, pool=3)
    batch = pad_batch([s.tolist() for s in prompts([40, 26], seed=5)], (0, 1), 0)
    k = 5
    with torch.no_grad(), attach(model, profile) as handle:
        make = handle.bare_cache
        ready = prepare(model, batch, make, Draft(k, rounds), rows=2)
        last = make()  # the round before the last one's cache, then the last round's draft by hand
        first = prompt_forward(model, batch, last)
        assert torch.equal(ready.first_logits, first)
        for _ in range(rounds - 1):
            last = prepare(model, batch, make, Draft(k, 1), rows=2).cache  # round one's
        by_hand = make()
        by_hand.set_draft(k)
        prompt_forward(model, with_draft(batch, drafted(model, last, first, batch, k)), by_hand)
    n = batch.attention_mask.sum(dim=1)
    for index, layer in ready.cache.compressing_layers().items():
        assert isinstance(layer, LatentLayer)
        other = by_hand.layers[index]
        assert layer.kept.tolist() == other.kept.tolist() == [math.ceil(ratios[index] * int(t) - 1e-9) for t in n]
        for b in range(2):
            mine = layer.order[b].masked_fill(~layer.valid[b], 10**9).argsort()[: int(layer.kept[b])]
            theirs = other.order[b].masked_fill(~other.valid[b], 10**9).argsort()[: int(other.kept[b])]
            assert layer.order[b, mine].tolist() == other.order[b, theirs].tolist()
            assert torch.equal(layer.keys[b, :, mine], other.keys[b, :, theirs])
            assert torch.equal(layer.values[b, :, mine], other.values[b, :, theirs])
            assert layer.keys.shape[-1] == 32 and layer.values.shape[-1] == 8  # latents, not expanded keys
