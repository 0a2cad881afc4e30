"""Calibration references of answer rows (kvtool.scoring.answers): the full cache's continuation,
scored only where it writes the expected answers, teacher-forced whole so the generation rule runs
through the words before them."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

from kvtool.scoring import left_pad, prompt_forward, reference_continuations, teacher_forced_nll
from kvtool.scoring.answers import answer_spans, score_answers_only
from kvtool.scoring.engine import References
from tiny_models import tiny_llama

PIECES = ["The", " number", " is", " 17", "94", "597", ".", " Also", " 22", "33", "445", "!"]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def brute_spans(tokens, answers):
    """Every (start, end) whose text holds the answer; the one ending first, then the shortest."""
    spans = set()
    for answer in answers:
        holding = [(j, k) for j, k in itertools.combinations(range(len(tokens) + 1), 2)
                   if answer.lower() in decode(tokens[j:k]).lower()]
        if holding:
            end = min(k for _, k in holding)
            spans.add((max(j for j, k in holding if k == end), end))
    return sorted(spans)


@pytest.mark.parametrize("answers", [["1794597"], ["2233445", "1794597"], ["794"], ["NUMBER is"], ["404"], ["1794597", "999"]])
def test_answer_spans_match_a_brute_force_search(answers) -> None:
    tokens = list(range(len(PIECES)))
    assert answer_spans(decode, tokens, answers) == brute_spans(tokens, answers)


def test_answer_spans_cover_exactly_the_tokens_that_write_the_answer() -> None:
    tokens = list(range(len(PIECES)))
    assert answer_spans(decode, tokens, ["1794597", "2233445"]) == [(3, 6), (8, 11)]
    # Written twice: the first place counts.
    assert answer_spans(decode, tokens + [3, 4, 5], ["1794597"]) == [(3, 6)]
    assert answer_spans(decode, tokens, ["31"]) == []


def references_of(tokens: list[list[int]]) -> References:
    t = torch.tensor(tokens)
    return References(tokens=t, scored=torch.ones_like(t, dtype=torch.bool), nll_full=torch.rand(t.shape, dtype=torch.float64) + 0.1)


def test_answer_rows_are_scored_only_where_the_answers_are_written() -> None:
    refs = references_of([list(range(12)), list(range(12)), list(range(12))])
    out = score_answers_only(refs, [["1794597"], [], ["31"]], decode)
    assert out.scored[0].tolist() == [False] * 3 + [True] * 3 + [False] * 6
    assert torch.equal(out.nll_full[0], torch.where(out.scored[0], refs.nll_full[0], 0.0))
    # No answers: unchanged; answers the full cache did not write: scored whole.
    assert out.scored[1].all() and out.scored[2].all() and torch.equal(out.nll_full[1:], refs.nll_full[1:])
    assert torch.equal(out.tokens, refs.tokens)


def test_rows_that_end_early_keep_their_padding_unscored() -> None:
    refs = references_of([[0, 1, 2, 3, 4, 5, 6, 0, 0]])
    refs = References(refs.tokens, torch.tensor([[True] * 7 + [False] * 2]), refs.nll_full * torch.tensor([[1.0] * 7 + [0.0] * 2]))
    out = score_answers_only(refs, [["1794597"]], decode)
    assert out.scored[0].tolist() == [False] * 3 + [True] * 3 + [False] * 3 and out.steps == 6


def test_the_lead_in_is_fed_before_the_answer_is_scored() -> None:
    """Teacher-forcing the span-scored reference through a full cache gives the full cache's own NLL
    on the answer tokens: the unscored tokens before them are fed, as the model wrote them."""
    model = tiny_llama(layers=2, seed=5)
    gen = torch.Generator().manual_seed(4)
    batch = left_pad([torch.randint(3, 90, (n,), generator=gen).tolist() for n in (11, 8)], (0, 1), pad_id=0)

    def fresh():
        cache = DynamicCache(config=model.config)
        return cache, prompt_forward(model, batch, cache)

    with torch.inference_mode():
        cache, first = fresh()
        refs = reference_continuations(model, cache, first, batch, length=8, eos_ids=set(), pad_id=0, answers=[None, None])
        # Name the answer by the text of tokens 4 and 5 of row 0 (ids written as "<id>").
        spelled = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
        row0 = refs.tokens[0].tolist()
        answer = spelled(row0[4:6])
        out = score_answers_only(refs, [[answer], []], spelled)
        start = next(j for j in range(8) if spelled(row0[j:j + 2]) == answer)
        assert out.scored[0].tolist() == [start <= t < start + 2 for t in range(8)]
        cache, first = fresh()
        nll = teacher_forced_nll(model, cache, first, batch, out)
    assert torch.allclose(nll[out.scored], refs.nll_full[out.scored], rtol=1e-9, atol=1e-12)
    assert torch.equal(nll[~out.scored], torch.zeros_like(nll[~out.scored]))
