"""The per-layer floor (`attach(..., min_kept=N)`, `kvtool generate --min-kept N`): every compressing
layer keeps at least N entries per sequence (all of a shorter one), the ratio above it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtool.cli.generate import short_prompt_hint
from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.runtime import attach
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.selection import kept_count
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_llama

NEW = 20
RECIPES = {
    "papers": {},
    "heavy-hitter per-head": {"eviction": "heavy-hitter", "scorer": "union", "heads": "per-head", "merge": "none"},
    "tova window": {"eviction": "tova", "scorer": "window", "window": 4, "merge": "none"},
}


def test_kept_count_takes_the_larger_of_the_ratio_and_the_floor():
    tokens = np.array([0, 1, 5, 30, 100, 400])
    for floor in (0, 1, 8, 64):
        expected = [min(n, max(math.ceil(0.2 * n - 1e-9), floor, 1 if n else 0)) for n in tokens]
        assert kept_count(0.2, tokens, floor).tolist() == expected


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_a_floor_above_the_whole_sequence_generates_what_the_full_cache_generates(recipe):
    model = tiny_llama()
    inputs = left_pad(prompts([30, 17, 24]))
    profile = profile_with(model, 0.2, sink_tokens=2, recent_window=3, **RECIPES[recipe])
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, profile, min_kept=30 + NEW) as handle:
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
        with attach(model, profile) as handle:
            squeezed = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, out.scores)) < 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, squeezed.scores)) > 1e-3  # the floor did it


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_every_layer_holds_the_larger_of_the_budget_and_the_floor(recipe):
    model = tiny_llama()
    lengths = [40, 12]
    profile = profile_with(model, [0.1, 0.3, 0.5], sink_tokens=2, recent_window=3, **RECIPES[recipe])
    floor = 16
    with torch.no_grad(), attach(model, profile, min_kept=floor) as handle:
        cache = handle.new_cache()
        model.generate(**left_pad(prompts(lengths)), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
    layers = [layer for layer in cache.layers if isinstance(layer, CompressingLayer)]
    assert layers
    for layer in layers:
        total = np.array(lengths) + NEW - 1  # the last token is generated, never fed
        expected = [min(t, max(math.ceil(layer.plan.ratio * t - 1e-9), floor)) for t in total]
        assert layer.tokens.tolist() == total.tolist()
        assert layer.kept.tolist() == expected
        assert layer.valid.sum(dim=1).tolist() == expected


def test_a_padded_batch_with_a_floor_equals_single_runs():
    model = tiny_llama()
    seqs = prompts([50, 21, 33])
    profile = profile_with(model, 0.2, sink_tokens=2, recent_window=3, **RECIPES["heavy-hitter per-head"])
    with torch.no_grad(), attach(model, profile, min_kept=24) as handle:
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            alone = single.sequences[0, len(seq):]
            assert torch.equal(alone, batch.sequences[i, -NEW:][: len(alone)]), f"sequence {i}"


def test_caches_for_other_profiles_keep_the_handles_floor():
    model = tiny_llama()
    with attach(model, profile_with(model, 0.2), min_kept=7) as handle:
        other = handle.cache_for(profile_with(model, 0.3, eviction="tova", merge="none"))
        floors = {layer.plan.min_kept for layer in other.layers if isinstance(layer, CompressingLayer)}
        assert floors == {7}
        assert {l.plan.min_kept for l in handle.new_cache().layers if isinstance(l, CompressingLayer)} == {7}


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_a_bad_floor_is_a_one_line_error(bad):
    model = tiny_llama()
    with pytest.raises(KvtoolError, match="min-kept must be an integer >= 0"):
        attach(model, profile_with(model, 0.2), min_kept=bad)


def test_the_hint_names_the_floor_only_when_a_layer_is_left_a_handful():
    assert "--min-kept 64" in short_prompt_hint([0.05, 0.3], [34, 200], 0)
    assert "leaves some layers 2 entries" in short_prompt_hint([0.05, 0.3], [34], 0)
    assert short_prompt_hint([0.05, 0.3], [34], 64) is None  # a floor was asked for
    assert short_prompt_hint([0.05, 0.3], [2000], 0) is None  # 100 entries: enough
    assert short_prompt_hint([], [34], 0) is None  # nothing compressed
    assert short_prompt_hint([0.9], [2], 0) is None  # nothing dropped
