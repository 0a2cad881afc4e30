"""The recipe search (kvtool.calibration.recipes) against a brute-force search of the same space, on
cheap made-up measures; the sample draw and split it runs on; the profile record it leaves."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable

import pytest

from kvtool.calibration.recipes import (
    FIRST_STAGE,
    RETRY_WITHIN,
    STAGES,
    SearchSpace,
    describe,
    recipe_key,
    search_recipe,
    stage_options,
)
from kvtool.data import Record, select_by_kind, split_by_kind
from kvtool.errors import KvtoolError
from kvtool.profiles import MethodSettings
from kvtool.profiles.schema import WINDOW_SCORERS

START = MethodSettings(merge="position", truncation_distance=25)
# H2O's selection has no recent share to vary, which makes no measure separable: the brute-force
# comparisons keep one selection (the selection stage has its own tests below).
SPACE = SearchSpace(selections=("importance",))


def brute_force(start: MethodSettings, space: SearchSpace, measure: Callable[[MethodSettings], float]) -> MethodSettings:
    """The best recipe of the whole product, tried one by one (what the search must find on cheap measures)."""
    best, best_ppl = start, float(measure(start))
    for eviction in space.evictions:
        distances = space.distances if eviction == "fixed-point" else (start.truncation_distance,)
        scorers = [
            (s, w, p, f) for s in space.scorers
            for w, p in (itertools.product(space.windows, space.pools) if s in WINDOW_SCORERS else ((start.window, start.pool),))
            for f in (space.window_shares if s == "union" else (start.window_share,))
        ]
        for selection, (scorer, window, pool, share_), ratios in itertools.product(space.selections, scorers, space.ratio_sources):
            for heads, share, merge, distance in itertools.product(space.heads, space.recent_shares, space.merge_modes, distances):
                settings = dataclasses.replace(
                    start, eviction=eviction, selection=selection, scorer=scorer, window=window, pool=pool, window_share=share_,
                    ratios=ratios, heads=heads, recent_share=share, merge=merge, truncation_distance=distance,
                )
                ppl = float(measure(settings))
                if ppl < best_ppl:
                    best, best_ppl = settings, ppl
    return best


def each(measure):
    """The search hands a stage's new recipes over together; these measures take them one by one."""
    return lambda stage, recipes: [measure(stage, s) for s in recipes]


def separable(seed: int, distance_costs: bool = False):
    """A measure that is a sum of one random cost per rule value: coordinate descent finds its
    minimum in one round, whatever the start. D costs are off by default: the generation rule is
    chosen at the start's D, so a D that would make the queue win is out of its reach (the search
    is pruned, not exhaustive)."""
    rng = random.Random(seed)
    costs = {
        "eviction": {v: rng.random() for v in SPACE.evictions},
        "scorer": {v: rng.random() for v in SPACE.scorers},
        "pool": {v: rng.random() for v in SPACE.pools},
        "ratios": {v: rng.random() for v in SPACE.ratio_sources},
        "heads": {v: rng.random() for v in SPACE.heads},
        "recent_share": {v: rng.random() for v in SPACE.recent_shares},
        "merge": {v: rng.random() for v in SPACE.merge_modes},
        "truncation_distance": {v: rng.random() if distance_costs else 0.0 for v in SPACE.distances},
    }

    def measure(settings: MethodSettings) -> float:
        skip = ("truncation_distance", "pool")
        total = 1.0 + sum(costs[attr][getattr(settings, attr)] for attr in costs if attr not in skip)
        if settings.scorer == "window":
            total += costs["pool"][settings.pool]
        if settings.eviction == "fixed-point":
            total += costs["truncation_distance"][settings.truncation_distance]
        return total

    return measure


@pytest.mark.parametrize("seed", range(20))
def test_search_finds_the_brute_force_best_of_a_separable_measure(seed):
    measure = separable(seed)
    calls = []
    search = search_recipe(START, SPACE, each(lambda stage, s: calls.append(s) or measure(s)))
    best = brute_force(START, SPACE, measure)
    assert measure(search.chosen) == pytest.approx(measure(best))
    # Each recipe measured once, and far fewer than the product (about 240 recipes).
    assert len({recipe_key(s) for s in calls}) == len(calls) < 45
    assert search.trials[0].stage == FIRST_STAGE and search.trials[0].settings == START


