"""The scoring engine (kvtool.scoring): greedy references and teacher-forced NLL on one stepping
loop, checked against plain forwards over the whole sequence and against each other."""

from __future__ import annotations


import pytest
import torch
from transformers import DynamicCache

from kvtool.scoring import left_pad, prompt_forward, reference_continuations, teacher_forced, teacher_forced_nll
from tiny_models import tiny_llama

LENGTH = 7


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, seed=5)


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (12, 7, 10)]
    return left_pad(sequences, (0, 1, 2), pad_id=0)


def prompt(model, batch):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        return cache, prompt_forward(model, batch, cache)


def references(model, batch, *, eos=(), answers=(None, None, None), length=LENGTH, on_step=None):
    cache, first = prompt(model, batch)
    with torch.inference_mode():
        refs = reference_continuations(
            model, cache, first, batch, length=length, eos_ids=set(eos), pad_id=0, answers=list(answers), on_step=on_step
        )
    return refs


def plain_nll(model, batch, row: int, tokens: list[int]) -> list[float]:
    """NLL of `tokens` after the row's prompt, from one forward without a cache and without padding."""
    ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + tokens])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [-float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(tokens)]


def test_greedy_references_match_plain_forwards(model, batch) -> None:
    steps = []
    refs = references(model, batch, on_step=lambda: steps.append(1))
    assert refs.scored.all() and refs.steps == LENGTH
    assert len(steps) == LENGTH - 1  # no forward after the last token
    for row in range(3):
        tokens = refs.tokens[row].tolist()
        # Greedy: each token is the argmax after the prompt and the tokens before it.
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids + tokens])).logits[0]
        assert logits[len(ids) - 1 : -1].argmax(dim=-1).tolist() == tokens
        assert refs.nll_full[row].tolist() == pytest.approx(plain_nll(model, batch, row, tokens), rel=1e-9, abs=1e-12)


def test_teacher_forcing_through_the_same_cache_reproduces_the_reference_nll(model, batch) -> None:
    """Both uses of the one stepping loop: forced along the greedy tokens through an identical
    prompt cache, the NLL is the references' own, bit for bit; rows that stopped early are 0."""
    eos = references(model, batch).tokens[1, 2].item()
    answer = [11, 12, 13]
    refs = references(model, batch, eos={eos}, answers=(None, None, answer))
    cache, first = prompt(model, batch)
    steps = []
    with torch.inference_mode():
        nll = teacher_forced_nll(model, cache, first, batch, refs, on_step=lambda: steps.append(1))
    assert torch.equal(nll, refs.nll_full)
    assert len(steps) == refs.steps - 1


def test_top1_agreement_is_the_argmax_of_plain_forwards(model, batch) -> None:
    """Teacher-forced top-1: True exactly where the scored reference token is the argmax after the
    prompt and the reference before it (so every greedy token agrees; a forced answer token agrees
    only where the model would have written it); False where nothing is scored."""
    eos = references(model, batch).tokens[1, 2].item()
    answer = [11, 12, 13]
    refs = references(model, batch, eos={eos}, answers=(None, None, answer))
    cache, first = prompt(model, batch)
    with torch.inference_mode():
        forced = teacher_forced(model, cache, first, batch, refs)
    assert torch.equal(forced.nll, refs.nll_full)
    assert not forced.top1[~refs.scored].any()
    assert forced.top1[:2][refs.scored[:2]].all()  # the greedy rows
    ids = batch.input_ids[2][batch.attention_mask[2].bool()].tolist()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + answer])).logits[0]
    argmax = logits[len(ids) - 1 : -1].argmax(dim=-1).tolist()
    assert forced.top1[2, :3].tolist() == [a == t for a, t in zip(argmax, answer)]


def test_eos_ends_a_row_and_answers_are_forced(model, batch) -> None:
    free = references(model, batch)
    eos = free.tokens[1, 2].item()
    refs = references(model, batch, eos={eos}, answers=(None, None, [11, 12, 13]))
    first_eos = free.tokens[1].tolist().index(eos)
    # Row 1 stops at its first EOS, which is scored; later columns are padding.
    assert refs.scored[1].tolist() == [t <= first_eos for t in range(LENGTH)]
    assert refs.tokens[1, : first_eos + 1].tolist() == free.tokens[1, : first_eos + 1].tolist()
    assert (refs.tokens[1, first_eos + 1 :] == 0).all() and (refs.nll_full[1, first_eos + 1 :] == 0).all()
    # Row 2 follows its answer (EOS is not appended) and ends with it.
    assert refs.tokens[2, :3].tolist() == [11, 12, 13] and refs.scored[2].tolist() == [True] * 3 + [False] * 4
    assert refs.nll_full[2, :3].tolist() == pytest.approx(plain_nll(model, batch, 2, [11, 12, 13]), rel=1e-9)
    # Row 0 (no EOS among its tokens unless greedy picks it) continues as without the others.
    if eos not in free.tokens[0].tolist():
        assert torch.equal(refs.tokens[0], free.tokens[0]) and refs.scored[0].all()


