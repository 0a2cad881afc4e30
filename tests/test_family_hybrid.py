"""Models whose cache is more than full attention: linear-attention hybrids (Qwen3-Next), Mamba hybrids
(Jamba, Bamba, Granite 4, Nemotron-H) and Llama 4's chunked layers.

kvtool compresses the full-attention layers and leaves the rest exactly as transformers keeps them:
the fixed-size conv and recurrent state, and the chunked layers' windows. Budget 1.0 is the model; a
padded batch is its rows alone; every step's logits equal the unmodified model's over a plain cache
holding exactly the entries kvtool holds (float64); the byte count is what grows with the prompt.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.profiles.schema import Draft
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.memory import fixed_state_bytes, kv_bytes, kv_bytes_full, kv_bytes_per_token
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_llama4, tiny_mamba_hybrid, tiny_qwen3_next

NEW = 8
BUILDERS = {
    "qwen3-next": tiny_qwen3_next,
    "jamba": lambda: tiny_mamba_hybrid("jamba"),
    "bamba": lambda: tiny_mamba_hybrid("bamba"),
    "granite4": lambda: tiny_mamba_hybrid("granitemoehybrid"),
    "nemotron-h": lambda: tiny_mamba_hybrid("nemotron_h"),
    "llama4": tiny_llama4,
}
# Rows move by this much with the batch around them in the unmodified model (Qwen3-Next's gated
# delta rule and Llama 4's complex rotary compute partly in float32); exactly 0 for the others.
ROW_TOLERANCE = {"qwen3-next": 1e-6, "llama4": 1e-6}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request):
    return request.param, BUILDERS[request.param]()


def max_score_diff(a, b, row_a=slice(None), row_b=slice(None)) -> float:
    return max((x[row_a] - y[row_b]).abs().max().item() for x, y in zip(a.scores, b.scores))


def states(layer) -> list[torch.Tensor]:
    return [t for d in (layer.conv_states, layer.recurrent_states) for t in d.values() if t is not None]


def test_budget_one_equals_the_model_and_leaves_the_other_layers_as_transformers_keeps_them(family):
    name, model = family
    inputs = left_pad(prompts([30, 19]))
    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        ref = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, plain), **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            cache = handle.new_cache()
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max_score_diff(ref, out) < 1e-9
    kinds = model.config.layer_types
    for kind, mine, theirs in zip(kinds, cache.layers, plain.layers):
        if kind == "full_attention":
            assert isinstance(mine, CompressingLayer)
            continue
        assert type(mine) is type(theirs)  # transformers' own class, untouched
        if isinstance(mine, LinearAttentionLayer):
            assert states(mine) and all(torch.equal(a, b) for a, b in zip(states(mine), states(theirs)))
        if isinstance(mine, DynamicSlidingWindowLayer):
            assert torch.equal(mine.keys, theirs.keys) and mine.keys.shape[2] == model.config.attention_chunk_size - 1
    # What grows with the prompt is counted; the fixed-size state is the same in both caches and apart.
    grows = sum(t.numel() * t.element_size() for layer in plain.layers for t in (getattr(layer, "keys", None),
                getattr(layer, "values", None)) if t is not None)
    assert kv_bytes_full(cache) == grows
    assert fixed_state_bytes(cache) == fixed_state_bytes(plain)
    assert (fixed_state_bytes(cache) > 0) == (name != "llama4")
    # Per token: keys and values in each layer that keeps them, none in the linear-attention layers.
    with_keys = [layer for layer in plain.layers if getattr(layer, "keys", None) is not None]
    assert kv_bytes_per_token(model) == sum(2 * layer.keys.shape[1] * layer.keys.shape[-1] * 8 for layer in with_keys)


def test_padded_batch_equals_single_runs_and_each_full_layer_holds_its_share(family):
    name, model = family
    seqs = prompts([41, 17, 30])
    with torch.no_grad(), attach(model, uniform_profile(model, 0.5)) as handle:
        cache = handle.new_cache()
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        compressing = cache.compressing_layers()
        assert set(compressing) == {i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"}
        for layer in compressing.values():
            assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
        assert kv_bytes(cache) < kv_bytes_full(cache)
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            assert torch.equal(single.sequences[0, -NEW:], batch.sequences[i, -NEW:]), f"sequence {i}"
            assert max_score_diff(single, batch, 0, i) < ROW_TOLERANCE.get(name, 1e-9)


def ceiling_logits(model, cache, token: int) -> torch.Tensor:
    """The unmodified model's next-token logits over a plain cache holding exactly what the kvtool
    cache holds now: each compressing layer's kept entries in position order, every other layer a
    copy of transformers' own (recurrent state, chunk window)."""
    plain = DynamicCache(config=model.config)
    seen = None
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, CompressingLayer):
            slots = layer.order[0].masked_fill(~layer.valid[0], 10**9).argsort()[: int(layer.kept[0])]
            plain.update(layer.keys[:, :, slots], layer.values[:, :, slots], index)
            seen = layer.seen
        else:
            plain.layers[index] = copy.deepcopy(layer)
    return model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[seen]]), **with_cache(model, plain)).logits[0, -1]


