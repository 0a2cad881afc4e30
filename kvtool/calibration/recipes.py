"""The recipe search: which rules keep the answers at this budget, chosen by calibration PPL.

A recipe is what calibration varies in a profile's method settings: the generation rule
(eviction), the prompt selection (top scores beside sinks and a recent share, or H2O's half
recent / half top), the scorer (the window scorer at each max-pool width: pooling keeps the
neighbours of a strongly attended token, so a fact that spans many tokens, a number written digit
by digit, survives whole), where the per-layer ratios come from (the scorer's Lorenz curves,
attention-sum curves, or the same ratio everywhere), shared or per-head entries, the recent share,
the merge mode and D. The full product is thousands of recipes; the search is coordinate descent
instead: from the best of the papers' recipe and the seed baselines' rules, each step tries every
value of one rule with the others at the best so far and keeps the lowest PPL (ties keep the
current value), in the order the rules matter most (the generation rule decides what survives a
long answer, D only tunes the fixed-point queue, so it goes last and only when the queue is
chosen); a second round follows if the first moved, retrying only what came close in the first.
About 30-50 recipes, each a teacher-forced pass beside others.

The PPLs come from the prompts that choose; the finalists are re-measured on calibration prompts
the choice never saw, and `pick_recipe` decides what ships. Nothing here runs a model: `measure` is
handed in, which keeps the search testable against a brute-force search of the same space
(tests/test_recipes.py).

Over 300 lines because the search space and the order it is searched in are one argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtool.errors import KvtoolError
from kvtool.profiles import MERGE_MODES, MethodSettings
from kvtool.profiles.schema import HEAD_MODES, RATIO_SOURCES, SCORERS, WINDOW_SCORERS
from kvtool.runtime.eviction import EVICT_RULES
from kvtool.runtime.methods import method_settings

# Prompt selections the search may choose: top-k by score beside sinks and the recent share, or
# H2O's split (half the layer's share recent, half the top scores, no sinks).
SEARCH_SELECTIONS = ("importance", "heavy-hitter")

# The generation rules the search tries, in registry order: those that hold the budget and do not
# opt out (`EvictRule.searched`). "prompt-only" lets the cache grow, so it is a mode users ask for by
# name, never a calibration result for a budget that must hold.
HELD_EVICTIONS = tuple(name for name, rule in EVICT_RULES.items() if rule.holds_budget and rule.searched)


# The scorers the search tries unless `--space scorers=` names others. `triattention` is left out: in
# SmolLM2's default search at 0.2 it measured 2.798 and 2.739 on the choosing half against
# `expected-attention`'s 2.699 and 2.681 (and `union`'s 2.480 and 2.474), and 2.732 held out against
# `expected-attention`'s 2.536 (`benchmarks/calibration_stages.py smollm2 --out cal.yaml` with
# `triattention` in the scorer stage).
SEARCH_SCORERS = tuple(s for s in SCORERS if s != "triattention")


@dataclass(frozen=True)
class SearchSpace:
    """The values each rule may take; one value fixes that rule."""

    evictions: tuple[str, ...] = HELD_EVICTIONS
    selections: tuple[str, ...] = SEARCH_SELECTIONS
    scorers: tuple[str, ...] = SEARCH_SCORERS
    # The window scorer's observation windows (last prompt rows). Tried inside the scorer stage.
    windows: tuple[int, ...] = (32,)
    ratio_sources: tuple[str, ...] = RATIO_SOURCES
    heads: tuple[str, ...] = HEAD_MODES
    # The window scorer's max-pool widths (odd). Tried inside the scorer stage, beside the scorers.
    pools: tuple[int, ...] = (7, 15, 31)
    # The union scorer's window shares (how much of its kept room the window's top list gets),
    # tried inside the scorer stage with each window and pool width. By default only the even
    # split: on SmolLM2 at 0.2 the shares 0.5 / 0.7 / 0.85 ranked differently with the prompts drawn
    # (5 choosing prompts: 0.7 ahead by 0.7%; 10: 0.5 ahead by 3-5%), and every option more is one
    # more chance for a noise win on a handful of prompts. Pass `window_shares` (CLI: `--space
    # window_shares=0.5,0.7`) to search them.
    window_shares: tuple[float, ...] = (0.5,)
    recent_shares: tuple[float, ...] = (0.0, 0.25, 0.5)
    merge_modes: tuple[str, ...] = ("none", "position")
    distances: tuple[int, ...] = (0, 8, 16, 25, 48, 96)
    # Named methods whose rules start the search beside the papers' recipe (held-budget baselines).
    seeds: tuple[str, ...] = ("h2o", "tova")

    def holds(self, settings: MethodSettings) -> bool:
        """Whether every rule of `settings` that matters takes a value of this space. The scorer's
        window, pool width and share are not checked: a seed keeps its own (TOVA scores by the last
        row alone), since the search is there to improve on the seeds, not to re-tune them."""
        return all(self.holds_rule(settings, attr) for _, attr, _ in STAGES)

    def holds_rule(self, settings: MethodSettings, attr: str) -> bool:
        """Whether one rule of `settings` takes a value of this space (or does not matter to it)."""
        if attr == "truncation_distance" and settings.eviction != "fixed-point":
            return True
        if attr == "recent_share" and settings.selection != "importance":
            return True
        return getattr(settings, attr) in space_values(self, attr)

    def checked(self) -> "SearchSpace":
        """The same space with duplicates dropped; a one-line KvtoolError for a bad value."""
        checks = (
            ("generation rule", self.evictions, tuple(EVICT_RULES)),
            ("selection", self.selections, SEARCH_SELECTIONS),
            ("scorer", self.scorers, SCORERS),
            ("ratio source", self.ratio_sources, RATIO_SOURCES),
            ("head mode", self.heads, HEAD_MODES),
            ("merge mode", self.merge_modes, MERGE_MODES),
        )
        for what, values, known in checks:
            if not values:
                raise KvtoolError(f"the recipe search needs at least one {what}")
            unknown = [v for v in values if v not in known]
            if unknown:
                raise KvtoolError(f"unknown {what} {unknown[0]!r} (known: {', '.join(known)})")
        if not self.recent_shares or any(not 0.0 <= float(s) <= 1.0 for s in self.recent_shares):
            raise KvtoolError(f"recent shares must be fractions in [0, 1], got {list(self.recent_shares)}")
        if not self.windows or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.windows):
            raise KvtoolError(f"observation windows must be integers >= 1, got {list(self.windows)}")
        if not self.pools or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 or p % 2 == 0 for p in self.pools):
            raise KvtoolError(f"pool widths must be odd integers >= 1, got {list(self.pools)}")
        if not self.window_shares or any(
            isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0 for f in self.window_shares
        ):
            raise KvtoolError(f"union window shares must be fractions strictly between 0 and 1, got {list(self.window_shares)}")
        if not self.distances or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.distances):
            raise KvtoolError(f"truncation distances must be integers >= 0, got {list(self.distances)}")
        seed_recipes(self, MethodSettings())  # an unknown seed, or one that lets the cache grow, fails before any model work
        unique = lambda values: tuple(dict.fromkeys(values))  # noqa: E731
        return SearchSpace(
            evictions=unique(self.evictions),
            selections=unique(self.selections),
            scorers=unique(self.scorers),
            windows=unique(self.windows),
            ratio_sources=unique(self.ratio_sources),
            heads=unique(self.heads),
            pools=unique(self.pools),
            window_shares=unique(float(f) for f in self.window_shares),
            recent_shares=unique(float(s) for s in self.recent_shares),
            merge_modes=unique(self.merge_modes),
            distances=unique(self.distances),
            seeds=unique(self.seeds),
        )


def seed_recipes(space: SearchSpace, start: MethodSettings) -> tuple[MethodSettings, ...]:
    """The rules of each seed method of `space`, on `start`'s sinks, recent window and D."""
    seeds = []
    for name in space.seeds:
        try:
            settings = method_settings(name, start)
        except KvtoolError as error:
            raise KvtoolError(f"search seed: {error}") from None
        if settings.eviction not in HELD_EVICTIONS:
            raise KvtoolError(f"search seed {name!r} does not hold the budget while generating ({settings.eviction})")
        seeds.append(settings)
    return tuple(seeds)


