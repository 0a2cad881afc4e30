"""The draft stage: the search's pick and its nearest rivals measured as they will run, with the draft.

The recipe search measures every recipe on the recorded prompt state, without the draft, because a
draft costs each recipe its own prompt forwards and drafted steps. But a profile with a draft runs
differently: the draft's attention chooses prompt entries the prompt's own rows never looked at,
and which generation rule or which per-layer ratios then keep the answer closest can change. On the
calibration prompts neither built-in draw uses, a rule the search without the draft had put behind
found more needles with the draft than the search's pick did (`benchmarks/unseen_calibration.py`,
then `kvtool eval smollm2 --data`: the scorer's own ratios 0.750 of the needles against 0.542 for the
pick's attention-sum ratios, at a PPL 2.8% higher).

So, when asked, the pick is re-measured with the draft beside the recipes one rule away from it
that the search already measured: every other generation rule and every other ratio source (the
two rules whose worth depends most on which entries the prompt keeps). The lowest drafted PPL on
the prompts that chose wins, and replaces the pick only if the held-out prompts, also measured with
the draft, agree (it is no worse there than the pick).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtool.calibration.passes import Progress, PromptState, StageCounter, drafted_ppls, reference_steps
from kvtool.calibration.recipes import RecipeSearch, SearchSpace, recipe_key, stage_options
from kvtool.profiles import MethodSettings, Profile

STAGE_DRAFT = "draft stage"
STAGE_DRAFT_CONFIRM = "draft stage, held-out"

# The MethodSettings fields whose other values the stage tries around the pick.
DRAFT_STAGE_RULES = ("eviction", "ratios")


@dataclass(frozen=True)
class DraftStage:
    """What the draft stage measured and shipped."""

    candidates: tuple[MethodSettings, ...]  # the pick first
    choosing: dict[tuple, float]  # recipe_key -> drafted PPL on the prompts that chose
    held_out: dict[tuple, float]  # recipe_key -> drafted PPL on the held-out prompts (pick and challenger)
    picked: MethodSettings


def draft_candidates(picked: MethodSettings, search: RecipeSearch, space: SearchSpace) -> tuple[MethodSettings, ...]:
    """`picked`, then each recipe one `DRAFT_STAGE_RULES` value away from it that the search measured
    (those have a PPL without the draft to show beside the drafted one)."""
    measured = {recipe_key(t.settings): t.settings for t in search.trials}
    out = {recipe_key(picked): picked}
    for attr in DRAFT_STAGE_RULES:
        for option in stage_options(attr, picked, space):
            key = recipe_key(option)
            if key in measured:
                out.setdefault(key, measured[key])
    return tuple(out.values())


def pick_drafted(
    incumbent: MethodSettings,
    candidates: Sequence[MethodSettings],
    choosing: dict[tuple, float],
    held_out: dict[tuple, float],
) -> MethodSettings:
    """The candidate with the lowest drafted PPL on the prompts that chose (ties keep `incumbent`),
    if the held-out prompts confirm it against `incumbent` (no worse there) or none were held out."""
    first = recipe_key(incumbent)
    best = min(candidates, key=lambda s: (choosing[recipe_key(s)], recipe_key(s) != first))
    key = recipe_key(best)
    if key == first or not held_out:
        return best
    return best if held_out[key] <= held_out[first] else incumbent


def draft_stage(
    model: Any,
    picked: MethodSettings,
    search: RecipeSearch,
    space: SearchSpace,
    profile_for: Callable[[MethodSettings], Profile],
    choosing: Sequence[PromptState],
    confirming: Sequence[PromptState],
    progress: Progress,
) -> DraftStage:
    """Measure `picked` and its candidates with the draft `profile_for` writes into their profiles."""
    candidates = draft_candidates(picked, search, space)
    bar = StageCounter(STAGE_DRAFT, reference_steps(choosing) * len(candidates), progress).start()
    ppls = drafted_ppls(model, [profile_for(s) for s in candidates], choosing, bar.step)
    bar.finish()
    scored = {recipe_key(s): p for s, p in zip(candidates, ppls)}
    best = pick_drafted(picked, candidates, scored, {})  # with nothing held out: the lowest drafted PPL
    held_out: dict[tuple, float] = {}
    if confirming and recipe_key(best) != recipe_key(picked):
        pair = (picked, best)
        confirm = StageCounter(STAGE_DRAFT_CONFIRM, reference_steps(confirming) * len(pair), progress).start()
        held_out = dict(zip(map(recipe_key, pair), drafted_ppls(model, [profile_for(s) for s in pair], confirming, confirm.step)))
        confirm.finish()
    return DraftStage(
        candidates=candidates, choosing=scored, held_out=held_out,
        picked=pick_drafted(picked, candidates, scored, held_out),
    )
