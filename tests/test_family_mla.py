"""Multi-head latent attention (DeepSeek-V2/V3; Kimi K2 is V3's architecture): the cache holds what
transformers' attention caches per token (a latent and a rotary key of different widths), evicts
them together, scores by the attention the model computes over the expanded heads, and counts the
bytes it holds. Checked against the unmodified model and a float64 brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.layer.latent import LatentLayer
from kvtool.runtime.memory import kv_bytes, kv_bytes_full, kv_bytes_per_token
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_deepseek

NEW = 10
RANK, ROPE = 32, 8  # tiny_deepseek's latent and rotary widths
SINK, RECENT = 2, 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[3, 2], ids=["deepseek-v3", "deepseek-v2"])
def model(request):
    return tiny_deepseek(request.param)


def rows_tolerance(model) -> float:
    """How far a row's scores may move with the batch around it in the unmodified model: DeepSeek-V2
    rotates in float32 (complex rotary), so its rows move by ~3e-8 without kvtool too."""
    return 1e-6 if model.config.model_type == "deepseek_v2" else 1e-9


def max_score_diff(a, b, row_a=slice(None), row_b=slice(None)) -> float:
    return max((x[row_a] - y[row_b]).abs().max().item() for x, y in zip(a.scores, b.scores))


def test_budget_one_equals_the_model_and_holds_what_transformers_holds(model):
    inputs = left_pad(prompts([30, 19]))
    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        ref = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, plain), **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            cache = handle.new_cache()
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max_score_diff(ref, out) < 1e-9
    for mine, theirs in zip(cache.layers, plain.layers):
        assert isinstance(mine, LatentLayer)
        assert mine.keys.shape[1] == mine.values.shape[1] == 1
        assert (mine.keys.shape[-1], mine.values.shape[-1]) == (RANK, ROPE) == (theirs.keys.shape[-1], theirs.values.shape[-1])
        # Every logical column transformers holds, in the same slot order, bit for bit.
        width = theirs.keys.shape[2]
        for row in range(2):
            real = mine.valid[row]
            columns = mine.order[row][real]
            assert torch.equal(mine.keys[row, :, real], theirs.keys[row, :, columns])
            assert torch.equal(mine.values[row, :, real], theirs.values[row, :, columns])
        assert mine.seen == width
    # The full count is transformers' own tensors; per token, the latent and the rotary key.
    assert kv_bytes_full(cache) == sum(t.numel() * t.element_size() for layer in plain.layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(model) == 4 * (RANK + ROPE) * 8


def test_padded_batch_equals_single_runs_and_every_layer_holds_its_share(model):
    seqs = prompts([41, 17, 30])
    with torch.no_grad(), attach(model, uniform_profile(model, 0.5)) as handle:
        cache = handle.new_cache()
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        for layer in cache.compressing_layers().values():
            assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
            assert np.array_equal(layer.valid.sum(1).numpy(), layer.kept)
        # The bytes held are the tensors held: latents, rotary keys and the per-entry state.
        held = sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in (layer.keys, layer.values, layer.valid, layer.order, layer.frozen, layer.score) if t is not None)
        assert kv_bytes(cache) == held < kv_bytes_full(cache)
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            assert torch.equal(single.sequences[0, -NEW:], batch.sequences[i, -NEW:]), f"sequence {i}"
            assert max_score_diff(single, batch, 0, i) < rows_tolerance(model)


def eager_importance(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, each column's attention summed over rows and averaged over heads (eager weights)."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return [att[0].sum(dim=1).mean(dim=0) for att in out.attentions]


def brute_force_kept(importance: torch.Tensor, keep: int) -> list[int]:
    n = importance.numel()
    protected = list(range(min(SINK, keep)))
    protected += [t for t in range(n - 1, n - 1 - RECENT, -1) if t not in protected][: keep - len(protected)]
    rest = sorted((t for t in range(n) if t not in protected), key=lambda t: -float(importance[t]))
    return sorted(protected + rest[: keep - len(protected)])


def held_as_plain_cache(model, cache) -> DynamicCache:
    """A plain cache holding exactly the entries the kvtool cache holds now: each layer's latents and
    rotary keys in position order."""
    plain = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        slots = layer.order[0].masked_fill(~layer.valid[0], 10**9).argsort()[: int(layer.kept[0])]
        plain.update(layer.keys[:, :, slots], layer.values[:, :, slots], index)
    return plain


def ceiling(model, cache, token: int, eager: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The unmodified model's next-token logits over the entries the kvtool cache holds, and (`eager`)
    per layer the attention its eager implementation gives them and the new token, averaged over heads
    (transformers' eager softmax runs in float32)."""
    position = torch.tensor([[cache.layers[0].seen]])
    step = dict(input_ids=torch.tensor([[token]]), position_ids=position)
    logits = model(**step, **with_cache(model, held_as_plain_cache(model, cache))).logits[0, -1]
    if not eager:
        return logits, None
    attached = model.config._attn_implementation  # kvtool's, put back for the kvtool cache's own step
    model.set_attn_implementation("eager")
    try:
        out = model(**step, output_attentions=True, **with_cache(model, held_as_plain_cache(model, cache)))
    finally:
        model.set_attn_implementation(attached)
    return logits, [att[0, :, 0].mean(dim=0) for att in out.attentions]