# (stage name, MethodSettings field, SearchSpace field), in the order the search walks them.
STAGES = (
    ("generation rule", "eviction", "evictions"),
    ("selection", "selection", "selections"),
    ("scorer", "scorer", "scorers"),
    ("ratios", "ratios", "ratio_sources"),
    ("heads", "heads", "heads"),
    ("recent share", "recent_share", "recent_shares"),
    ("merge", "merge", "merge_modes"),
    ("D", "truncation_distance", "distances"),
)
FIRST_STAGE = "start"
SEED_STAGE = "seed"


def recipe_key(settings: MethodSettings) -> tuple:
    """What tells two recipes apart: D only matters to the fixed-point queue, window and pool width
    only to the scorers that read the window, the recent share only to the selection that reserves it."""
    distance = settings.truncation_distance if settings.eviction == "fixed-point" else None
    window = (settings.window, settings.pool) if settings.scorer in WINDOW_SCORERS else None
    if settings.scorer == "union":
        window += (settings.window_share,)
    share = settings.recent_share if settings.selection == "importance" else None
    return (
        settings.eviction, settings.selection, settings.scorer, window, settings.ratios, settings.heads, share,
        settings.merge, distance,
    )


def space_values(space: SearchSpace, attr: str) -> tuple:
    """The values `space` allows for the MethodSettings field `attr` (one of STAGES)."""
    return getattr(space, next(field for _, a, field in STAGES if a == attr))