def test_d_is_the_queue_length_with_the_lowest_cost_once_the_queue_wins():
    for seed in range(10):
        costs = separable(seed, distance_costs=True)
        measure = lambda s: costs(s) - (10.0 if s.eviction == "fixed-point" else 0.0)  # noqa: E731
        search = search_recipe(START, SPACE, each(lambda stage, s: measure(s)))
        assert search.chosen.eviction == "fixed-point"
        assert measure(search.chosen) == pytest.approx(measure(brute_force(START, SPACE, measure)))


def test_search_never_ends_worse_than_where_it_started_and_keeps_ties():
    flat = search_recipe(START, SPACE, each(lambda stage, s: 3.0))
    assert flat.chosen == START  # ties keep the current recipe
    rng = random.Random(1)
    table: dict = {}
    for _ in range(30):
        noisy = search_recipe(START, SPACE, each(lambda stage, s: table.setdefault(recipe_key(s), rng.random())))
        assert noisy.ppl_of(noisy.chosen) <= noisy.ppl_of(START)
        assert noisy.ppl_of(noisy.chosen) == min(t.ppl for t in noisy.trials)


def test_a_second_round_revisits_an_early_rule():
    # tova only pays off with the window scorer, which the first round reaches after the generation
    # rule: the second round must go back and take tova.
    def measure(s: MethodSettings) -> float:
        cost = {"fixed-point": 5.0, "heavy-hitter": 4.0, "heavy-hitter-window": 4.8, "tova": 4.5}[s.eviction]
        if s.scorer == "window":
            cost -= 2.0 + (1.0 if s.eviction == "tova" else 0.0)
        return cost

    one = search_recipe(START, SPACE, each(lambda stage, s: measure(s)), rounds=1)
    two = search_recipe(START, SPACE, each(lambda stage, s: measure(s)), rounds=2)
    assert (one.chosen.eviction, one.chosen.scorer) == ("heavy-hitter", "window")
    assert (two.chosen.eviction, two.chosen.scorer) == ("tova", "window")
    assert any(t.stage.endswith("(2)") for t in two.trials)


def test_later_rounds_retry_only_values_that_came_close_in_the_first():
    # H2O's selection measures far worse with the papers' scorer, the first round's context, but wins
    # with the window scorer found later: the rule never retries it, which is what it trades away.
    def measure(s: MethodSettings) -> float:
        if s.selection == "heavy-hitter":
            return 0.5 if s.scorer == "window" else 9.0
        return 3.0 if s.scorer == "window" else 5.0

    space = SearchSpace()
    ruled = search_recipe(START, space, each(lambda stage, s: measure(s)))
    free = search_recipe(START, space, each(lambda stage, s: measure(s)), retry_within=None)
    assert (free.chosen.selection, free.chosen.scorer) == ("heavy-hitter", "window")
    assert (ruled.chosen.selection, ruled.chosen.scorer) == ("importance", "window")
    assert any(t.stage.endswith("(2)") for t in ruled.trials)
    assert all(t.settings.selection == "importance" for t in ruled.trials if t.stage.endswith("(2)"))
    assert len(ruled.trials) < len(free.trials)


def test_d_is_searched_only_for_the_fixed_point_queue():
    tova_wins = lambda stage, s: 1.0 if s.eviction == "tova" else 2.0  # noqa: E731
    search = search_recipe(START, SPACE, each(tova_wins))
    assert search.chosen.eviction == "tova"
    assert not [t for t in search.trials if t.stage == "D"]
    # D does not tell tova recipes apart.
    a, b = dataclasses.replace(search.chosen, truncation_distance=0), dataclasses.replace(search.chosen, truncation_distance=96)
    assert recipe_key(a) == recipe_key(b)
    assert "D" not in describe(search.chosen) and "D25" in describe(START)


