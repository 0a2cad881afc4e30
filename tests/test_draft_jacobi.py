"""Jacobi rounds (`Draft.jacobi`): a later round's draft is the last round's full-attention predictions.

Checked against brute force: round one's draft stepped through the compressed cache by hand, its
predictions read off the prompt's forward with that draft appended (a plain `DynamicCache`, full
attention), and the second round's cache compressed by hand from the prompt's forward with the
predicted draft appended. The prefix the second round verifies is the full cache's greedy answer and
at least one token longer than the first round's; only the first round steps through the cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtool.profiles import Draft
from kvtool.runtime import KvtoolCache, attach
from kvtool.runtime import draft as drafting
from kvtool.runtime.draft import drafted, predicted_draft, prepare, verified_prefix, with_draft
from kvtool.runtime.steps import prompt_logits
from kvtool.scoring import left_pad, prompt_forward
from test_draft import RULES, kept_columns, prepare_by_part
from test_draft_verify import agreed, full_greedy, one_hot_logits
from test_runtime_rules import recipe_profile, rules_plans
from tiny_models import prompts, tiny_llama

K = 8


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_the_predicted_draft_is_the_verified_prefix_then_the_predictions():
    draft = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    predicted = [[6, 7, 8, 9], [6, 0, 7, 8], [9, 2, 3, 4]]
    logits = one_hot_logits(predicted)
    nxt = predicted_draft(draft, logits)
    assert nxt.tolist() == [[5, 6, 7, 8], [5, 6, 0, 7], [1, 9, 2, 3]]
    prefix = verified_prefix(draft, logits)
    for b in range(3):
        n = int(prefix.lengths[b])
        assert nxt[b, :n].tolist() == prefix.tokens[b, :n].tolist()


@pytest.mark.parametrize("case", list(RULES))
def test_the_second_round_scores_the_first_rounds_predictions(llama, case):
    profile = recipe_profile(llama, ratios=[0.3, 0.25, 0.35])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES[case]))  # noqa: E731
    batch = left_pad([s.tolist() for s in prompts([52, 33, 45], seed=11)], (0, 1, 2), 0)
    with torch.no_grad(), attach(llama, profile):
        ready = prepare(llama, batch, make, Draft(K, 2, verify=True, jacobi=True), rows=len(batch.input_ids))
        truth = full_greedy(llama, batch, K)
        plain = make()
        first = prompt_forward(llama, batch, plain)
        one = drafted(llama, plain, first, batch, K)  # round one: steps through the compressed cache
        logits = prompt_logits(llama, with_draft(batch, one), DynamicCache(config=llama.config), K)
        two = predicted_draft(one, logits)
        by_hand = make()
        by_hand.set_draft(K)
        prompt_forward(llama, with_draft(batch, two), by_hand)
        again = prompt_logits(llama, with_draft(batch, two), DynamicCache(config=llama.config), K)
    assert torch.equal(ready.first_logits, first)
    assert kept_columns(ready.cache) == kept_columns(by_hand)
    assert ready.prefix.lengths.tolist() == verified_prefix(two, again).lengths.tolist()
    first_round = torch.clamp(agreed(one, truth) + 1, max=K)
    assert (first_round < K).any() and not torch.equal(two, one)  # round one parted from the full cache somewhere
    assert (ready.prefix.lengths >= torch.clamp(first_round + 1, max=K)).all()  # a Jacobi step verifies one more
    for b in range(batch.input_ids.shape[0]):
        n = int(ready.prefix.lengths[b])
        assert ready.prefix.tokens[b, :n].tolist() == truth[b, :n].tolist()


def test_only_the_first_round_steps(llama):
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES["per-head-union-h2o"])
    batch = left_pad([s.tolist() for s in prompts([40, 26], seed=5)], (0, 1), 0)
    with torch.no_grad(), attach(llama, profile):
        order, seen, ready = prepare_by_part(llama, batch, lambda: KvtoolCache(llama.config, plans), [Draft(K, 3, True, jacobi=True)])
    width = batch.input_ids.shape[1]
    assert order == [drafting.PROMPT_FORWARD, drafting.DRAFT_STEPS, *[drafting.DRAFT_ROWS] * 3]
    assert seen == [(drafting.PROMPT_FORWARD, width), *[(drafting.DRAFT_STEPS, 1)] * (K - 1), *[(drafting.DRAFT_ROWS, K)] * 3]
    assert all(layer.held is None for layer in ready.cache.layers)


def test_padded_batch_gives_each_row_its_jacobi_rounds_alone(llama):
    profile = recipe_profile(llama, ratios=[0.3, 0.25, 0.35])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["shared-window-tova"]))  # noqa: E731
    seqs = [s.tolist() for s in prompts([61, 37, 50], seed=3)]
    draft = Draft(K, 2, verify=True, jacobi=True)
    with torch.no_grad(), attach(llama, profile):
        batch = left_pad(seqs, (0, 1, 2), 0)
        together = prepare(llama, batch, make, draft, rows=3)
        for i, seq in enumerate(seqs):
            pad = batch.input_ids.shape[1] - len(seq)
            alone = prepare(llama, left_pad([seq], (i,), 0), make, draft, rows=1)
            n = int(alone.prefix.lengths[0])
            assert int(together.prefix.lengths[i]) == n
            assert together.prefix.tokens[i, :n].tolist() == alone.prefix.tokens[0, :n].tolist()
            for index, layer in together.cache.compressing_layers().items():
                assert layer.kept[i] == alone.cache.layers[index].kept[0]
            alone_columns, together_columns = kept_columns(alone.cache), kept_columns(together.cache)
            for index, heads in alone_columns.items():  # the same entries, shifted by the row's padding
                assert [[c + pad for c in head] for head in heads[0]] == together_columns[index][i]


def test_a_jacobi_draft_round_trips_and_old_files_stay_as_they_were(tmp_path):
    import dataclasses

    from kvtool.profiles import read_profile, save_profile
    from kvtool.profiles.builtin import builtin_profile

    profile = read_profile(builtin_profile("smollm2", 0.2))
    assert profile.method.draft == Draft(32, 2, verify=True)  # the built-in steps its second round
    for draft, line in ((Draft(32, 2, True, jacobi=True), "draft: {tokens: 32, rounds: 2, verify: true, jacobi: true}"),
                        (Draft(32, 2, True), "draft: {tokens: 32, rounds: 2, verify: true}\n")):
        changed = dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=draft))
        path = tmp_path / "p.yaml"
        save_profile(changed, path)
        assert line in path.read_text()
        assert read_profile(path).method.draft == draft
    from kvtool.profiles.schema import draft_phrase

    assert draft_phrase(Draft(32, 2, True, jacobi=True)).endswith("(2 rounds, verified, later rounds from its predictions)")
    assert draft_phrase(Draft(32, 1, True, jacobi=True)).endswith("(verified)")  # one round has no later round
