"""`generate` through `Decoder` steps (runtime.graphed_generate) gives transformers' own loop's sequences.

On a GPU the loop replays a CUDA graph; here it runs the same fixed-slot steps eagerly
(`use_settings(generate_loop="fixed")`) and is compared with transformers' loop (`generate_loop="off"`)
through `handle.generate`: greedy and sampled, with and without the verified draft, left-padded rows,
a row that stops at EOS while the other goes on, and the cases that must keep transformers' loop.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.profiles import Draft
from kvtool.runtime import attach, graphed_generate
from kvtool.runtime.draft import generate as draft_generate
from kvtool.runtime.graphed_generate import loop_for
from kvtool.runtime.settings import use_settings
from test_runtime_rules import recipe_profile
from tiny_models import left_pad, prompts, tiny_llama


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(layers=2)


def with_draft(profile, draft):
    return dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=draft))


def both_loops(model, profile, monkeypatch, **kwargs):
    """The sequences `generate` gives with transformers' loop and with the fixed-slot loop (what
    handle.generate runs), and how many times the latter ran. The caches they end with hold the same
    keys and values (float64 rounding), so every token went in at its position."""
    runs, caches, used = [], [], []
    decode = graphed_generate._decode
    monkeypatch.setattr(graphed_generate, "_decode", lambda *args: used.append(1) or decode(*args))
    inputs = left_pad(prompts([40, 27], seed=3))
    for mode in ("off", "fixed"):
        if kwargs.get("do_sample"):
            torch.manual_seed(7)
        with use_settings(generate_loop=mode), torch.no_grad(), attach(model, profile) as handle:
            sequences, cache = draft_generate(model, inputs, handle.bare_cache, profile.method.draft, **kwargs)
        runs.append(sequences)
        caches.append(cache)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        # Fixed slots size their buffers once, the eager steps grow them: compare the slots both have.
        width = min(a.keys.shape[2], b.keys.shape[2])
        assert not a.valid[:, width:].any() and not b.valid[:, width:].any()
        assert torch.equal(a.valid[:, :width], b.valid[:, :width])
        valid = a.valid[:, None, :width].expand(-1, a.keys.shape[1], -1)
        torch.testing.assert_close(b.keys[:, :, :width][valid], a.keys[:, :, :width][valid], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b.values[:, :, :width][valid], a.values[:, :, :width][valid], rtol=1e-12, atol=1e-12)
    return runs[0], runs[1], len(used)


@pytest.mark.parametrize("draft", [None, Draft(6, 2, True)], ids=["no-draft", "verified-draft"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_decoder_loop_generates_what_transformers_loop_does(llama, monkeypatch, draft, sample):
    profile = with_draft(recipe_profile(llama), draft)
    kwargs = dict(max_new_tokens=12, pad_token_id=0, do_sample=sample)
    if sample:
        kwargs.update(temperature=0.9, top_k=20)
    theirs, ours, used = both_loops(llama, profile, monkeypatch, **kwargs)
    assert used == 1
    assert torch.equal(theirs, ours)


def test_a_row_that_stops_at_eos_is_padded_as_transformers_pads_it(llama, monkeypatch):
    profile = recipe_profile(llama)
    kwargs = dict(max_new_tokens=10, pad_token_id=0, do_sample=False)
    first, _, _ = both_loops(llama, profile, monkeypatch, **kwargs)
    eos = int(first[0, -7])  # row 0's fourth new token: row 0 stops there, row 1 most likely later
    theirs, ours, used = both_loops(llama, profile, monkeypatch, eos_token_id=eos, **kwargs)
    assert used == 1 and torch.equal(theirs, ours)
    assert (ours[0, -6:] == 0).all()


def test_one_new_token_and_what_keeps_transformers_loop(llama, monkeypatch):
    profile = recipe_profile(llama)
    theirs, ours, used = both_loops(llama, profile, monkeypatch, max_new_tokens=1, pad_token_id=0, do_sample=False)
    assert used == 1 and torch.equal(theirs, ours)
    inputs = left_pad(prompts([30], seed=2))
    with use_settings(generate_loop="fixed"), attach(llama, profile) as handle:
        cache = handle.bare_cache()
        assert "custom_generate" in loop_for(llama, cache, inputs, {"max_new_tokens": 4})
        for kwargs in (
            {"num_beams": 2}, {"return_dict_in_generate": True}, {"output_scores": True}, {"streamer": object()},
        ):
            assert loop_for(llama, cache, inputs, kwargs) == {}, kwargs
        assert loop_for(llama, cache, {**inputs, "pixel_values": torch.zeros(1)}, {}) == {}
    with use_settings(generate_loop="auto"), attach(llama, profile) as handle:  # a CPU: transformers' loop
        assert loop_for(llama, handle.bare_cache(), inputs, {}) == {}
