"""Where a greedy continuation writes the expected answers: the calibration reference of an answer row.

Forcing a retrieval row's exact answer right after the prompt measures whether the compressed
prompt still holds the fact, but not whether the generation rule keeps it: the answer's tokens are
the first ones generated, so no entry has been evicted yet. A model answers with some words first
("The special magic number for ... is"), and a rule that re-scores its cache during those words
can drop the needle before the number is written (SmolLM2 at 0.2, the 10 retrieval calibration
prompts: H2O found 0.150 of the needles holding the budget, 0.550 with the prompt's cache left
alone). So the reference of such a row is the full cache's own continuation, teacher-forced whole
(the generation rule runs through the lead-in) and scored only where it writes the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtool.scoring.engine import References

Decode = Callable[[Sequence[int]], str]


def answer_spans(decode: Decode, tokens: Sequence[int], answers: Sequence[str]) -> list[tuple[int, int]]:
    """Token spans [start, end) of `tokens` whose text holds each answer found in it, case-insensitively
    as accuracy counts it (the first place each one is written; an answer not written has none): the
    span ends at the first token whose prefix holds the answer and starts at the last token that
    still leaves the whole answer inside."""
    spans = []
    for answer in answers:
        wanted = answer.lower()
        end = next((k for k in range(1, len(tokens) + 1) if wanted in decode(tokens[:k]).lower()), None)
        if end is None:
            continue
        start = next(j for j in range(end - 1, -1, -1) if wanted in decode(tokens[j:end]).lower())
        spans.append((start, end))
    return sorted(set(spans))


def score_answers_only(references: References, expected: Sequence[Sequence[str]], decode: Decode) -> References:
    """`references` with each row that has `expected` answers scored only on the tokens that write
    them, and cut after the last one. A row whose continuation writes none of them stays scored
    whole: the full cache lost the fact too, so the row judges recipes by its wording like any other."""
    scored, nll = references.scored.clone(), references.nll_full.clone()
    for row, answers in enumerate(expected):
        if not answers:
            continue
        tokens = references.tokens[row][references.scored[row]].tolist()
        spans = answer_spans(decode, tokens, answers)
        if not spans:
            continue
        keep = torch.zeros_like(scored[row])
        for start, end in spans:
            keep[start:end] = True
        scored[row] = keep
        nll[row] = torch.where(keep, nll[row], torch.zeros_like(nll[row]))
    return References(tokens=references.tokens, scored=scored, nll_full=nll)
