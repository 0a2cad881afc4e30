"""Verified drafts: the draft's own forward confirms its prefix, which is the full cache's greedy answer.

Checked against brute force: the full cache's greedy tokens from a plain `DynamicCache`, and the draft
each round drafts, rebuilt by hand. The verified prefix must be exactly the full cache's greedy tokens,
as long as the draft agrees with them plus one; a later round drafts from it; a padded batch gives each
row what it gives alone; `generate` writes the verified prefix and then the compressed cache's greedy
tokens, as the step-by-step pass does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtool.profiles import Draft
from kvtool.runtime import KvtoolCache, attach
from kvtool.runtime.draft import ForcedPrefix, Verified, drafted, prepare, verified_prefix
from kvtool.scoring import left_pad, prompt_forward, step_tokens
from test_draft import RULES, kept_columns, tiny_generate_case
from test_runtime_rules import recipe_profile, rules_plans
from tiny_models import prompts, tiny_llama

K = 8


def drafted_prompt(model, batch, make_cache, tokens, rounds, verify):
    """The prepared cache, the prompt's last logits and the verified prefix (`runtime.draft.prepare`)."""
    ready = prepare(model, batch, make_cache, Draft(tokens, rounds, verify), rows=len(batch.input_ids))
    return ready.cache, ready.first_logits, ready.prefix


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def one_hot_logits(predicted: list[list[int]], vocab: int = 12) -> torch.Tensor:
    logits = torch.zeros(len(predicted), len(predicted[0]), vocab)
    for b, row in enumerate(predicted):
        for j, token in enumerate(row):
            logits[b, j, token] = 1.0
    return logits


def test_the_prefix_is_the_agreed_draft_plus_the_first_disagreeing_prediction():
    draft = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4]])
    predicted = [[6, 7, 8, 9], [6, 0, 7, 8], [9, 2, 3, 4], [2, 3, 4, 0]]
    prefix = verified_prefix(draft, one_hot_logits(predicted))
    assert prefix.lengths.tolist() == [4, 3, 2, 4]
    assert prefix.tokens[0].tolist() == [5, 6, 7, 8]
    assert prefix.tokens[1, :3].tolist() == [5, 6, 0]
    assert prefix.tokens[2, :2].tolist() == [1, 9]
    assert prefix.tokens[3].tolist() == [1, 2, 3, 4]  # all agreed: the draft is kept whole


def test_choose_feeds_the_prefix_then_greedy():
    prefix = Verified(tokens=torch.tensor([[3, 4, 5], [7, 8, 9]]), lengths=torch.tensor([3, 1]))
    logits = torch.zeros(2, 10)
    logits[:, 2] = 1.0
    assert prefix.choose(0, logits).tolist() == [3, 7]
    assert prefix.choose(1, logits).tolist() == [4, 2]
    assert prefix.choose(3, logits).tolist() == [2, 2]


def test_forced_prefix_makes_generate_pick_the_verified_tokens():
    prefix = Verified(tokens=torch.tensor([[3, 4, 5], [7, 8, 9]]), lengths=torch.tensor([2, 3]))
    force = ForcedPrefix(prefix, start=6)
    scores = torch.randn(2, 10)
    assert torch.equal(force(torch.zeros(2, 6, dtype=torch.long), scores).argmax(-1), torch.tensor([3, 7]))
    third = force(torch.zeros(2, 8, dtype=torch.long), scores)
    assert torch.equal(third[0], scores[0])  # row 0 has only two verified tokens
    assert int(third[1].argmax()) == 9
    assert torch.equal(force(torch.zeros(2, 9, dtype=torch.long), scores), scores)


def full_greedy(model, batch, steps: int) -> torch.Tensor:
    """[B, steps] greedy tokens through a plain transformers cache."""
    cache = DynamicCache(config=model.config)
    chosen = []
    step_tokens(model, cache, prompt_forward(model, batch, cache), batch, steps,
                lambda t, logits: chosen.append(logits.argmax(-1)) or chosen[-1])
    return torch.stack(chosen, dim=1)