def test_finalists_are_the_chosen_the_runners_up_and_the_start():
    table: dict = {}
    rng = random.Random(3)
    search = search_recipe(START, SPACE, each(lambda stage, s: table.setdefault(recipe_key(s), rng.random())))
    finalists = search.finalists(3)
    keys = [recipe_key(s) for s in finalists]
    assert keys[0] == recipe_key(search.chosen)
    # The chosen, two runners-up, the best of every other scorer, the chosen with uniform ratios, the start.
    assert recipe_key(START) in keys and len(set(keys)) == len(keys) <= 3 + (len(SPACE.scorers) - 1) + 1 + 1
    uniform = dataclasses.replace(search.chosen, ratios="uniform")
    if search.chosen.ratios != "uniform" and any(recipe_key(t.settings) == recipe_key(uniform) for t in search.trials):
        assert recipe_key(uniform) in keys
    # Every scorer the search tried has its best recipe among the finalists.
    for scorer in {t.settings.scorer for t in search.trials}:
        best = min((t for t in search.trials if t.settings.scorer == scorer), key=lambda t: t.ppl)
        assert any(f.scorer == scorer for f in finalists)
        assert recipe_key(best.settings) in keys or any(
            f.scorer == scorer and search.ppl_of(f) <= best.ppl for f in finalists if recipe_key(f) != recipe_key(START)
        )


@pytest.mark.parametrize(
    "space, message",
    [
        (SearchSpace(evictions=("lru",)), "unknown generation rule 'lru'"),
        (SearchSpace(scorers=()), "at least one scorer"),
        (SearchSpace(recent_shares=(1.5,)), "recent shares must be fractions"),
        (SearchSpace(distances=(-1,)), "truncation distances must be integers >= 0"),
        (SearchSpace(pools=(8,)), "pool widths must be odd integers >= 1"),
        (SearchSpace(pools=()), "pool widths must be odd integers >= 1"),
        (SearchSpace(windows=(0,)), "observation windows must be integers >= 1"),
        (SearchSpace(selections=("recent",)), "unknown selection 'recent'"),
        (SearchSpace(seeds=("nope",)), "search seed: unknown method 'nope'"),
        (SearchSpace(seeds=("snapkv",)), "search seed 'snapkv' does not hold the budget"),
        (SearchSpace(seeds=("kvtool",)), "search seed: method 'kvtool' is the calibrated recipe"),
        (SearchSpace(merge_modes=("blend",)), "unknown merge mode 'blend'"),
    ],
)
def test_bad_search_spaces_fail_in_one_line(space, message):
    with pytest.raises(KvtoolError, match=message):
        space.checked()


def _records(kinds: list[str | None]) -> tuple[Record, ...]:
    return tuple(Record(prompt=f"p{i}", kind=kind) for i, kind in enumerate(kinds))


def test_draw_spreads_over_kinds_and_the_split_shares_every_kind():
    kinds = [k for k in ("doc", "chat", "code", "image", "retrieval") for _ in range(10)]
    records = _records(kinds)
    for seed in range(5):
        drawn = select_by_kind(records, 10, seed)
        assert sorted(r.kind for r in drawn) == sorted(k for k in set(kinds) for _ in range(2))
        assert drawn == select_by_kind(records, 10, seed)  # same seed, same draw
        first, second = split_by_kind(drawn)
        assert {r.kind for r in first} == {r.kind for r in second} == set(kinds)
        assert not set(first) & set(second) and len(first) + len(second) == len(drawn)
    # Uneven kinds and no kind at all still give distinct records, as many as asked.
    mixed = _records(["a"] * 7 + [None] * 2 + ["b"])
    for samples in range(1, 11):
        drawn = select_by_kind(mixed, samples, 0)
        assert len(set(drawn)) == samples
    with pytest.raises(KvtoolError, match="only 10 prompts"):
        select_by_kind(mixed, 11, 0)