def stage_options(attr: str, current: MethodSettings, space: SearchSpace) -> list[MethodSettings]:
    """The recipes one stage tries: `current` with each value of `attr` (the scorer stage tries the
    window scorer at every window and pool width, so they are never judged under a scorer that
    ignores them)."""
    values = space_values(space, attr)
    options = []
    for value in values:
        if attr == "scorer" and value in WINDOW_SCORERS:
            shares = space.window_shares if value == "union" else (current.window_share,)
            options += [
                dataclasses.replace(current, scorer=value, window=window, pool=pool, window_share=share)
                for window in space.windows for pool in space.pools for share in shares
            ]
        else:
            options.append(dataclasses.replace(current, **{attr: value}))
    return options


def describe(settings: MethodSettings) -> str:
    """A recipe in one short line: `tova · window 32 (pool 7) · ratios uniform · per-head · recent 25% · merge none`."""
    parts = [settings.eviction]
    if settings.eviction == "fixed-point":
        parts[0] += f" D{settings.truncation_distance}"
    if settings.selection != "importance":
        parts.append(f"{settings.selection} selection")
    scorer = settings.scorer
    if settings.scorer in WINDOW_SCORERS:
        scorer = f"window {settings.window} (pool {settings.pool})" if scorer == "window" else f"{scorer} (window {settings.window}, pool {settings.pool})"
    if settings.scorer == "union" and settings.window_share != 0.5:
        scorer = f"{scorer[:-1]}, window share {settings.window_share:.0%})"
    recent = f"recent {settings.recent_share:.0%}" if settings.selection == "importance" else "recent half"
    parts += [scorer, f"ratios {settings.ratios}", settings.heads, recent, f"merge {settings.merge}"]
    return " · ".join(parts)


@dataclass(frozen=True)
class Trial:
    stage: str
    settings: MethodSettings
    ppl: float


