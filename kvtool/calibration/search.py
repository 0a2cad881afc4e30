"""Running the recipe search on a model: each recipe's calibration PPL on the prompts that choose,
then the finalists' on the held-out calibration prompts (`recipes` holds the search itself)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtool.calibration.passes import (
    STAGE_CONFIRM,
    STAGE_RECIPES,
    Progress,
    PromptState,
    StageCounter,
    full_ppl,
    recipe_ppls,
    reference_steps,
)
from kvtool.calibration.drafted import DraftStage, draft_stage
from kvtool.calibration.recipes import STAGES, pick_recipe, seed_recipes, RecipeSearch, SearchSpace, recipe_key, search_recipe
from kvtool.calibration.truncation import TruncationResult
from kvtool.profiles import MethodSettings, Profile


@dataclass(frozen=True)
class ChosenRecipe:
    """The search, and what the held-out calibration prompts said of its finalists."""

    search: RecipeSearch
    held_out: dict[tuple, float]  # recipe_key -> PPL on the held-out prompts (finalists only)
    ppl_full: float  # the full cache on the prompts that chose
    held_out_ppl_full: float | None  # ... and on the held-out ones (None without any)
    tokens: int  # reference tokens scored on the prompts that chose
    chosen_on: int
    confirmed_on: int
    truncation: TruncationResult | None  # the shipped recipe's D trials (fixed-point only)
    # The search's choice, or the fallback `pick_recipe` made when the held-out prompts did not confirm it.
    picked: MethodSettings
    # The draft stage, when it ran (`calibration.drafted`): its choice is what the profile runs.
    drafted: DraftStage | None = None

    @property
    def shipped(self) -> MethodSettings:
        """The recipe the profile runs."""
        return self.drafted.picked if self.drafted is not None else self.picked

    @property
    def fell_back(self) -> bool:
        return recipe_key(self.picked) != recipe_key(self.search.chosen)

    @property
    def confirmed(self) -> bool | None:
        """Whether the chosen recipe beats the papers' on the held-out prompts (None: none held out,
        or the search kept the papers' recipe)."""
        chosen, start = recipe_key(self.search.chosen), recipe_key(self.search.start)
        if not self.held_out or chosen == start:
            return None
        return self.held_out[chosen] <= self.held_out[start]


# Rows one teacher-forced pass may hold (the prompts of a batch once per recipe). On the 2-core CPU
# a decode step of SmolLM2 took 85 ms for 5 rows, 114 ms for 15, 143 ms for 25 and 177 ms for 35:
# reading the weights dominates, so up to about 30 rows a recipe more costs a fraction of its own pass.
ROWS_PER_PASS = 30


# Teacher-forced passes the first round takes at most: one for the papers' recipe and the seeds,
# one per stage (a stage's recipes run side by side). The progress bar's first length: look-ahead
# saves passes, a second round adds some, so the bar is re-sized as it goes.
MAX_PASSES = 1 + len(STAGES)


def choose_recipe(
    model: Any,
    start: MethodSettings,
    space: SearchSpace,
    profile_for: Callable[[MethodSettings], Profile],
    choosing: Sequence[PromptState],
    confirming: Sequence[PromptState],
    progress: Progress,
    with_draft: bool = False,
) -> ChosenRecipe:
    """Search on `choosing`, then measure the finalists on `confirming`; `with_draft`, then the draft
    stage (`calibration.drafted`) on both, with the draft `profile_for` writes (only if it writes one)."""
    steps = reference_steps(choosing)
    bar = StageCounter(STAGE_RECIPES, MAX_PASSES * steps, progress).start()

    def measure(stage: str, recipes: Sequence[MethodSettings]) -> list[float]:
        bar.total = max(bar.total, bar.done + steps)  # a second round runs past the first's estimate
        return recipe_ppls(model, [profile_for(s) for s in recipes], choosing, bar.step)

    rows = max((len(state.batch.rows) for state in choosing), default=1)
    per_pass = max(1, ROWS_PER_PASS // rows)
    search = search_recipe(start, space, measure, seeds=seed_recipes(space, start), per_pass=per_pass)
    bar.finish()
    held_out: dict[tuple, float] = {}
    held_out_full = None
    if confirming:
        finalists = search.finalists()
        confirm = StageCounter(STAGE_CONFIRM, reference_steps(confirming), progress).start()
        ppls = recipe_ppls(model, [profile_for(s) for s in finalists], confirming, confirm.step)
        held_out = {recipe_key(s): ppl for s, ppl in zip(finalists, ppls)}
        confirm.finish()
        held_out_full = full_ppl(confirming).ppl()
    full = full_ppl(choosing)
    chosen_on = sum(len(s.batch.rows) for s in choosing)
    confirmed_on = sum(len(s.batch.rows) for s in confirming)
    picked = pick_recipe(search, held_out, chosen_on, confirmed_on)
    drafted = None
    if with_draft and profile_for(picked).method.draft is not None:
        drafted = draft_stage(model, picked, search, space, profile_for, choosing, confirming, progress)
    shipped = drafted.picked if drafted is not None else picked
    return ChosenRecipe(
        search=search,
        held_out=held_out,
        ppl_full=full.ppl(),
        held_out_ppl_full=held_out_full,
        tokens=full.count,
        chosen_on=chosen_on,
        confirmed_on=confirmed_on,
        truncation=_truncation(search, shipped, full.ppl(), full.count),
        picked=picked,
        drafted=drafted,
    )


def _truncation(search: RecipeSearch, chosen: MethodSettings, ppl_full: float, tokens: int) -> TruncationResult | None:
    """The D trials of the shipped recipe, in the form the D-only tuning reports."""
    if chosen.eviction != "fixed-point":
        return None
    same = lambda s: dataclasses.replace(s, truncation_distance=0) == dataclasses.replace(chosen, truncation_distance=0)  # noqa: E731
    ppl = {t.settings.truncation_distance: t.ppl for t in search.trials if same(t.settings)}
    return TruncationResult(ppl=ppl, best=chosen.truncation_distance, ppl_full=ppl_full, tokens=tokens)
