"""A draft: tokens drafted through the compressed cache score the prompt again, then are dropped.

What a draft layer keeps after the second prompt forward is checked against an eager-attention
brute force for every rule in tests/test_runtime_rules.py (CASES, `draft` ids). Here: the two-pass
helper drafts exactly the plain compressed cache's greedy tokens and hands that draft to the second
cache; the first logits are the prompt's own (the first token is the full cache's); padded batches
equal single runs; the budget holds; what cannot work is refused in one line.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.runtime import KvtoolCache, attach
from kvtool.scoring import draft_prompt_forward, left_pad, prompt_forward, step_tokens
from kvtool.scoring.draft import drafted, with_draft
from test_runtime_rules import RATIOS, recipe_profile, rules_plans
from tiny_models import profile_with, prompts, tiny_gemma3, tiny_llama

K = 5
RULES = {
    "shared-window-tova": dict(heads="shared", scorer="window", window=4, pool=3, evict="tova"),
    "per-head-union-h2o": dict(heads="per-head", scorer="union", window=6, pool=7, evict="heavy-hitter"),
    "shared-sum-fixed-point": dict(heads="shared", scorer="attention-sum", evict="fixed-point"),
}


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def kept_columns(cache) -> dict[int, list]:
    out = {}
    for index, layer in cache.compressing_layers().items():
        order = layer.order if layer.per_head else layer.order[:, None]
        out[index] = [[sorted(order[b, h][layer.valid[b]].tolist()) for h in range(order.shape[1])] for b in range(order.shape[0])]
    return out


def forced_logits(model, cache, first, batch, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits after the prompt and after each of `tokens` [B, L] fed one at a time."""
    seen = []

    def feed(t, logits):
        seen.append(logits.clone())
        return tokens[:, t] if t < tokens.shape[1] else None

    step_tokens(model, cache, first, batch, tokens.shape[1] + 1, feed)
    return seen


@pytest.mark.parametrize("case", list(RULES))
def test_the_draft_is_the_compressed_caches_own_greedy_tokens(llama, case):
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES[case])
    batch = left_pad([s.tolist() for s in prompts([40, 26], seed=5)], (0, 1), 0)
    make = lambda: KvtoolCache(llama.config, plans)  # noqa: E731
    with torch.no_grad(), attach(llama, profile):
        cache, first = draft_prompt_forward(llama, batch, make, K)
        plain = make()
        plain_first = prompt_forward(llama, batch, plain)
        assert torch.equal(first, plain_first)  # the prompt's own logits: the first token is the full cache's
        draft = drafted(llama, plain, plain_first, batch, K)
        assert draft.shape == (2, K)
        by_hand = make()
        by_hand.set_draft(K)
        prompt_forward(llama, with_draft(batch, draft), by_hand)
        assert kept_columns(cache) == kept_columns(by_hand)
        # ... and the draft changed what was kept.
        assert kept_columns(cache) != kept_columns(plain)
        for index, layer in cache.compressing_layers().items():
            n = batch.attention_mask.sum(dim=1)
            assert layer.seen == batch.input_ids.shape[1] == cache.get_seq_length()
            assert layer.kept.tolist() == [math.ceil(RATIOS[index] * int(t) - 1e-9) for t in n]
            assert max(max(cols) for head in kept_columns(cache)[index] for cols in head) < batch.input_ids.shape[1]


def test_no_draft_is_the_plain_prompt_forward(llama):
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES["shared-window-tova"])
    batch = left_pad([prompts([30], seed=2)[0].tolist()], (0,), 0)
    with torch.no_grad(), attach(llama, profile):
        cache, first = draft_prompt_forward(llama, batch, lambda: KvtoolCache(llama.config, plans), 0)
        plain = KvtoolCache(llama.config, plans)
        assert torch.equal(first, prompt_forward(llama, batch, plain))
        assert kept_columns(cache) == kept_columns(plain)


@pytest.mark.parametrize("case", list(RULES))
def test_padded_batch_equals_single_runs(llama, case):
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES[case])
    seqs = [s.tolist() for s in prompts([61, 37, 50], seed=3)]
    forced = torch.randint(3, 90, (3, 24), generator=torch.Generator().manual_seed(2))
    make = lambda: KvtoolCache(llama.config, plans)  # noqa: E731
    with torch.no_grad(), attach(llama, profile):
        batch = left_pad(seqs, (0, 1, 2), 0)
        cache, first = draft_prompt_forward(llama, batch, make, K)
        together = forced_logits(llama, cache, first, batch, forced)
        for i, seq in enumerate(seqs):
            alone_batch = left_pad([seq], (i,), 0)
            alone_cache, alone_first = draft_prompt_forward(llama, alone_batch, make, K)
            alone = forced_logits(llama, alone_cache, alone_first, alone_batch, forced[i : i + 1])
            diff = max((a[0] - b[i]).abs().max().item() for a, b in zip(alone, together))
            assert diff < 1e-6, f"sequence {i}"
            for index, layer in cache.compressing_layers().items():
                assert layer.kept[i] == alone_cache.layers[index].kept[0]  # the budget, held through the steps


def test_a_draft_cannot_be_set_late_or_with_a_lookahead(llama):
    profile = recipe_profile(llama)
    cache = KvtoolCache(llama.config, rules_plans(profile))
    with torch.no_grad(), attach(llama, profile):
        llama(input_ids=prompts([12])[0][None], use_cache=True, **with_cache(llama, cache))
    with pytest.raises(KvtoolError, match="before the prompt"):
        cache.set_draft(3)
    looking = KvtoolCache(llama.config, rules_plans(profile, lookahead=2))
    with pytest.raises(KvtoolError, match="draft and a lookahead"):
        looking.set_draft(3)
    with pytest.raises(KvtoolError, match="draft tokens must be an integer >= 0"):
        KvtoolCache(llama.config, rules_plans(profile)).set_draft(-1)


def test_hybrid_models_are_refused_in_one_line():
    gemma = tiny_gemma3()
    profile = profile_with(gemma, 0.5)
    from kvtool.runtime.attach import layer_plans

    cache = KvtoolCache(gemma.config, layer_plans(profile))
    with pytest.raises(KvtoolError, match="every layer to be a kvtool layer"):
        cache.set_draft(4)
    cache.set_draft(0)  # no draft: nothing to refuse
