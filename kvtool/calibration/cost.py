"""What a profile costs in the prompt phase, measured, and the draft it can afford under a limit.

Every recipe the search tries scores the prompt in the same one pass (the scores each rule reads come
from the same blocks), so recipes differ in prompt-phase cost mostly by their draft: its greedy steps
and one forward of its rows per round. The cost is measured as users meet it: the time from the
prompt to a cache ready for the first token (`runtime.draft.prepare`, draft included) over the time
of the full cache's plain prompt forward, on the same calibration prompts, the two interleaved and
repeated (until the ratios lie clearly on one side of the limit, or a majority of the repeats lies on
one side, which settles the median's), the median ratio kept. A first look
at one row settles it when that row alone lies clearly below the limit (`first_look`). When the
shipped draft costs more than `--max-prompt-overhead`, the next cheaper one is measured
(`cheaper_drafts`) until one fits.

The ratio depends on the prompt length (a longer prompt's forward costs more, a draft's steps about
the same): calibration prompts are shorter than the long prompts compression is for, so the
overhead measured here is an upper bound of what those see.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvtool.profiles import Draft, Profile
from kvtool.runtime import attach
from kvtool.runtime.draft import prepare
from kvtool.runtime.steps import Prompt, prompt_forward

REPEATS = 3
# Repeats stop early once every ratio so far lies this factor clear of the limit, on one side: the
# decision cannot change. Prompt-phase runs on the shared 2-core machine spread by about this much
# (the README bench's three runs: 1.23x, 1.43x, 1.84x), and a Gemma 3 repeat costs 90 s.
CLEAR_OF_LIMIT = 1.5
HALVE_FIRST_TO = 32  # `cheaper_drafts` halves a draft's tokens down to this before it drops a round
STAGE_COST = "prompt cost"  # the progress stage


@dataclass(frozen=True)
class DraftCost:
    """One draft's measured prompt phase against the full cache's (`ratio`, the median over repeats)."""

    draft: Draft | None
    ratio: float


def cheaper_drafts(draft: Draft | None) -> list[Draft | None]:
    """`draft`, then each cheaper one in the order they are tried: half the tokens down to
    `HALVE_FIRST_TO`, then later rounds from the last one's predictions (`Draft.jacobi`: no steps after
    the first round's), then one round fewer down to one, then half the tokens down to 8, then no draft.

    Tokens go before rounds because that kept more at the same cost: on the 30 unseen calibration
    prompts at 0.2, 32 tokens in 2 rounds measured PPL 2.284, needles 0.750, against 2.319 and 0.458
    for 64 tokens in 1 round, which costs about as much (62 draft steps against 63;
    `benchmarks/unseen_calibration.py --samples 10 --samples 20`, then `kvtool eval smollm2 --data
    unseen.jsonl --budgets 0.2 --methods kvtool --profile P` with each draft). A Jacobi second round
    costs one round's steps and a draft forward more, and on the same prompts it kept more than one
    round (32 x 2 Jacobi against 32 x 1: ROUGE-L +0.067 +- 0.030, needles 0.750 against 0.583). Below
    32 tokens a draft stops reaching the answers' needles (their digits follow some 16 tokens of
    lead-in), so rounds go first from there."""
    ladder: list[Draft | None] = []
    while draft is not None:
        ladder.append(draft)
        if draft.tokens // 2 >= HALVE_FIRST_TO:
            draft = dataclasses.replace(draft, tokens=draft.tokens // 2)
        elif draft.rounds > 1 and not draft.jacobi:
            draft = dataclasses.replace(draft, jacobi=True)
        elif draft.rounds > 1:
            draft = dataclasses.replace(draft, rounds=draft.rounds - 1, jacobi=draft.rounds > 2)
        elif draft.tokens // 2 >= 8:
            draft = dataclasses.replace(draft, tokens=draft.tokens // 2)
        else:
            draft = None
    return [*ladder, None]


def prompt_overhead(
    model: Any, profile: Profile, prompts: Sequence[Prompt], repeats: int = REPEATS, limit: float | None = None
) -> float:
    """The median over `repeats` of (seconds to prepare `prompts` with `profile`'s cache and draft) /
    (seconds of their full-cache prompt forward), the two interleaved per prompt batch; with a
    `limit`, fewer repeats once all ratios so far are `clear` of it (`CLEAR_OF_LIMIT`) or `settled`
    (the median of the repeats run is then returned), and none at all when the `first_look` is
    clearly below it (that look's ratio is returned)."""
    ratios = []
    with torch.no_grad(), attach(model, profile) as handle:

        def ratio(batches: Sequence[Prompt]) -> float:
            full = kvtool = 0.0
            for prompt in batches:
                full += _seconds(lambda: prompt_forward(model, prompt, DynamicCache(config=model.config)))
                kvtool += _seconds(lambda: prepare(model, prompt, handle.bare_cache, profile.method.draft))
            return kvtool / full

        look = first_look(prompts)
        if limit is not None and look is not None:
            upper = ratio([look])
            if upper * CLEAR_OF_LIMIT <= limit:
                return upper
        for _ in range(repeats):
            ratios.append(ratio(prompts))
            if clear(ratios, limit) or settled(ratios, limit, repeats):
                break
    return statistics.median(ratios)


def first_look(prompts: Sequence[Prompt]) -> Prompt | None:
    """The longest row of the first batch alone (None: a batch of one, or prompts with pixels, whose
    rows cannot be taken apart).

    Alone, a row's ratio is an upper bound of its batch's: the prompt forwards cost per row, while
    the draft's steps cost about the same for one row as for five. Measured with the built-in 0.2
    profiles: Gemma 3 270M 2.23x for the longest row against 1.39x for its batch of 5 (19 s against
    108 s); SmolLM2 3.58x for the shortest row against 2.09x. When the row alone lies clearly below
    the limit the batch does too, and the batch's repeats would only confirm it."""
    if not prompts or prompts[0].extras or prompts[0].input_ids.shape[0] < 2:
        return None
    longest = int(prompts[0].attention_mask.sum(dim=1).argmax())
    return prompts[0].row_slice(slice(longest, longest + 1))


def clear(ratios: Sequence[float], limit: float | None) -> bool:
    """Whether every ratio lies `CLEAR_OF_LIMIT` below `limit`, or every one that far above it."""
    if limit is None or not ratios:
        return False
    return max(ratios) * CLEAR_OF_LIMIT <= limit or min(ratios) >= limit * CLEAR_OF_LIMIT


def settled(ratios: Sequence[float], limit: float | None, repeats: int) -> bool:
    """Whether more than half of `repeats` ratios already lie on one side of `limit` (within: at most
    it): the median of all `repeats` would lie on that side whatever the rest measure, and so does the
    median of these. On SmolLM2's calibration the held-out batch's repeats measured 2.39x, 2.66x and
    2.82x against a limit of 4.0, 61 s each: the third could not change the decision."""
    if limit is None:
        return False
    within = sum(r <= limit for r in ratios)
    return 2 * within > repeats or 2 * (len(ratios) - within) > repeats


def affordable_draft(
    model: Any, profile: Profile, prompts: Sequence[Prompt], limit: float | None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[DraftCost]:
    """Each draft of `cheaper_drafts(profile's)` measured in turn until one's overhead is within
    `limit` (None: only the profile's own is measured); the last entry is the one to ship (no draft
    when none fits, whatever its overhead)."""
    measured = []
    ladder = cheaper_drafts(profile.method.draft)
    for draft in ladder:
        candidate = dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=draft))
        cost = DraftCost(draft, prompt_overhead(model, candidate, prompts, limit=limit))
        measured.append(cost)
        if progress is not None:
            progress(STAGE_COST, len(measured), len(ladder))
        if limit is None or cost.ratio <= limit:
            break
    return measured


def _seconds(work: Callable[[], Any]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started
