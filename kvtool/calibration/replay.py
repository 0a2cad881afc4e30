"""A calibration's recipe search run again on the PPLs it recorded, to see what another search rule
would have chosen and at how many trials (`benchmarks/search_replay.py`; the retry rule of
`recipes.RETRY_WITHIN` was judged this way). No model runs: `measure` reads the profile's
`calibration.recipes`. A recipe the replayed search asks for that the run never measured ranks last
and is counted, since then the replay is not exact."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtool.calibration.config import CalibrateConfig
from kvtool.calibration.recipes import (
    FIRST_STAGE, SEARCH_SELECTIONS, SEED_STAGE, RecipeSearch, SearchSpace, recipe_key, search_recipe, seed_recipes,
)
from kvtool.runtime.eviction import EVICT_RULES
from kvtool.errors import KvtoolError
from kvtool.profiles import Profile

_RULES = ("eviction", "selection", "scorer", "ratios", "heads", "recent_share", "merge", "truncation_distance")


@dataclass(frozen=True)
class Replay:
    search: RecipeSearch
    unmeasured: int  # recipes asked for that the run never measured

    @property
    def ppl(self) -> float:
        return self.search.ppl_of(self.search.chosen)


def replay(profile: Profile, *, per_pass: int, retry_within: float | None) -> Replay:
    """The search of `profile`'s calibration with the default start, seeds and space (its generation
    rules, scorers and head modes as the run tried them), `per_pass` recipes side by side, and
    `retry_within`."""
    info = profile.calibration
    if info is None or not info.recipes:
        raise KvtoolError("this profile records no recipe search to replay")
    start = CalibrateConfig().method
    table = {}
    for trial in info.recipes:
        values = {name: getattr(trial, name) for name in _RULES}
        values.update({k: getattr(trial, k) for k in ("window", "pool", "window_share") if getattr(trial, k) is not None})
        table[recipe_key(dataclasses.replace(start, **values))] = trial.ppl
    tried = {trial.scorer for trial in info.recipes}
    # The generation rules its stages tried (one rule, as `--space evictions=X` asks: no such stage).
    rules = {t.eviction for t in info.recipes if t.stage.startswith("generation rule")}
    # The selections its stages reached (the seeds' alone say nothing: `--space selections=X` binds).
    reached = [t.selection for t in info.recipes if t.stage not in (FIRST_STAGE, SEED_STAGE)]
    space = SearchSpace(
        evictions=tuple(e for e in EVICT_RULES if e in rules) or (profile.method.eviction,),
        selections=tuple(s for s in SEARCH_SELECTIONS if s in reached) or (profile.method.selection,),
        scorers=tuple(s for s in SearchSpace().scorers if s in tried),
        ratio_sources=tuple(r for r in SearchSpace().ratio_sources if r in {t.ratios for t in info.recipes}),
        heads=tuple(dict.fromkeys(t.heads for t in info.recipes)),
    )
    missing = []

    def measure(stage, recipes):
        keys = [recipe_key(s) for s in recipes]
        missing.extend(k for k in keys if k not in table)
        return [table.get(k, float("inf")) for k in keys]

    search = search_recipe(start, space, measure, seeds=seed_recipes(space, start), per_pass=per_pass, retry_within=retry_within)
    return Replay(search, len(missing))
