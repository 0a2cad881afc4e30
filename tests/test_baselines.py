"""The baselines (local, h2o) and the method registry: invariants, padding equivalence, budgets."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvtool.errors import KvtoolError
from kvtool.profiles import MERGE_MODES, SELECTION_RULES, Draft, save_profile
from kvtool.runtime import METHODS, attach, load_profile, method_profile
from kvtool.runtime.eviction import EVICT_RULES, EntryView
from kvtool.runtime.eviction.heavy_hitter import HeavyHitter
from kvtool.runtime.selection import kept_count
from kvtool.runtime.importance import decode_attention_with_scores
from kvtool.runtime.merge import MERGE_RULES
from kvtool.runtime.selection import SELECT_RULES
from kvtool.models.forward import with_cache
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_llama

NEW = 20
RATIOS = [0.3, 0.5, 0.2]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


# A recipe calibration may choose: every rule differs from the defaults.
CALIBRATED_RECIPE = dict(
    selection="importance", merge="none", eviction="tova", scorer="attention-sum", heads="per-head", recent_share=0.25,
    sink_tokens=2, recent_window=3, truncation_distance=5,
)


def recipe(model, name: str, ratios=RATIOS):
    m = METHODS[name]
    if m.recipe:
        calibrated = profile_with(model, ratios, **CALIBRATED_RECIPE)
        return method_profile(name, model, calibrated.budget, calibrated)
    return profile_with(
        model, ratios, selection=m.selection, merge=m.merge or "position", eviction=m.eviction,
        sink_tokens=2, recent_window=3, truncation_distance=5,
    )


def test_schema_names_match_the_runtime_registries():
    assert set(SELECTION_RULES) == set(SELECT_RULES)
    assert set(MERGE_MODES) == set(MERGE_RULES)
    for method in METHODS.values():
        assert method.selection in SELECT_RULES and (method.eviction in EVICT_RULES or method.recipe)
        assert method.merge in MERGE_RULES or (method.merge is None and method.per_layer)


def test_a_profile_naming_an_unknown_eviction_rule_is_refused_in_one_line(llama, tmp_path):
    # The profile layer stores the name; the runtime, which holds the registry, refuses it on load.
    path = tmp_path / "lru.yaml"
    save_profile(profile_with(llama, RATIOS), path)
    path.write_text(path.read_text().replace("eviction: fixed-point", "eviction: lru"))
    with pytest.raises(KvtoolError, match=rf"{path.name}: method\.eviction must be one of fixed-point, .*got 'lru'") as info:
        load_profile(path)
    assert "\n" not in str(info.value)


def test_a_profile_naming_the_removed_importance_mean_rule_is_refused(llama, tmp_path):
    # `importance-mean` ranked worse than `importance` and was removed; such a file fails in one line.
    path = tmp_path / "old.yaml"
    save_profile(profile_with(llama, RATIOS), path)
    path.write_text(path.read_text().replace("selection: importance", "selection: importance-mean"))
    with pytest.raises(KvtoolError, match=r"method\.selection.*'importance-mean'") as info:
        load_profile(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", list(METHODS))
def test_padded_batch_equals_single_runs(llama, name):
    seqs = prompts([61, 37, 50], seed=3)
    with torch.no_grad(), attach(llama, recipe(llama, name)) as handle:
        batch = llama.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(llama, handle.new_cache()), **GREEDY)
        for i, seq in enumerate(seqs):
            single = llama.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(llama, handle.new_cache()), **GREEDY)
            alone = single.sequences[0, len(seq):]
            assert torch.equal(alone, batch.sequences[i, -NEW:][: len(alone)]), f"sequence {i}"
            diff = max((a[0] - b[i]).abs().max().item() for a, b in zip(single.scores, batch.scores))
            assert diff < 1e-6


def _step_through(model, handle, seqs, steps):
    """Prompt forward plus `steps` greedy tokens by hand; yields the cache after every forward."""
    inputs = left_pad(seqs)
    cache = handle.new_cache(record_importance=True)
    mask = inputs["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(**inputs, position_ids=positions, **with_cache(model, cache), use_cache=True)
    yield cache
    position = mask.sum(1, keepdim=True)
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(len(seqs), 1)], dim=1)
        out = model(input_ids=token, attention_mask=mask, position_ids=position, **with_cache(model, cache), use_cache=True)
        position = position + 1
        yield cache


@pytest.mark.parametrize("name", ["local", "h2o"])
def test_every_step_within_each_layers_share(llama, name):
    seqs = prompts([45, 30], seed=4)
    with torch.no_grad(), attach(llama, recipe(llama, name)) as handle:
        for cache in _step_through(llama, handle, seqs, 60):
            for index, layer in cache.compressing_layers().items():
                share = np.ceil(RATIOS[index] * layer.tokens - 1e-9)
                assert (layer.valid.sum(1).numpy() == layer.kept).all()
                assert (layer.kept <= np.maximum(share, 1)).all()


def test_local_keeps_sinks_and_the_most_recent_tokens(llama):
    seqs = prompts([45, 30], seed=5)
    sinks = 2
    with torch.no_grad(), attach(llama, recipe(llama, "local")) as handle:
        for step, cache in enumerate(_step_through(llama, handle, seqs, 30)):
            for layer in cache.compressing_layers().values():
                for b in range(len(seqs)):
                    first = layer.seen - int(layer.tokens[b])  # left padding: real columns are the last ones
                    kept = sorted(layer.order[b][layer.valid[b]].tolist())
                    k = int(layer.kept[b])
                    expected = list(range(first, first + sinks)) + list(range(layer.seen - (k - sinks), layer.seen))
                    assert kept == expected, f"step {step}, row {b}"


def test_h2o_prompt_keeps_recent_half_and_top_importance(llama):
    seqs = prompts([45, 30], seed=6)
    with torch.no_grad(), attach(llama, recipe(llama, "h2o")) as handle:
        cache = next(_step_through(llama, handle, seqs, 0))
        for layer in cache.compressing_layers().values():
            for b in range(len(seqs)):
                n = int(layer.tokens[b])
                first = layer.seen - n
                importance = layer.prompt_importance[b, first:].tolist()
                k = int(layer.kept[b])
                recent = set(range(n - k // 2, n))
                rest = sorted((i for i in range(n) if i not in recent), key=lambda i: -importance[i])
                expected = sorted(recent | set(rest[: k - k // 2]))
                kept = sorted(c - first for c in layer.order[b][layer.valid[b]].tolist())
                assert kept == expected
                # Accumulated scores start at the prompt importance of the kept tokens.
                got = layer.score[b][layer.valid[b]]
                want = torch.tensor([importance[c - first] for c in layer.order[b][layer.valid[b]].tolist()], dtype=torch.float64)
                assert torch.allclose(got.double(), want, atol=1e-5)


def test_h2o_scores_accumulate_every_new_tokens_attention(llama):
    """Each step adds the new token's attention (probabilities averaged over heads sum to one) to the
    entries it saw: the total grows by exactly one on steps without an eviction, and by one minus what
    the evicted entry received on steps with one."""
    seqs = prompts([40], seed=7)
    kinds = set()
    with torch.no_grad(), attach(llama, recipe(llama, "h2o")) as handle:
        caches = _step_through(llama, handle, seqs, 25)
        layers = next(caches).compressing_layers()
        before = {i: (layer.score.clone(), layer.valid.clone(), layer.kept.copy()) for i, layer in layers.items()}
        for _ in range(25):
            next(caches)
            for i, layer in layers.items():
                score, valid, kept = before[i]
                width = layer.score.shape[1]
                old = F.pad(score * valid, (0, width - score.shape[1]))
                still = F.pad(valid, (0, width - valid.shape[1])) & layer.valid
                gained = float((layer.score * layer.valid).sum() - (old * still).sum())
                evicted = bool(layer.kept[0] == kept[0])
                kinds.add(evicted)
                if evicted:
                    assert 0.0 < gained < 1.0
                else:
                    assert math.isclose(gained, 1.0, abs_tol=1e-9)
                before[i] = (layer.score.clone(), layer.valid.clone(), layer.kept.copy())
    assert kinds == {True, False}


def test_h2o_victim_is_the_lowest_score_outside_the_recent_half():
    valid = torch.tensor([[True, True, True, True, True, True, False]])
    order = torch.tensor([[0, 1, 2, 3, 4, 5, 0]])
    score = torch.tensor([[5.0, 0.5, 3.0, 2.0, 0.1, 0.2, -9.0]])
    frozen = torch.zeros_like(valid)
    # The layer sets `share` (its plan's keep for the tokens seen) before it asks for a victim.
    entries = EntryView(valid, order, frozen, seen=6, share=kept_count(0.5, np.array([10])), score=score)
    # share ceil(0.5 * 10) = 5, recent half = 2: columns 4 and 5 are protected, slot 1 is lowest of the rest.
    assert HeavyHitter().victim(entries).tolist() == [1]
    # A floor of 8 entries makes the share 8 and the recent half 4: columns 2-5 protected, and of
    # columns 0 and 1 column 0 (5.0) is now the lower.
    entries = entries._replace(share=kept_count(0.5, np.array([10]), 8), score=torch.tensor([[5.0, 6.0, 3.0, 2.0, 0.1, 0.2, -9.0]]))
    assert HeavyHitter().victim(entries).tolist() == [0]
    # Rows with different bounds (a padded batch): each row protects its own newest columns.
    two = EntryView(valid.repeat(2, 1), order.repeat(2, 1), frozen.repeat(2, 1), seen=6, share=np.array([5, 8]),
                    score=torch.tensor([[5.0, 0.5, 3.0, 2.0, 0.1, 0.2, -9.0], [5.0, 6.0, 3.0, 2.0, 0.1, 0.2, -9.0]]))
    assert HeavyHitter().victim(two).tolist() == [1, 0]


def test_decode_attention_with_scores_matches_sdpa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    mask[1, ..., :4] = False
    out, received = decode_attention_with_scores(q, k, v, mask, 0.3)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask, scale=0.3)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-12)
    probs = torch.softmax((q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.3).masked_fill(~mask, -torch.inf), -1)
    assert torch.allclose(received, probs.mean(dim=1)[:, 0], atol=1e-12)
    assert received[1, :4].abs().max() == 0


def test_method_profile_settings_and_errors(llama):
    calibrated = profile_with(llama, RATIOS, sink_tokens=3, recent_window=5, truncation_distance=7)
    local = method_profile("local", llama, 0.2, calibrated)
    assert [layer.ratio for layer in local.layers] == [0.2, 0.2, 0.2]
    assert (local.method.selection, local.method.merge, local.method.eviction) == ("recent", "none", "sliding")
    assert (local.method.sink_tokens, local.method.truncation_distance) == (3, 7)
    for merge in ("position", "none"):
        own = dataclasses.replace(calibrated, method=dataclasses.replace(calibrated.method, merge=merge))
        assert method_profile("prefixkv", llama, own.budget, own).method.merge == merge  # the calibrated mode
        assert method_profile("prefixkv-merge", llama, own.budget, own).method.merge == "position"
    evict = method_profile("prefixkv-evict", llama, calibrated.budget, calibrated)
    assert [layer.ratio for layer in evict.layers] == RATIOS and evict.method.merge == "none"
    # kvtool runs the calibrated recipe as it is; its prompt-only twin only stops evicting.
    chosen = profile_with(llama, RATIOS, **CALIBRATED_RECIPE)
    assert method_profile("kvtool", llama, chosen.budget, chosen) == chosen
    held = method_profile("kvtool-prompt-only", llama, chosen.budget, chosen)
    assert held.method == dataclasses.replace(chosen.method, eviction="prompt-only") and held.layers == chosen.layers
    # A profile's draft runs with the recipe (prompt-only included); kvtool-no-draft and the baselines drop it.
    drafted = dataclasses.replace(chosen, method=dataclasses.replace(chosen.method, draft=Draft(4)))
    assert method_profile("kvtool", llama, chosen.budget, drafted).method.draft == Draft(4)
    assert method_profile("kvtool-prompt-only", llama, chosen.budget, drafted).method.draft == Draft(4)
    plain = method_profile("kvtool-no-draft", llama, chosen.budget, drafted)
    assert plain.method == chosen.method and plain.layers == chosen.layers
    assert all(method_profile(m, llama, chosen.budget, drafted).method.draft is None for m in ("tova", "h2o", "prefixkv", "snapkv"))
    # prefixkv stays the papers' recipe whatever calibration chose: shared attention-sum, fixed-point.
    papers = method_profile("prefixkv", llama, chosen.budget, chosen).method
    assert (papers.scorer, papers.heads, papers.eviction, papers.recent_share) == ("attention-sum", "shared", "fixed-point", 0.0)
    with pytest.raises(KvtoolError, match="unknown method 'snap'"):
        method_profile("snap", llama, 0.2)
    with pytest.raises(KvtoolError, match="needs a calibrated profile"):
        method_profile("prefixkv", llama, 0.2)
    with pytest.raises(KvtoolError, match=r"\(0, 1\]"):
        method_profile("local", llama, 1.5)