def test_stepping_stops_when_every_row_is_done(model, batch) -> None:
    steps = []
    refs = references(model, batch, answers=([5], [6, 7], [8]), on_step=lambda: steps.append(1))
    assert refs.steps == 2
    # The longest answer's last token is fed too (a row is seen to be done one step later), then
    # nothing more: 2 forwards, not LENGTH - 1.
    assert len(steps) == 2


def test_prompt_mean_nll_weighs_every_prompt_the_same():
    import math

    import torch

    from kvtool.scoring import NllTotal, PromptMeanNll

    # Prompt 0: four tokens of NLL 1; prompt 1: one token of NLL 3 (a short exact answer).
    nll = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    scored = torch.tensor([[True, True, True, True], [True, False, False, False]])
    per_prompt, pooled = PromptMeanNll(), NllTotal()
    per_prompt.add(nll, scored)
    pooled.add(nll, scored)
    assert per_prompt.ppl() == pytest.approx(math.exp(2.0)) and per_prompt.count == 5
    assert pooled.ppl() == pytest.approx(math.exp(7 / 5))
    # A row with nothing scored adds no prompt.
    per_prompt.add(torch.zeros(1, 4, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.bool))
    assert per_prompt.ppl() == pytest.approx(math.exp(2.0)) and len(per_prompt.means) == 2
    assert math.isnan(PromptMeanNll().ppl())


@pytest.mark.parametrize("case", ["llama", "llama, compressed", "gemma3, soft-capped", "llama, a cap it ignores"])
def test_teacher_forcing_scores_the_same_with_its_output_layer_deferred(case, batch, monkeypatch) -> None:
    """`scoring.deferred`: the output layer run once over the recorded steps gives the per-step
    pass's NLL (to float64 rounding: a product over more rows may sum in another order) and top-1, through a full or a compressed cache, with Gemma's logit
    soft-capping; where the model's logits are not what it reconstructs (Llama ignores a soft-cap
    setting), its first-step check keeps the per-step logits, and the scores are still the same."""
    from kvtool.runtime import attach
    from kvtool.scoring.deferred import DeferredHead
    from tiny_models import profile_with, tiny_gemma3

    model = tiny_gemma3(seed=3) if case.startswith("gemma3") else tiny_llama(layers=2, seed=5)
    if "cap" in case:
        model.config.final_logit_softcapping = 2.0
    handle = attach(model, profile_with(model, 0.5, eviction="tova")) if "compressed" in case else None

    def new_cache():
        return handle.new_cache() if handle else DynamicCache(config=model.config)

    length = 12
    cache = new_cache()
    with torch.inference_mode():
        first = prompt_forward(model, batch, cache)
        refs = reference_continuations(model, cache, first, batch, length=length, eos_ids=set(), pad_id=0, answers=[None, None, [11, 12, 13]])

    def forced(defer: bool):
        monkeypatch.setattr(DeferredHead, "applies", classmethod(lambda cls, *a: defer))
        calls = []
        hook = model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
        cache = new_cache()
        try:
            with torch.inference_mode():
                first = prompt_forward(model, batch, cache)
                calls.clear()
                return teacher_forced(model, cache, first, batch, refs), len(calls)
        finally:
            hook.remove()

    (deferred, deferred_calls), (stepped, stepped_calls) = forced(True), forced(False)
    assert torch.allclose(deferred.nll, stepped.nll, rtol=1e-12, atol=0) and torch.equal(deferred.top1, stepped.top1)
    assert stepped_calls == length - 1
    # Deferred: the first step and its check, then one block for the other 10 steps; refused: every
    # step and the check.
    assert deferred_calls == (length if "ignores" in case else 3)
    assert model.get_output_embeddings().__class__ is torch.nn.Linear  # put back
    if handle:
        handle.detach()
    if not handle:
        assert torch.equal(stepped.nll, refs.nll_full) and refs.scored[:2].all()