@pytest.mark.parametrize("eviction", ["fixed-point", "tova"])
def test_selection_and_every_step_equal_a_brute_force(model, eviction):
    """Prompt entries kept by the eager attention's column sums (top-k after sinks and recent), then
    every decoding step's logits equal the model's over exactly the entries held."""
    # TOVA's check reads eager attention weights, whose one mask needs every layer the same length.
    ratios = [0.3, 0.5, 0.4, 0.6] if eviction == "fixed-point" else [0.4] * 4
    ids = prompts([28])[0][None]
    n = ids.shape[1]
    importance = eager_importance(model, ids)
    profile = profile_with(model, ratios, merge="none", sink_tokens=SINK, recent_window=RECENT, truncation_distance=4,
                           eviction=eviction)
    steps = torch.randint(3, 90, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        model(input_ids=ids, **with_cache(model, cache))
        for index, layer in enumerate(cache.layers):
            kept = sorted(layer.order[0][layer.valid[0]].tolist())
            assert kept == brute_force_kept(importance[index], math.ceil(ratios[index] * n - 1e-9)), f"layer {index}"
        for step, token in enumerate(steps):
            want, attention = ceiling(model, cache, token, eager=eviction == "tova")
            # Each slot's position before the step; the new token goes to the first free slot.
            before = [(layer.order[0].clone(), int(layer.kept[0])) for layer in cache.layers]
            got = model(input_ids=torch.tensor([[token]]), **with_cache(model, cache)).logits[0, -1]
            assert (got - want).abs().max().item() < 1e-9, f"step {step}"
            for layer, ratio, (order, kept), probs in zip(cache.layers, ratios, before, attention or [None] * 4):
                assert int(layer.kept[0]) == max(1, math.ceil(ratio * (n + step + 1) - 1e-9))
                if eviction == "tova":  # the rule ranks by the attention the model gave each entry
                    rank = order[:kept].argsort().argsort()  # slot -> index among the held entries in position order
                    received = layer.attention[0, : kept + 1]
                    assert (received[:kept] - probs[rank]).abs().max().item() < 1e-6
                    assert abs(received[kept].item() - probs[-1].item()) < 1e-6


def test_what_latent_layers_cannot_do_is_refused_in_one_line(model):
    for settings, named in ((dict(heads="per-head"), "per-head"),):
        with pytest.raises(KvtoolError) as err:
            attach(model, profile_with(model, 0.5, **settings))
        assert named in str(err.value) and "\n" not in str(err.value)
    from kvtool.profiles.schema import Draft

    with pytest.raises(KvtoolError) as err:
        attach(model, profile_with(model, 0.5, draft=Draft(4)))
    assert "latent attention" in str(err.value) and "\n" not in str(err.value)


def test_calibration_writes_a_profile_that_applies(tmp_path):
    """`kvtool calibrate` on a latent-attention model, searching what its layers support (shared
    entries, the attention-sum scorer: the latent has one head, and its keys are latents)."""
    from kvtool.calibration.recipes import SearchSpace
    from kvtool.runtime import load_profile
    from tiny_models import calibration_run

    model = tiny_deepseek(3, dtype=torch.float32)
    out = tmp_path / "deepseek.yaml"
    space = SearchSpace(scorers=("attention-sum",), heads=("shared",), ratio_sources=("scorer", "uniform"))
    run = calibration_run(model, 0.2, search=space, out=out)
    profile = load_profile(out)
    assert profile.model.model_type == "deepseek_v3" and profile.model.layer_types == ("full_attention",) * 4
    assert profile.method.draft is None and profile.method.heads == "shared"
    assert np.mean([layer.ratio for layer in profile.layers]) == pytest.approx(0.2, abs=1e-3)
    assert [layer.ratio for layer in run.profile.layers] == pytest.approx([layer.ratio for layer in profile.layers])
    seqs = prompts([40, 25])
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        assert all(isinstance(layer, LatentLayer) for layer in cache.layers)
        for layer in cache.compressing_layers().values():
            assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