def test_the_search_space_default_covers_every_held_rule():
    assert set(SPACE.evictions) == {"fixed-point", "heavy-hitter", "heavy-hitter-window", "tova"}
    assert set(SPACE.scorers) == {"attention-sum", "window", "union", "expected-attention", "expected-output"}
    product = list(itertools.product(
        SPACE.evictions, SPACE.scorers, SPACE.ratio_sources, SPACE.heads, SPACE.recent_shares, SPACE.merge_modes
    ))
    assert len(product) == 960  # times the D values of the fixed-point queue


# ----- what a searched profile records ------------------------------------------------------------

def _searched_profile(tmp_path):
    import numpy as np

    from kvtool.profiles import CalibrationInfo, PromptStats, RecipeTrial
    from kvtool.profiles.lorenz import priority_curve
    from tiny_models import profile_with, tiny_llama

    rng = np.random.default_rng(0)
    base = profile_with(tiny_llama(), [0.3, 0.5, 0.2], scorer="window", eviction="tova", heads="per-head", recent_share=0.25)
    layers = tuple(
        dataclasses.replace(
            layer,
            priority_curve=tuple(float(v) for v in priority_curve(rng.pareto(1.0 + i, 300), 201)),
            scorer_curve=tuple(float(v) for v in priority_curve(rng.pareto(3.0 - i, 300), 201)),
        )
        for i, layer in enumerate(base.layers)
    )
    trials = (
        RecipeTrial("start", "attention-sum", "shared", "fixed-point", 0.0, "position", 25, 4.9, held_out_ppl=4.6),
        RecipeTrial("scorer", "window", "per-head", "tova", 0.25, "none", 25, 2.5, held_out_ppl=2.4),
    )
    info = CalibrationInfo(
        dataset_hash="sha256:x", samples=10, prompt_tokens=PromptStats(min=100, mean=500.0, max=1000),
        chosen_on=5, confirmed_on=5, held_out_ppl_full=1.7, recipes=trials,
    )
    return dataclasses.replace(base, layers=layers, calibration=info)


def test_recipe_record_and_scorer_curves_round_trip(tmp_path):
    from kvtool.profiles import read_profile, save_profile

    profile = _searched_profile(tmp_path)
    path = save_profile(profile, tmp_path / "p.yaml")
    text = path.read_text()
    assert "scorer_curve:" in text and "recipes:" in text and "held_out_ppl: 2.4" in text
    back = read_profile(path)
    assert back.calibration.recipes == profile.calibration.recipes
    assert back.method == profile.method
    # A profile without a search writes none of the new keys (older files read as they were).
    plain = dataclasses.replace(profile, calibration=None, layers=tuple(dataclasses.replace(l, scorer_curve=None) for l in profile.layers))
    assert "scorer_curve" not in save_profile(plain, tmp_path / "q.yaml").read_text()


def test_rebudget_solves_on_the_scorers_curves_and_prefixkv_on_attention_sums(tmp_path):
    import numpy as np

    from kvtool.profiles.budget import solve_ratios
    from kvtool.profiles.whole_cache import rebudget
    from kvtool.runtime import method_profile
    from tiny_models import tiny_llama

    profile = _searched_profile(tmp_path)
    scorer = np.array([layer.scorer_curve for layer in profile.layers])
    importance = np.array([layer.priority_curve for layer in profile.layers])
    own, _ = rebudget(profile, 0.3)
    assert [l.ratio for l in own.layers] == pytest.approx(list(solve_ratios(scorer, 0.3).ratios))
    assert own.calibration.recipes is None  # measured at the old budget
    papers, _ = rebudget(profile, 0.3, importance_curves=True)
    assert [l.ratio for l in papers.layers] == pytest.approx(list(solve_ratios(importance, 0.3).ratios))
    assert all(l.scorer_curve is None for l in papers.layers)
    assert solve_ratios(scorer, 0.3).ratios.tolist() != pytest.approx(solve_ratios(importance, 0.3).ratios.tolist())
    model = tiny_llama()
    prefixkv = method_profile("prefixkv", model, profile.budget, profile)
    assert [l.ratio for l in prefixkv.layers] == pytest.approx(list(solve_ratios(importance, profile.budget).ratios))
    assert method_profile("kvtool", model, profile.budget, profile) == profile