def test_every_step_equals_the_model_over_the_entries_held(family):
    """TOVA drops the entry the new token attended least: its victims follow the scores."""
    name, model = family
    eviction = "tova"
    ids = prompts([26])[0][None]
    n = ids.shape[1]
    profile = profile_with(model, 0.4, sink_tokens=2, recent_window=3, truncation_distance=4, eviction=eviction)
    steps = torch.randint(3, 90, (10,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        model(input_ids=ids, **with_cache(model, cache))
        for step, token in enumerate(steps):
            want = ceiling_logits(model, cache, token)
            # Positions given: Bamba's forward counts from 0 without them (generate always passes them).
            position = torch.tensor([[n + step]])
            got = model(input_ids=torch.tensor([[token]]), position_ids=position, **with_cache(model, cache)).logits[0, -1]
            assert (got - want).abs().max().item() < 1e-9, f"step {step}"
            for layer in cache.compressing_layers().values():
                assert int(layer.kept[0]) == math.ceil(0.4 * (n + step + 1) - 1e-9)


def test_a_draft_is_refused_in_one_line(family):
    name, model = family
    with pytest.raises(KvtoolError) as err:
        attach(model, profile_with(model, 0.5, draft=Draft(4)))
    named = "chunked_attention" if name == "llama4" else "linear_attention"
    assert named in str(err.value) and "\n" not in str(err.value)


def test_layers_with_attention_and_a_mamba_state_in_one_are_refused_in_one_line():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.FalconH1Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = tf.FalconH1ForCausalLM(config).eval()
    with pytest.raises(KvtoolError) as err:
        attach(model, uniform_profile(model, 0.5))
    assert "hybrid" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["qwen3-next", "jamba", "llama4"])
def test_calibration_writes_a_profile_that_records_each_layers_kind_and_applies(name, tmp_path):
    """The full-attention layers get calibrated ratios with mean `budget` (the bytes that grow with
    the prompt, on a linear-attention hybrid); the others stay transformers' own and are recorded
    by kind. Linear-attention hybrids calibrate the papers' recipe (the recipe search runs recipes
    side by side in grouped caches, which hold attention layers only); Llama 4 searches the rules
    its global NoPE layers support (the attention-sum scorer: expected attention needs RoPE)."""
    from kvtool.calibration.recipes import SearchSpace
    from kvtool.runtime import load_profile
    from tiny_models import calibration_run

    model = {"qwen3-next": lambda: tiny_qwen3_next(torch.float32), "jamba": lambda: tiny_mamba_hybrid("jamba", torch.float32),
             "llama4": lambda: tiny_llama4(torch.float32)}[name]()
    out = tmp_path / "profile.yaml"
    search = SearchSpace(scorers=("attention-sum",), ratio_sources=("scorer", "uniform")) if name == "llama4" else None
    calibration_run(model, 0.2, search=search, out=out)
    profile = load_profile(out)
    kinds = tuple(model.config.layer_types)
    assert profile.model.layer_types == kinds and profile.method.draft is None
    full = [layer for kind, layer in zip(kinds, profile.layers) if kind == "full_attention"]
    assert all(layer.compress for layer in full) and np.mean([layer.ratio for layer in full]) == pytest.approx(0.2, abs=2e-3)
    assert all(not layer.compress and layer.ratio == 1.0 for kind, layer in zip(kinds, profile.layers) if kind != "full_attention")
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        model.generate(**left_pad(prompts([40, 25])), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        assert set(cache.compressing_layers()) == {i for i, kind in enumerate(kinds) if kind == "full_attention"}
        for layer in cache.compressing_layers().values():
            assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))


def test_the_budget_is_a_share_of_what_grows_with_the_prompt():
    """A linear-attention layer holds no per-token entries: the whole cache's kept share at the
    profile's reference length is the full-attention layers' (profiles/whole_cache.py)."""
    from kvtool.profiles import whole_cache

    model = tiny_qwen3_next()
    profile = uniform_profile(model, 0.2)
    assert whole_cache.stored("linear_attention", 4096, profile.model) == 0
    assert whole_cache.shares(profile)["all"] == pytest.approx(0.2, abs=1e-3)
