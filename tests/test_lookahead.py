"""Lookahead: the first k new tokens are generated over the whole prompt and their attention joins
the prompt's scores before the layer compresses.

The reference is exact: the k lookahead tokens attend to the full cache, so their attention rows
are the last k rows of a causal prompt pass over prompt + k tokens. A layer with lookahead k over
an n-token prompt therefore holds, after the k-th token, exactly what a layer without lookahead
holds after a prompt forward over those n + k tokens with an observation window k rows longer, and
every later logit is the same (float64). Pooling is off and the recent window covers both
observation windows, so the two protect the same recent tokens.

A bounded lookahead (`lookahead_hold = C`) holds C times the layer's share instead: during the
lookahead it is exactly a prompt-only cache compressed to that many entries, and a hold that covers
the prompt is the whole-prompt lookahead. Padded batches equal single runs for both
(tests/test_runtime_rules.py, BATCH_CASES)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.runtime import KvtoolCache, attach
from kvtool.runtime.layer import LayerPlan
from kvtool.runtime.eviction import evict_rule
from test_runtime_rules import RATIOS, recipe_profile, rules_plans
from tiny_models import GREEDY, left_pad, prompts, tiny_llama

K, WINDOW = 5, 6
CASES = {
    "shared-window-tova": dict(heads="shared", scorer="window", evict="tova"),
    "per-head-union-h2o": dict(heads="per-head", scorer="union", evict="heavy-hitter"),
    "per-head-sum-fixed-point": dict(heads="per-head", scorer="attention-sum", evict="fixed-point"),
    "shared-window-h2o-window": dict(heads="shared", scorer="window", evict="heavy-hitter-window"),
    "per-head-window-prompt-only": dict(heads="per-head", scorer="window", evict="prompt-only"),
}


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def plans(profile, lookahead: int, window: int, **case):
    return rules_plans(profile, pool=1, window=window, recent_window=WINDOW + K, lookahead=lookahead, **case)


def feed(model, cache, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Prompt forward of `ids`, then `tokens` one at a time; the logits after each forward."""
    out = model(input_ids=torch.tensor([ids]), **with_cache(model, cache), use_cache=True)
    logits = [out.logits[0, -1]]
    for token in tokens:
        out = model(input_ids=torch.tensor([[token]]), **with_cache(model, cache), use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


def kept_columns(cache) -> dict[int, list]:
    out = {}
    for index, layer in cache.compressing_layers().items():
        order = layer.order if layer.per_head else layer.order[:, None]
        out[index] = [sorted(order[0, h][layer.valid[0]].tolist()) for h in range(order.shape[1])]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_lookahead_equals_compressing_the_longer_prompt(llama, case):
    profile = recipe_profile(llama)
    (seq,) = prompts([40], seed=6)
    ids = seq.tolist()
    more = torch.randint(3, 90, (K + 12,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad(), attach(llama, profile):
        ahead = KvtoolCache(llama.config, plans(profile, K, WINDOW, **CASES[case]))
        got = feed(llama, ahead, ids, more)
        plain = KvtoolCache(llama.config, plans(profile, 0, WINDOW + K, **CASES[case]))
        want = feed(llama, plain, ids + more[:K], more[K:])
        for step, (a, b) in enumerate(zip(got[K:], want)):
            assert (a - b).abs().max().item() < 1e-9, f"step {step}"
        assert kept_columns(ahead) == kept_columns(plain)
        # ... and it is not what compressing right after the prompt keeps.
        now = KvtoolCache(llama.config, plans(profile, 0, WINDOW, **CASES[case]))
        late = feed(llama, now, ids, more)
        assert kept_columns(now) != kept_columns(ahead)
        assert max((a - b).abs().max().item() for a, b in zip(late[K:], got[K:])) > 1e-6


def test_nothing_is_dropped_during_the_lookahead_and_the_budget_holds_after(llama):
    profile = recipe_profile(llama)
    seqs = prompts([45, 30], seed=4)
    layer_plans_ = plans(profile, K, WINDOW, heads="per-head", scorer="union", evict="tova")
    inputs = left_pad(seqs)
    mask = inputs["attention_mask"]
    with torch.no_grad(), attach(llama, profile):
        cache = KvtoolCache(llama.config, layer_plans_)
        out = llama(**inputs, position_ids=(mask.cumsum(1) - 1).clamp(min=0), **with_cache(llama, cache), use_cache=True)
        position = mask.sum(1, keepdim=True)
        for step in range(1, 30):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            out = llama(input_ids=token, attention_mask=mask, position_ids=position, **with_cache(llama, cache), use_cache=True)
            position = position + 1
            for index, layer in cache.compressing_layers().items():
                tokens = np.array([45 + step, 30 + step])
                assert layer.tokens.tolist() == tokens.tolist()
                want = tokens if step < K else np.ceil(RATIOS[index] * tokens - 1e-9)
                assert layer.kept.tolist() == want.tolist() == layer.valid.sum(1).tolist(), (step, index)
                assert layer.per_head == (step >= K)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_lookahead_is_refused(llama, bad):
    profile = recipe_profile(llama)
    plan = next(p for p in rules_plans(profile) if p is not None)
    with pytest.raises(KvtoolError, match="lookahead"):
        dataclasses.replace(plan, lookahead=bad)
    assert isinstance(plan, LayerPlan)


# ----- a bounded lookahead: hold a multiple of the share, not the whole prompt ------------------

HOLD = 2.0
SHARED_CASES = {k: v for k, v in CASES.items() if v["heads"] == "shared"}


def held_count(ratio: float, n: int) -> int:
    return min(n, math.ceil(HOLD * math.ceil(ratio * n - 1e-9) - 1e-9))


@pytest.mark.parametrize("case", list(CASES))
def test_a_hold_that_covers_the_prompt_is_the_whole_prompt_lookahead(llama, case):
    profile = recipe_profile(llama)
    (seq,) = prompts([40], seed=6)
    more = torch.randint(3, 90, (K + 10,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad(), attach(llama, profile):
        whole = KvtoolCache(llama.config, plans(profile, K, WINDOW, **CASES[case]))
        a = feed(llama, whole, seq.tolist(), more)
        covered = [None if p is None else dataclasses.replace(p, lookahead_hold=1 / min(RATIOS) + 0.5)
                   for p in plans(profile, K, WINDOW, **CASES[case])]
        held = KvtoolCache(llama.config, covered)
        b = feed(llama, held, seq.tolist(), more)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert kept_columns(whole) == kept_columns(held)


@pytest.mark.parametrize("case", list(SHARED_CASES))
def test_the_hold_is_the_prompt_compressed_to_that_multiple(llama, case):
    """During the lookahead a layer holding HOLD times its share is a prompt-only cache whose
    ratio keeps exactly that many entries (same scorer, sinks, recent window): the same logits;
    afterwards it holds ceil(R * T) entries, all from the held ones and the new tokens."""
    profile = recipe_profile(llama)
    (seq,) = prompts([40], seed=6)
    n = len(seq)
    more = torch.randint(3, 90, (K + 10,), generator=torch.Generator().manual_seed(3)).tolist()
    held_plans = [None if p is None else dataclasses.replace(p, lookahead_hold=HOLD) for p in plans(profile, K, WINDOW, **CASES[case])]
    reference = [
        None if p is None else dataclasses.replace(p, ratio=held_count(p.ratio, n) / n, lookahead=0, evict=evict_rule("prompt-only"))
        for p in held_plans
    ]
    with torch.no_grad(), attach(llama, profile):
        held = KvtoolCache(llama.config, held_plans)
        got = feed(llama, held, seq.tolist(), more[:K - 1])
        pool = kept_columns(held)
        plain = KvtoolCache(llama.config, reference)
        want = feed(llama, plain, seq.tolist(), more[:K - 1])
        assert all((a - b).abs().max().item() < 1e-9 for a, b in zip(got, want))
        assert pool == kept_columns(plain)
        for index, layer in held.compressing_layers().items():
            assert layer.kept.tolist() == [held_count(RATIOS[index], n) + K - 1]
        feed_more(llama, held, more[K - 1:])
    for index, layer in held.compressing_layers().items():
        tokens = n + len(more)
        assert layer.tokens.tolist() == [tokens]
        assert layer.kept.tolist() == [math.ceil(RATIOS[index] * tokens - 1e-9)] == layer.valid.sum(1).tolist()
        assert set(kept_columns(held)[index][0]) <= set(pool[index][0]) | set(range(n, tokens))


def feed_more(model, cache, tokens: list[int]) -> None:
    for token in tokens:
        model(input_ids=torch.tensor([[token]]), **with_cache(model, cache), use_cache=True)


@pytest.mark.parametrize("bad", [0.5, -1, True])
def test_bad_hold_is_refused(llama, bad):
    plan = next(p for p in rules_plans(recipe_profile(llama)) if p is not None)
    with pytest.raises(KvtoolError, match="lookahead hold"):
        dataclasses.replace(plan, lookahead_hold=bad)