def test_exact_answers_become_the_forced_calibration_reference():
    from kvtool.calibration.runner import exact_answers

    records = (
        Record(prompt="find them", answers=("123", "456"), kind="retrieval"),
        Record(prompt="say it", answer="given", answers=("x",)),
        Record(prompt="chat"),
    )
    out = exact_answers(records)
    assert [r.answer for r in out] == ["123, 456", "given", None]
    assert [r.prompt for r in out] == [r.prompt for r in records]


def test_uniform_ratio_source_rebudgets_to_the_same_ratio_everywhere(tmp_path):
    from kvtool.profiles.whole_cache import rebudget
    from kvtool.runtime import method_profile
    from tiny_models import tiny_llama

    profile = _searched_profile(tmp_path)
    flat = dataclasses.replace(
        profile, method=dataclasses.replace(profile.method, ratios="uniform"),
        layers=tuple(dataclasses.replace(l, ratio=0.2, scorer_curve=None) for l in profile.layers), budget=0.2,
    )
    again, _ = rebudget(flat, 0.35)
    assert [l.ratio for l in again.layers] == [0.35] * 3 and again.method.ratios == "uniform"
    # prefixkv still solves on the attention-sum curves the profile stores.
    papers = method_profile("prefixkv", tiny_llama(), 0.2, flat)
    assert len({round(l.ratio, 6) for l in papers.layers}) > 1 and papers.method.ratios == "scorer"
    assert method_profile("h2o", tiny_llama(), 0.2, flat).method.ratios == "uniform"


def test_the_scorer_stage_tries_the_window_scorers_once_per_pool_width():

    options = stage_options("scorer", START, SearchSpace(pools=(1, 7, 31), window_shares=(0.5,)))
    assert [(s.scorer, s.pool) for s in options] == [("attention-sum", START.pool)] + [
        (scorer, pool) for scorer in ("window", "union") for pool in (1, 7, 31)
    ] + [("expected-attention", START.pool), ("expected-output", START.pool)]
    # The pool tells window and union recipes apart and is ignored for the scorers that do not pool.
    assert len({recipe_key(s) for s in options}) == 9
    assert recipe_key(dataclasses.replace(START, pool=31)) == recipe_key(START)
    assert "pool 31" in describe(options[3]) and "pool" not in describe(START)
    assert describe(options[-3]).split(" · ")[1] == "union (window 32, pool 31)"


def test_the_scorer_stage_tries_the_union_at_every_window_share():

    options = stage_options("scorer", START, SearchSpace(pools=(15,), window_shares=(0.5, 0.7)))
    assert [(s.scorer, s.pool, s.window_share) for s in options] == [
        ("attention-sum", START.pool, START.window_share), ("window", 15, START.window_share),
        ("union", 15, 0.5), ("union", 15, 0.7), ("expected-attention", START.pool, START.window_share),
        ("expected-output", START.pool, START.window_share),
    ]
    # The share tells union recipes apart only: the other scorers ignore it.
    assert len({recipe_key(s) for s in options}) == 6
    assert recipe_key(dataclasses.replace(options[1], window_share=0.7)) == recipe_key(options[1])
    assert recipe_key(dataclasses.replace(START, window_share=0.7)) == recipe_key(START)
    assert describe(options[-3]).split(" · ")[1] == "union (window 32, pool 15, window share 70%)"
    assert describe(options[-4]).split(" · ")[1] == "union (window 32, pool 15)"


@pytest.mark.parametrize("shares", [(), (0.0,), (1.0,), (0.5, 1.2), (True,)])
def test_bad_window_shares_are_refused(shares):
    with pytest.raises(KvtoolError, match="window shares must be fractions strictly between 0 and 1"):
        SearchSpace(window_shares=shares).checked()


