"""Reused drafts: while the answer is fed a verified draft's agreed tokens, the cache stores the keys
and values the draft's forward computed for them, which are the full cache's own.

Checked against brute force: a plain `DynamicCache` filled with the prompt and the full cache's greedy
tokens in one forward holds the full cache's keys and values at every position. Every entry a
reusing cache holds for an agreed token must be that one (and without reuse, in the deeper layers,
it is not); a row fed other tokens reuses only the common prefix; a padded batch gives each row what
it gives alone; `generate` writes what the step-by-step pass does; nothing is held once used.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvtool.runtime import KvtoolCache, attach
from kvtool.scoring import drafted_prompt, left_pad, prompt_forward, step_tokens
from kvtool.scoring.draft import with_draft
from test_draft import RULES, tiny_generate_case
from test_draft_verify import full_greedy
from test_runtime_rules import recipe_profile, rules_plans
from tiny_models import prompts, tiny_llama

K = 8


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def full_entries(model, batch, tokens: torch.Tensor) -> DynamicCache:
    """The full cache's keys and values for the prompt followed by `tokens` [B, L], in one forward."""
    cache = DynamicCache(config=model.config)
    prompt_forward(model, with_draft(batch, tokens), cache)
    return cache


def held(layer, b: int, column: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(KV head, key, value) of every head of row b whose entries include logical `column`."""
    order = layer.order if layer.per_head else layer.order[:, None].expand(-1, layer.keys.shape[1], -1)
    out = []
    for h in range(layer.keys.shape[1]):
        slots = torch.nonzero((order[b, h] == column) & layer.valid[b])[:, 0]
        out += [(h, layer.keys[b, h, int(s)], layer.values[b, h, int(s)]) for s in slots]
    return out


def feed(model, cache, first, batch, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Feed `tokens` [B, L] one step at a time; the logits of every step."""
    seen = []

    def pick(t, logits):
        seen.append(logits)
        return tokens[:, t]

    step_tokens(model, cache, first, batch, tokens.shape[1], pick)
    return seen


def compared(llama, case: str, reuse: bool, seqs, pads) -> tuple[int, int, torch.Tensor]:
    """Generate the verified prefix through a drafted cache; count the entries of agreed tokens it
    holds (all, and those equal to the full cache's); and return the rows' agreed lengths."""
    profile = recipe_profile(llama, ratios=[0.5, 0.45, 0.55])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES[case]))  # noqa: E731
    batch = left_pad(seqs, pads, 0)
    width = batch.input_ids.shape[1]
    with torch.no_grad(), attach(llama, profile):
        cache, first, prefix = drafted_prompt(llama, batch, make, K, 2, verify=True, reuse=reuse)
        truth = full_greedy(llama, batch, K)
        full = full_entries(llama, batch, truth)
        feed(llama, cache, first, batch, torch.cat([prefix.tokens, truth[:, :1]], dim=1))  # the last one fed too
    total = same = 0
    for index, layer in cache.compressing_layers().items():
        assert layer._draft_kv is None  # freed once the agreed tokens are stored
        if index == 0:
            continue  # the first layer's keys and values depend on the token alone
        for b in range(len(seqs)):
            for t in range(int(prefix.agreed[b])):
                for h, key, value in held(layer, b, width + t):
                    total += 1
                    full_key, full_value = full.layers[index].keys[b, h, width + t], full.layers[index].values[b, h, width + t]
                    same += int(torch.allclose(key, full_key, atol=1e-9) and torch.allclose(value, full_value, atol=1e-9))
    return total, same, prefix.agreed


@pytest.mark.parametrize("case", list(RULES))
def test_the_agreed_tokens_entries_are_the_full_caches_own(llama, case):
    seqs = [s.tolist() for s in prompts([52, 33, 45], seed=11)]
    total, same, agreed = compared(llama, case, True, seqs, (0, 1, 2))
    assert int(agreed.max()) >= 2 and total > 0
    assert same == total
    # The check can fail: without reuse the deeper layers' entries are the compressed cache's.
    total_plain, same_plain, _ = compared(llama, case, False, seqs, (0, 1, 2))
    assert total_plain > 0 and same_plain < total_plain


