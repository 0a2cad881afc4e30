"""The draft stage of calibration: the search's pick and its one-rule neighbours measured with the draft.

`drafted_ppls` is checked against another route (each prompt alone, unpadded, drafted as `kvtool
generate` drafts it, then teacher-forced); the choice rule against hand-made
numbers; a calibration run with the stage records what it measured and ships what the rule picks.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvtool.calibration.drafted import draft_candidates, pick_drafted
from kvtool.calibration.passes import drafted_ppls, full_pass
from kvtool.calibration.recipes import RecipeSearch, SearchSpace, Trial, recipe_key
from kvtool.calibration.runner import calibrate
from kvtool.errors import KvtoolError
from kvtool.profiles import Draft, MethodSettings
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.draft import prepare
from kvtool.runtime.steps import Prompt
from kvtool.scoring import encode_batches, teacher_forced_nll
from test_calibrate import loaded, sharpened_llama, word_prompts

SPACE = SearchSpace(
    evictions=("tova", "heavy-hitter", "fixed-point"), selections=("importance",), scorers=("union",), windows=(4,),
    pools=(3,), ratio_sources=("attention-sum", "uniform"), heads=("per-head",), recent_shares=(0.0,),
    merge_modes=("none",), distances=(8,), seeds=(),
)


@pytest.fixture(scope="module")
def tiny():
    model = sharpened_llama((400.0, 60.0, 1.0))
    model.model.to(torch.float64)
    return model


def kinds(count: int):
    return [dataclasses.replace(r, kind=("a", "b")[i % 2]) for i, r in enumerate(word_prompts(count, seed=4))]


# --------------------------------------------------------------------------- the measure


def test_drafted_ppl_is_each_prompt_alone_drafted_by_generate(tiny) -> None:
    """A padded batch of prompts, each recipe's caches one after another, gives the PPL of each prompt
    run alone, unpadded, through the draft (two rounds, prepared from the tokenizer's inputs as
    `generate` prepares them) and teacher-forced: the same mean of per-prompt mean NLLs."""
    method = MethodSettings(scorer="union", window=4, pool=3, heads="per-head", eviction="heavy-hitter")
    records = word_prompts(3, seed=5)
    batches, answers = encode_batches(tiny, records, max_tokens=200, method=method, batch_size=3)
    states = full_pass(tiny.model, tiny.tokenizer, batches, answers, method, reference_tokens=7, with_references=True).states
    profiles = [
        uniform_profile(tiny.model, budget, dataclasses.replace(method, eviction=rule, draft=Draft(4, rounds=2)))
        for budget, rule in ((0.3, "heavy-hitter"), (0.5, "tova"))
    ]
    together = drafted_ppls(tiny.model, profiles, states)

    state = states[0]
    for profile, ppl in zip(profiles, together):
        means = []
        with torch.inference_mode(), attach(tiny.model, profile) as handle:
            for row in range(state.batch.input_ids.shape[0]):
                real = state.batch.attention_mask[row].bool()
                ids = state.batch.input_ids[row][real][None]
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                cache = prepare(tiny.model, Prompt.of(inputs), handle.bare_cache, profile.method.draft).cache
                first = tiny.model(input_ids=ids).logits[:, -1]
                alone = dataclasses.replace(
                    state.batch, input_ids=ids, attention_mask=inputs["attention_mask"],
                    position_ids=torch.arange(ids.shape[1])[None], rows=(row,),
                )
                refs = dataclasses.replace(
                    state.references, tokens=state.references.tokens[row : row + 1],
                    scored=state.references.scored[row : row + 1], nll_full=state.references.nll_full[row : row + 1],
                )
                nll = teacher_forced_nll(tiny.model, cache, first, alone, refs)
                means.append(float(nll[refs.scored].mean()))
        assert ppl == pytest.approx(math.exp(sum(means) / len(means)), rel=1e-9)
    assert together[0] != together[1]


# --------------------------------------------------------------------------- the choice


def test_the_lowest_drafted_ppl_ships_only_when_the_held_out_prompts_agree() -> None:
    pick = MethodSettings(eviction="heavy-hitter")
    rival = MethodSettings(eviction="heavy-hitter-window")
    other = MethodSettings(eviction="tova")
    keys = {s: recipe_key(s) for s in (pick, rival, other)}
    choosing = {keys[pick]: 2.0, keys[rival]: 1.9, keys[other]: 2.1}
    assert pick_drafted(pick, (pick, rival, other), choosing, {keys[pick]: 2.0, keys[rival]: 1.99}) == rival
    assert pick_drafted(pick, (pick, rival, other), choosing, {keys[pick]: 2.0, keys[rival]: 2.0}) == rival
    assert pick_drafted(pick, (pick, rival, other), choosing, {keys[pick]: 2.0, keys[rival]: 2.01}) == pick
    assert pick_drafted(pick, (pick, rival, other), choosing, {}) == rival  # nothing held out
    tie = {keys[pick]: 1.9, keys[rival]: 1.9, keys[other]: 2.1}
    assert pick_drafted(pick, (rival, pick, other), tie, {}) == pick  # ties keep the search's pick


def test_candidates_are_the_pick_and_its_measured_one_rule_neighbours() -> None:
    pick = MethodSettings(eviction="heavy-hitter", ratios="attention-sum", scorer="union", window=4, pool=3, truncation_distance=8)
    measured = [
        pick,
        dataclasses.replace(pick, eviction="tova"),
        dataclasses.replace(pick, eviction="fixed-point"),
        dataclasses.replace(pick, ratios="uniform"),
        dataclasses.replace(pick, eviction="tova", ratios="uniform"),  # two rules away: not a candidate
        dataclasses.replace(pick, heads="shared"),  # another rule: not a candidate
    ]
    search = RecipeSearch(chosen=pick, start=pick, trials=tuple(Trial("x", s, 2.0) for s in measured))
    found = draft_candidates(pick, search, dataclasses.replace(SPACE, distances=(8,)))
    assert [recipe_key(s) for s in found] == [recipe_key(s) for s in measured[:4]]


# --------------------------------------------------------------------------- in a calibration run


def test_a_calibration_with_the_draft_stage_records_and_ships_its_choice(tiny) -> None:
    run = calibrate(
        tiny, 0.3, data=kinds(8), samples=4, seed=1, reference_tokens=6, candidates=(8,), search=SPACE,
        draft=Draft(4, rounds=2), draft_stage=True, max_prompt_overhead=None,  # toy prompts: a draft costs many prompt forwards
    )
    chosen, info = run.recipes, run.profile.calibration
    stage = chosen.drafted
    assert stage is not None and recipe_key(stage.candidates[0]) == recipe_key(chosen.picked)
    assert len(stage.candidates) >= 2
    drafted = {recipe_key(dataclasses.replace(
        MethodSettings(), scorer=t.scorer, window=t.window or 32, pool=t.pool or 7, eviction=t.eviction,
        ratios=t.ratios, heads=t.heads, recent_share=t.recent_share, merge=t.merge,
        truncation_distance=t.truncation_distance, selection=t.selection, window_share=t.window_share or 0.5,
    )): t for t in info.recipes if t.drafted_ppl is not None}
    assert set(drafted) == {recipe_key(s) for s in stage.candidates}
    assert all(drafted[k].drafted_ppl == stage.choosing[k] for k in drafted)
    assert recipe_key(run.profile.method) == recipe_key(stage.picked) == recipe_key(
        pick_drafted(chosen.picked, stage.candidates, stage.choosing, stage.held_out)
    )
    assert run.profile.method.draft == Draft(4, rounds=2)
    assert info.ppl_compressed == chosen.search.ppl_of(stage.picked)


def test_the_draft_stage_needs_a_draft_and_a_search(tiny) -> None:
    with pytest.raises(KvtoolError, match="needs --draft above 0"):
        calibrate(tiny, 0.3, data=kinds(4), samples=4, draft=None, draft_stage=True)
    with pytest.raises(KvtoolError, match="needs the search"):
        calibrate(tiny, 0.3, data=kinds(4), samples=4, search=None, draft_stage=True)