def test_a_pool_width_only_the_window_scorer_rewards_is_found():
    """A measure where pool 31 wins only under the window scorer: the search must reach it even
    though the start's scorer ignores the pool."""

    def measure(stage, settings):
        if settings.scorer == "window":
            return 1.0 if settings.pool == 31 else 3.0
        return 2.0

    search = search_recipe(START, SPACE, each(measure))
    assert (search.chosen.scorer, search.chosen.pool) == ("window", 31)


def test_the_search_starts_from_the_best_seed_and_only_improves_on_it():
    from kvtool.calibration.recipes import SEED_STAGE, seed_recipes
    from kvtool.runtime.methods import method_settings

    space = SearchSpace()
    seeds = seed_recipes(space, START)
    h2o = method_settings("h2o", START)
    assert recipe_key(seeds[0]) == recipe_key(h2o) and (h2o.selection, h2o.eviction) == ("heavy-hitter", "heavy-hitter")
    # Every recipe measures 5 except H2O's, the best of all: the search must keep it.
    search = search_recipe(START, space, each(lambda stage, s: 1.0 if recipe_key(s) == recipe_key(h2o) else 5.0), seeds=seeds)
    assert recipe_key(search.chosen) == recipe_key(h2o)
    assert [t.stage for t in search.trials[:3]] == ["start", SEED_STAGE, SEED_STAGE]
    # The papers' recipe stays the one the finalists are confirmed against.
    assert recipe_key(START) in {recipe_key(s) for s in search.finalists()}


def test_a_restricted_space_binds_the_choice_even_when_a_seed_outside_it_measures_best():
    """`--space selections=importance` beside H2O's seed, as the built-in 0.2 line of
    scripts/build_builtin_profiles.sh runs it: the seed measures best and the selection stage's one
    value worse, and the shipped recipe still takes its selection from the space, not the seed's H2O one."""
    from kvtool.calibration.recipes import pick_recipe, seed_recipes

    space = SearchSpace(evictions=("heavy-hitter",), selections=("importance",)).checked()
    seeds = seed_recipes(space, START)
    h2o = recipe_key(seeds[0])
    rng = random.Random(7)
    table: dict = {}
    measure = lambda stage, s: 1.0 if recipe_key(s) == h2o else table.setdefault(recipe_key(s), 2.0 + rng.random())  # noqa: E731
    search = search_recipe(START, space, each(measure), seeds=seeds)
    assert any(recipe_key(t.settings) == h2o for t in search.trials)  # measured, as what a choice must beat
    assert space.holds(search.chosen) and search.chosen.selection == "importance" and search.chosen.eviction == "heavy-hitter"
    assert not space.holds(seeds[0]) and not space.holds(START)
    finalists = search.finalists()
    assert recipe_key(START) in {recipe_key(f) for f in finalists}
    assert all(space.holds(f) for f in finalists if recipe_key(f) != recipe_key(START))
    # The held-out half rejects the choice and favours the papers' recipe: the fallback stays in the space.
    held_out = {recipe_key(f): 3.0 for f in finalists} | {recipe_key(search.chosen): 9.0, recipe_key(START): 0.5}
    assert space.holds(pick_recipe(search, held_out, 5, 5))
    # Without a restriction the same measures keep H2O's seed.
    free = search_recipe(START, SearchSpace(), each(measure), seeds=seed_recipes(SearchSpace(), START))
    assert recipe_key(free.chosen) == h2o


def test_the_selection_stage_can_move_to_h2o_selection_and_then_ignores_the_recent_share():
    space = SearchSpace()
    calls = []

    def measure(stage, settings):
        calls.append(settings)
        return 1.0 if settings.selection == "heavy-hitter" else 2.0 + settings.recent_share

    search = search_recipe(START, space, each(measure))
    assert search.chosen.selection == "heavy-hitter"
    # Recipes that differ only in a recent share the selection ignores are measured once.
    keys = [recipe_key(s) for s in calls]
    assert len(keys) == len(set(keys))
    assert not any(s.selection == "heavy-hitter" and s.recent_share != search.chosen.recent_share for s in calls)