def agreed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading tokens of a and b are equal."""
    return (a == b).long().cumprod(dim=1).sum(dim=1)


@pytest.mark.parametrize("case", list(RULES))
def test_each_rounds_prefix_is_the_full_caches_greedy_answer(llama, case):
    profile = recipe_profile(llama, ratios=[0.3, 0.25, 0.35])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES[case]))  # noqa: E731
    batch = left_pad([s.tolist() for s in prompts([52, 33, 45], seed=11)], (0, 1, 2), 0)
    short = []
    with torch.no_grad(), attach(llama, profile):
        truth = full_greedy(llama, batch, K)
        plain = make()
        first = prompt_forward(llama, batch, plain)
        draft = drafted(llama, plain, first, batch, K)  # round one's draft, by hand
        previous = None
        for rounds in (1, 2, 3):
            cache, again, prefix = drafted_prompt(llama, batch, make, K, rounds, verify=True)
            assert torch.equal(again, first)
            expected = torch.clamp(agreed(draft, truth) + 1, max=K)
            assert prefix.lengths.tolist() == expected.tolist(), f"round {rounds}"
            for b in range(batch.input_ids.shape[0]):
                assert prefix.tokens[b, : prefix.lengths[b]].tolist() == truth[b, : prefix.lengths[b]].tolist()
            if previous is not None:
                assert (prefix.lengths >= previous).all()  # a round drafts from the last one's prefix
            short.append(bool((prefix.lengths < K).any()))
            previous = prefix.lengths
            draft = drafted(llama, cache, first, batch, K, prefix)  # the next round's draft, by hand
    assert any(short)  # some draft parted from the full cache's answer: the prediction branch ran


def test_a_verified_round_keeps_what_its_draft_scores(llama):
    """The prompt forward that verifies is the one that scores: what it keeps is the by-hand cache's."""
    profile = recipe_profile(llama, ratios=[0.3, 0.25, 0.35])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["per-head-union-h2o"]))  # noqa: E731
    batch = left_pad([s.tolist() for s in prompts([41, 30], seed=4)], (0, 1), 0)
    from kvtool.runtime.draft import with_draft

    with torch.no_grad(), attach(llama, profile):
        one, first, prefix = drafted_prompt(llama, batch, make, K, 1, verify=True)
        two, _, _ = drafted_prompt(llama, batch, make, K, 2, verify=True)
        by_hand = make()
        by_hand.set_draft(K)
        prompt_forward(llama, with_draft(batch, drafted(llama, one, first, batch, K, prefix)), by_hand)
    assert kept_columns(two) == kept_columns(by_hand)


def test_padded_batch_gives_each_row_its_prefix_alone(llama):
    profile = recipe_profile(llama, ratios=[0.3, 0.25, 0.35])
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["shared-window-tova"]))  # noqa: E731
    seqs = [s.tolist() for s in prompts([61, 37, 50], seed=3)]
    with torch.no_grad(), attach(llama, profile):
        _, _, together = drafted_prompt(llama, left_pad(seqs, (0, 1, 2), 0), make, K, 2, verify=True)
        for i, seq in enumerate(seqs):
            _, _, alone = drafted_prompt(llama, left_pad([seq], (i,), 0), make, K, 2, verify=True)
            n = int(alone.lengths[0])
            assert int(together.lengths[i]) == n
            assert together.tokens[i, :n].tolist() == alone.tokens[0, :n].tolist()


@pytest.mark.parametrize("rounds", [1, 2])
def test_generate_writes_the_prefix_then_the_compressed_caches_greedy_tokens(tiny_llama_dir, rounds):
    from kvtool.models.prompts import format_prompts
    from kvtool.runtime.generate import generate

    model, tokenizer, texts, profile, eos = tiny_generate_case(tiny_llama_dir)
    new = 12
    with attach(model, profile) as handle:
        result = generate(
            model, tokenizer, texts, max_new_tokens=new, cache_factory=handle.new_cache, draft=Draft(K, rounds, verify=True),
        )
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in format_prompts(tokenizer, texts)]
        batch = left_pad(ids, (0, 1), tokenizer.pad_token_id)
        with torch.no_grad():
            cache, first, prefix = drafted_prompt(model, batch, handle.new_cache, K, rounds, verify=True)
            chosen = []
            step_tokens(model, cache, first, batch, new, lambda t, logits: chosen.append(prefix.choose(t, logits)) or chosen[-1])
            truth = full_greedy(model, batch, K)
    for row, output in enumerate(result.outputs):
        tokens = [int(step[row]) for step in chosen]
        n = int(prefix.lengths[row])
        assert tokens[:n] == truth[row, :n].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
        assert output == tokenizer.decode(tokens[:cut], skip_special_tokens=True)
    assert result.kv_bytes < 0.7 * result.kv_bytes_full