def test_a_row_fed_other_tokens_reuses_only_what_it_shares_with_its_draft(llama):
    """Teacher-forcing a reference that leaves the draft at step j gives exactly what a cache told
    to reuse only j tokens gives (and the tokens after j are computed as usual)."""
    profile = recipe_profile(llama, ratios=[0.5, 0.45, 0.55])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["per-head-union-h2o"]))  # noqa: E731
    batch = left_pad([s.tolist() for s in prompts([40, 47], seed=5)], (0, 1), 0)
    with torch.no_grad(), attach(llama, profile):
        cache, first, prefix = drafted_prompt(llama, batch, make, K, 1, verify=True, reuse=True)
        assert int(prefix.agreed.min()) >= 3
        other = prefix.tokens.clone()
        other[0, 1] = (other[0, 1] + 1) % 50 + 3  # row 0 leaves its draft at step 1; row 1 follows it
        import copy

        by_hand = copy.deepcopy(cache)
        by_hand.reuse_draft(prefix.tokens, np.array([1, int(prefix.agreed[1])]))
        reused = feed(llama, cache, first, batch, other)
        expected = feed(llama, by_hand, first, batch, other)
    for got, want in zip(reused, expected):
        assert torch.equal(got, want)
    for index, layer in cache.compressing_layers().items():
        assert torch.equal(layer.keys, by_hand.layers[index].keys)


def test_padded_batch_gives_each_row_what_it_gives_alone(llama):
    profile = recipe_profile(llama, ratios=[0.3, 0.25, 0.35])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["shared-window-tova"]))  # noqa: E731
    seqs = [s.tolist() for s in prompts([61, 37, 50], seed=3)]
    steps = K + 4
    with torch.no_grad(), attach(llama, profile):
        batch = left_pad(seqs, (0, 1, 2), 0)
        cache, first, prefix = drafted_prompt(llama, batch, make, K, 2, verify=True, reuse=True)
        chosen = []
        step_tokens(llama, cache, first, batch, steps, lambda t, logits: chosen.append(prefix.choose(t, logits)) or chosen[-1])
        together = torch.stack(chosen, dim=1)
        for i, seq in enumerate(seqs):
            alone_batch = left_pad([seq], (i,), 0)
            alone_cache, alone_first, alone_prefix = drafted_prompt(llama, alone_batch, make, K, 2, verify=True, reuse=True)
            assert int(alone_prefix.agreed[0]) == int(prefix.agreed[i])
            mine = []
            step_tokens(llama, alone_cache, alone_first, alone_batch, steps,
                        lambda t, logits: mine.append(alone_prefix.choose(t, logits)) or mine[-1])
            assert together[i].tolist() == torch.stack(mine, dim=1)[0].tolist()


def test_generate_with_reuse_writes_what_the_step_by_step_pass_does(tiny_llama_dir):
    from kvtool.models.prompts import format_prompts
    from kvtool.runtime.generate import generate

    model, tokenizer, texts, profile, eos = tiny_generate_case(tiny_llama_dir)
    new = 12
    with attach(model, profile) as handle:
        result = generate(
            model, tokenizer, texts, max_new_tokens=new, cache_factory=handle.new_cache, draft=K,
            draft_rounds=2, draft_verify=True, draft_reuse=True,
        )
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in format_prompts(tokenizer, texts)]
        batch = left_pad(ids, (0, 1), tokenizer.pad_token_id)
        with torch.no_grad():
            cache, first, prefix = drafted_prompt(model, batch, handle.new_cache, K, 2, verify=True, reuse=True)
            chosen = []
            step_tokens(model, cache, first, batch, new, lambda t, logits: chosen.append(prefix.choose(t, logits)) or chosen[-1])
    for row, output in enumerate(result.outputs):
        tokens = [int(step[row]) for step in chosen]
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
        assert output == tokenizer.decode(tokens[:cut], skip_special_tokens=True)
    assert result.kv_bytes < 0.7 * result.kv_bytes_full


def test_an_unverified_or_reordered_cache_reuses_nothing(llama):
    profile = recipe_profile(llama, ratios=[0.5, 0.45, 0.55])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["shared-window-tova"]))  # noqa: E731
    batch = left_pad([s.tolist() for s in prompts([40, 47], seed=5)], (0, 1), 0)
    with torch.no_grad(), attach(llama, profile):
        cache, first, prefix = drafted_prompt(llama, batch, make, K, 1, verify=True, reuse=True)
        assert not cache.follows_draft or int(prefix.agreed.max()) > 0
        cache.batch_select_indices(torch.tensor([1, 0]))  # rows swapped: they no longer follow their drafts
        assert not cache.follows_draft
        assert all(layer._draft_kv is None for layer in cache.compressing_layers().values())
        # A cache kept its draft but never told which tokens agreed holds nothing once it decodes.
        kept = make()
        kept.set_draft(K, keep=True)
        prompt_forward(llama, with_draft(batch, prefix.tokens), kept)
        assert all(layer._draft_kv is not None for layer in kept.compressing_layers().values())
        feed(llama, kept, first, batch, prefix.tokens[:, :2])  # one step fed
        assert all(layer._draft_kv is None for layer in kept.compressing_layers().values())