def test_a_choice_the_held_out_prompts_reject_falls_back_to_the_best_finalist_over_all_prompts():
    from kvtool.calibration.recipes import pick_recipe

    table: dict = {}
    rng = random.Random(5)
    search = search_recipe(START, SPACE, each(lambda stage, s: table.setdefault(recipe_key(s), 1.0 + rng.random())))
    finalists = search.finalists()
    chosen, start = recipe_key(search.chosen), recipe_key(START)
    other = next(recipe_key(f) for f in finalists if recipe_key(f) not in (chosen, start))
    confirmed = {recipe_key(f): 3.0 for f in finalists} | {chosen: 2.0}
    assert pick_recipe(search, confirmed, 5, 5) == search.chosen
    assert pick_recipe(search, {}, 5, 0) == search.chosen  # nothing held out
    # Rejected (worse than the papers' recipe on the held-out half): the finalist whose
    # prompt-weighted mean log PPL over both halves is lowest.
    rejected = {recipe_key(f): 3.0 for f in finalists} | {chosen: 9.0, start: 2.5, other: 1.01}
    import math
    overall = lambda k: (5 * math.log(search.ppl_of(next(t.settings for t in search.trials if recipe_key(t.settings) == k))) + 5 * math.log(rejected[k])) / 10  # noqa: E731
    expected = min(rejected, key=overall)
    assert recipe_key(pick_recipe(search, rejected, 5, 5)) == expected != chosen


def test_each_stage_hands_its_new_recipes_over_together():
    """`measure` runs a stage's recipes side by side (passes.recipe_ppls): one call per stage with
    every new recipe of it, the papers' recipe and the seeds in the first; nothing measured twice."""
    from kvtool.calibration.recipes import SEED_STAGE, seed_recipes

    space = SearchSpace()
    seeds = seed_recipes(space, START)
    calls = []

    def measure(stage, recipes):
        calls.append((stage, list(recipes)))
        return [1.0 if s.scorer == "window" and s.pool == 31 else 2.0 for s in recipes]

    search = search_recipe(START, space, measure, seeds=seeds)
    assert calls[0] == (FIRST_STAGE, [START, *seeds])
    scorer = next(recipes for stage, recipes in calls if stage == "scorer")
    assert len(scorer) >= len(stage_options("scorer", START, space)) - 1  # all but the incumbent
    keys = [recipe_key(s) for _, recipes in calls for s in recipes]
    assert len(keys) == len(set(keys)) == len(search.trials)
    assert [t.stage for t in search.trials[:3]] == ["start", SEED_STAGE, SEED_STAGE]
    with pytest.raises(ValueError, match="PPLs for"):
        search_recipe(START, space, lambda stage, recipes: [1.0])


@pytest.mark.parametrize("seed", range(12))
def test_passes_that_look_ahead_choose_the_same_recipe_in_fewer_passes(seed):
    """With room for several recipes per pass the search also measures the next stages' recipes
    around the current one; its choices must be those of one stage per pass."""
    from kvtool.calibration.recipes import seed_recipes

    rng = random.Random(seed)
    table: dict = {}
    noisy = lambda stage, s: table.setdefault(recipe_key(s), 1.0 + rng.random())  # noqa: E731
    space = SearchSpace()
    seeds = seed_recipes(space, START)
    passes = {1: [], 6: []}
    searches = {}
    for per_pass, calls in passes.items():
        def measure(stage, recipes, calls=calls):
            calls.append(len(recipes))
            return [noisy(stage, s) for s in recipes]

        searches[per_pass] = search_recipe(START, space, measure, seeds=seeds, per_pass=per_pass)
    one, ahead = searches[1], searches[6]
    assert recipe_key(ahead.chosen) == recipe_key(one.chosen)
    assert {recipe_key(t.settings) for t in one.trials} <= {recipe_key(t.settings) for t in ahead.trials}
    assert len(passes[6]) < len(passes[1])
    assert max(passes[6][1:]) <= max(6, max(passes[1]))  # a stage alone may exceed the room


def _rounds_used(search) -> int:
    return max(int(t.stage.rsplit("(", 1)[1][:-1]) if t.stage.endswith(")") else 1 for t in search.trials)