@dataclass(frozen=True)
class RecipeSearch:
    chosen: MethodSettings
    start: MethodSettings
    trials: tuple[Trial, ...]  # in the order tried
    # What the search could ship (None: anything it tried). The papers' recipe and the seeds are
    # measured whatever the space, as what a choice must beat, but never shipped from outside it.
    space: SearchSpace | None = None

    def allowed(self, settings: MethodSettings) -> bool:
        return self.space is None or self.space.holds(settings)

    def ppl_of(self, settings: MethodSettings) -> float:
        key = recipe_key(settings)
        return next(t.ppl for t in self.trials if recipe_key(t.settings) == key)

    def finalists(self, count: int = 3) -> tuple[MethodSettings, ...]:
        """The chosen recipe, the runners-up by PPL, the best recipe of each scorer not among them
        yet (so the held-out half also sees the best of the kind the choice passed over), the chosen
        recipe with the same ratio in every layer where the search tried it (so every profile shows
        what its per-layer allocation buys on prompts that did not choose it) and the papers'
        recipe the search started from (the others all within the search's space)."""
        ranked = sorted((t for t in self.trials if self.allowed(t.settings)), key=lambda t: t.ppl)
        picked = {recipe_key(self.chosen): self.chosen}
        for trial in ranked:
            if len(picked) >= count:
                break
            picked.setdefault(recipe_key(trial.settings), trial.settings)
        for scorer in dict.fromkeys(t.settings.scorer for t in ranked):
            if not any(s.scorer == scorer for s in picked.values()):
                best = next(t.settings for t in ranked if t.settings.scorer == scorer)
                picked[recipe_key(best)] = best
        uniform = dataclasses.replace(self.chosen, ratios="uniform")
        if any(recipe_key(t.settings) == recipe_key(uniform) for t in ranked):
            picked.setdefault(recipe_key(uniform), uniform)
        picked.setdefault(recipe_key(self.start), self.start)
        return tuple(picked.values())


def pick_recipe(search: RecipeSearch, held_out: dict[tuple, float], choosing: int, confirming: int) -> MethodSettings:
    """The recipe calibration ships: the search's choice when the held-out prompts confirm it (it
    is no worse than the papers' recipe there) or there is nothing to confirm; else the finalist
    with the lowest PPL over all the prompts (exp of the prompt-weighted mean log PPL of both
    halves). Five prompts can rank recipes the other five reverse; shipping a choice its own
    held-out check rejects would be worse, and the fallback is reported as not confirmed."""
    chosen, start = recipe_key(search.chosen), recipe_key(search.start)
    if not held_out or chosen == start or held_out[chosen] <= held_out[start]:
        return search.chosen
    by_key = {recipe_key(t.settings): t for t in search.trials}

    def overall(key: tuple) -> float:
        return (choosing * math.log(by_key[key].ppl) + confirming * math.log(held_out[key])) / (choosing + confirming)

    return by_key[min((k for k in held_out if search.allowed(by_key[k].settings)), key=overall)].settings


# Measures the new recipes of one stage, together (`passes.recipe_ppls` runs them side by side):
# `measure(stage, recipes)` gives their PPLs in order.
Measure = Callable[[str, Sequence[MethodSettings]], Sequence[float]]


# A later round retries a stage's value only if, in the first round, it measured within this factor
# of the PPL that stage had to beat. Replayed on the recorded trials of seven calibration runs (the
# four built-in profiles, three others of SmolLM2 and Gemma 3 270M): the same choice in all seven,
# with 4-29% fewer trials (`benchmarks/search_replay.py`).
RETRY_WITHIN = 1.10