def test_the_search_stops_where_no_single_rule_change_improves():
    # Random costs move the search in late rounds; unless it hit the round cap, the chosen recipe
    # must beat every recipe one rule away from it (a round that still moved is followed by another).
    # Without the retry rule (`RETRY_WITHIN`), which trades this guarantee for fewer trials.
    rng = random.Random(5)
    past_two = 0
    for _ in range(25):
        table: dict = {}
        measure = each(lambda stage, s: table.setdefault(recipe_key(s), rng.random()))
        search = search_recipe(START, SPACE, measure, retry_within=None)
        used = _rounds_used(search)
        if used == 4:
            continue
        past_two += used > 2
        best = table[recipe_key(search.chosen)]
        for _, attr, _ in STAGES:
            if attr == "truncation_distance" and search.chosen.eviction != "fixed-point":
                continue
            for option in stage_options(attr, search.chosen, SPACE):
                assert table[recipe_key(option)] >= best
    assert past_two > 0


BUILT_IN = ["smollm2-b0.1", "smollm2-b0.2", "smollm2-b0.5", "gemma3-270m-b0.2", "gemma3-270m-b0.5"]


def _replays(name: str):
    """The built-in profile `name` and its search replayed without and with the retry rule."""
    from kvtool.calibration.config import DEFAULT_BATCH_SIZE
    from kvtool.calibration.replay import replay
    from kvtool.calibration.search import ROWS_PER_PASS
    from kvtool.profiles import read_profile
    from kvtool.profiles.builtin import builtin_dir

    profile = read_profile(builtin_dir() / f"{name}.yaml")
    per_pass = ROWS_PER_PASS // min(profile.calibration.chosen_on, DEFAULT_BATCH_SIZE)  # the run's largest batch of choosing prompts
    return profile, replay(profile, per_pass=per_pass, retry_within=None), replay(profile, per_pass=per_pass, retry_within=RETRY_WITHIN)


def test_the_retry_rule_saves_trials_over_the_built_in_searches():
    """Over the built-in profiles' recorded searches the rule measures fewer recipes in all (it may
    save nothing on one whose later rounds only retried values within `RETRY_WITHIN`)."""
    counts = [(len(unruled.search.trials), len(ruled.search.trials)) for _, unruled, ruled in map(_replays, BUILT_IN)]
    assert sum(r for _, r in counts) < sum(u for u, _ in counts)
    assert sum(r < u for u, r in counts) >= len(BUILT_IN) - 1


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_built_in_searches_replay_exactly_and_the_retry_rule_keeps_their_choice(name):
    """Replayed on their recorded PPLs, the built-in profiles' searches ask for exactly the recipes they
    measured and choose what they chose (with the retry rule, for those calibrated since it exists;
    without, for older ones); with the rule, the same choice from a subset of the trials without it:
    fewer, or the very same ones where the later rounds retried only values within the rule's margin
    (smollm2-b0.1: 47 either way)."""
    profile, unruled, ruled = _replays(name)
    info = profile.calibration
    as_run = ruled if ruled.unmeasured == 0 and len(ruled.search.trials) == len(info.recipes) else unruled
    assert as_run.unmeasured == 0 and len(as_run.search.trials) == len(info.recipes)
    # A storage the storage stage shipped has its own PPL (`calibration.storages`); the search's is "as searched",
    # or, for a search run at a format's entries (no such trial), its lowest recorded trial.
    stored = {t.storage: t.ppl for t in info.storages or ()}
    searched = stored.get("as searched", min(t.ppl for t in info.recipes) if stored else info.ppl_compressed)
    assert as_run.ppl == searched or info.fell_back
    assert recipe_key(ruled.search.chosen) == recipe_key(unruled.search.chosen)
    tried = lambda search: {recipe_key(t.settings) for t in search.trials}  # noqa: E731
    assert tried(ruled.search) <= tried(unruled.search)
    skipped = tried(unruled.search) - tried(ruled.search)
    assert len(ruled.search.trials) == len(unruled.search.trials) - len(skipped)