def search_recipe(
    start: MethodSettings,
    space: SearchSpace,
    measure: Measure,
    rounds: int = 4,
    seeds: tuple[MethodSettings, ...] = (),
    per_pass: int = 1,
    retry_within: float | None = RETRY_WITHIN,
) -> RecipeSearch:
    """Coordinate descent over `space` from the best of `start` and `seeds` (the recipes users would
    run instead: the search starts from whichever of them measures best, so it can only improve on
    them); `measure(stage, recipes)` gives the PPLs of recipes not measured yet.

    A round walks every stage once; the next round starts only if the last one moved (a rule chosen
    late can change which earlier value is best: the first round tries the generation rules with the
    starting recipe's scorer), up to `rounds` rounds, and recipes already measured are not measured
    again. A later round retries only the values that came within `retry_within` of their stage's PPL
    to beat in the first round (None: all of them). Without that rule the search stops where no single
    rule change lowers the PPL. The default 4 rounds, not 2, because on SmolLM2 at 0.2 a second round
    can still move (the rule changes in round 2 and the ratio source after it, so the rules need a
    third round to be tried with that ratio source).

    Each call to `measure` is one teacher-forced pass with its recipes side by side, and a pass of
    a few recipes costs little more than a pass of one. So a stage with room left (fewer than
    `per_pass` new recipes) also hands over the next stages' recipes as they would be if the
    current recipe survives this stage: when it does, those stages need no pass of their own; when
    it does not, they are measured again around the new recipe, and the extra ones are simply
    further recipes tried. The choices are the same as with `per_pass = 1`."""
    trials: dict[tuple, Trial] = {}

    def fresh(options: Sequence[MethodSettings], taken: dict[tuple, tuple[str, MethodSettings]]) -> list[MethodSettings]:
        return list({recipe_key(s): s for s in options if recipe_key(s) not in trials and recipe_key(s) not in taken}.values())

    def run(batch: dict[tuple, tuple[str, MethodSettings]]) -> None:
        if not batch:
            return
        labels, recipes = zip(*batch.values())
        ppls = list(measure(labels[0], recipes))
        if len(ppls) != len(recipes):
            raise ValueError(f"measure gave {len(ppls)} PPLs for {len(recipes)} recipes")
        for key, label, settings, ppl in zip(batch, labels, recipes, ppls):
            trials[key] = Trial(label, settings, float(ppl))

    opening = {recipe_key(start): (FIRST_STAGE, start)}
    for seed in seeds:
        opening.setdefault(recipe_key(seed), (SEED_STAGE, seed))
    run(opening)
    # Ties keep the papers' recipe, then the earlier seed.
    current = min((trials[recipe_key(s)] for s in (start, *seeds)), key=lambda t: t.ppl).settings
    # Per stage, the first round's PPL to beat and each value's PPL there.
    first: dict[str, tuple[float, dict]] = {}
    for round_ in range(1, rounds + 1):
        before = recipe_key(current)
        walk = [(stage if round_ == 1 else f"{stage} ({round_})", attr) for stage, attr, _ in STAGES]

        def stage_recipes(attr: str) -> list[MethodSettings]:
            if attr == "truncation_distance" and current.eviction != "fixed-point":
                return []
            options = stage_options(attr, current, space)
            if round_ == 1 or retry_within is None or attr not in first:
                return options
            to_beat, measured = first[attr]
            return [
                s for s in options
                if recipe_key(s) == recipe_key(current) or measured.get(_value(attr, s), 0.0) <= retry_within * to_beat
            ]

        for index, (label, attr) in enumerate(walk):
            options = stage_recipes(attr)
            if not options:
                continue
            batch: dict[tuple, tuple[str, MethodSettings]] = {}
            for s in fresh(options, batch):
                batch[recipe_key(s)] = (label, s)
            for later_label, later_attr in walk[index + 1 :]:
                ahead = fresh(stage_recipes(later_attr), batch)
                if len(batch) + len(ahead) > per_pass:
                    break
                for s in ahead:
                    batch[recipe_key(s)] = (later_label, s)
            run(batch)
            incumbent = trials[recipe_key(current)]
            if round_ == 1:
                first[attr] = (incumbent.ppl, {_value(attr, s): trials[recipe_key(s)].ppl for s in options})
            best = min((trials[recipe_key(s)] for s in options), key=lambda t: t.ppl)
            # A start or seed outside the space (`--space selections=importance` beside H2O's seed)
            # takes the stage's best value even when that measures worse: the space binds the choice.
            if best.ppl < incumbent.ppl or not space.holds_rule(current, attr):
                current = best.settings
        if recipe_key(current) == before:
            break
    return RecipeSearch(chosen=current, start=start, trials=tuple(trials.values()), space=space)


def _value(attr: str, settings: MethodSettings) -> object:
    """The value a stage sets (the scorer stage: the scorer with its window, pool width and share)."""
    if attr == "scorer":
        return (settings.scorer, settings.window, settings.pool, settings.window_share)
    return getattr(settings, attr)

