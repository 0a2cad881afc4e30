"""Calibration pipeline on tiny random models: profile contents, determinism, bad inputs, re-budgeting."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_word_tokenizer
from kvtool.calibration.config import DEFAULT_CANDIDATES, CalibrateConfig
from kvtool.calibration.runner import calibrate, check_writable
from kvtool.data import Record, dataset_hash, load_jsonl, select_by_kind, select_samples, split_by_kind
from kvtool.errors import KvtoolError
from kvtool.models import LoadedModel, prepare_tokenizer
from kvtool.profiles import MethodSettings, profile_to_dict, read_profile, save_profile
from kvtool.runtime import attach, load_profile, uniform_profile
from kvtool.models.forward import with_cache
from tiny_models import tiny_gemma3, tiny_llama

WORDS = (
    "the cat dog sat on mat and it ran away to house big small red blue green one two three four "
    "five yes no good bad day night sun moon tree river who what why how is are I you we they"
).split()

# Small runs: the pipeline is the same at any length, and the tests share a 2-core machine.
# The papers' recipe with D and the merge mode tuned (search=None): these tests pin that tuning;
# the recipe search has its own below and in test_recipes.py.
FAST = {"reference_tokens": 6, "candidates": (0, 8, 25), "search": None}


def word_prompts(count: int, seed: int = 0, low: int = 30, high: int = 60) -> list[Record]:
    rng = random.Random(seed)
    return [
        Record(prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))), where=f"test {i + 1}")
        for i in range(count)
    ]


def loaded(model: torch.nn.Module, name: str = "tiny") -> LoadedModel:
    return LoadedModel(model=model, tokenizer=prepare_tokenizer(make_word_tokenizer()), name=name, source="test")


def sharpened_llama(scales: tuple[float, ...]) -> LoadedModel:
    """Layer l's queries scaled by scales[l]: larger scales concentrate its attention (higher Gini)."""
    model = tiny_llama(dtype=torch.float32, layers=len(scales), seed=3)
    with torch.no_grad():
        for layer, scale in zip(model.model.layers, scales):
            layer.self_attn.q_proj.weight.mul_(scale)
    return loaded(model)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    # Random init gives near-uniform attention; only a large query scale sharpens it noticeably.
    return sharpened_llama((400.0, 60.0, 1.0))


@pytest.fixture(scope="module")
def result(tiny: LoadedModel):
    return calibrate(tiny, 0.3, data=word_prompts(6), samples=4, seed=1, **FAST)


def compressed_ratios(profile) -> np.ndarray:
    return np.array([layer.ratio for layer in profile.layers if layer.compress])


def without_run_facts(profile) -> dict:
    doc = profile_to_dict(profile)
    doc.pop("created")
    doc["calibration"].pop("seconds")
    doc["calibration"].pop("prompt_overhead")  # a measured time ratio
    return doc


# --------------------------------------------------------------------------- the profile


def test_same_inputs_and_seed_give_the_same_profile(tiny: LoadedModel, result) -> None:
    # No prompt-overhead limit: the draft it keeps depends on a measured time ratio, not on the inputs.
    first, again = (calibrate(tiny, 0.3, data=word_prompts(6), samples=4, seed=1, max_prompt_overhead=None, **FAST)
                    for _ in range(2))
    assert without_run_facts(again.profile) == without_run_facts(first.profile)
    # Seed 3 draws samples 2, 4, 5, 6 where seed 1 drew 1, 2, 5, 6.
    other_seed = calibrate(tiny, 0.3, data=word_prompts(6), samples=4, seed=3, **FAST)
    assert other_seed.profile.calibration.dataset_hash != result.profile.calibration.dataset_hash
    assert [r.where for r in other_seed.samples] != [r.where for r in result.samples]


def test_a_config_runs_as_its_keywords_do(tiny: LoadedModel, result) -> None:
    # No prompt-overhead limit, as above: on a loaded machine the measured time ratio can change the draft.
    config = CalibrateConfig(samples=4, seed=1, max_prompt_overhead=None, **FAST)
    again = calibrate(tiny, 0.3, data=word_prompts(6), config=config)
    keywords = calibrate(tiny, 0.3, data=word_prompts(6), samples=4, seed=1, max_prompt_overhead=None, **FAST)
    assert without_run_facts(again.profile) == without_run_facts(keywords.profile)
    # Keywords override the config's fields; names that are no field are refused before any work.
    other = calibrate(tiny, 0.3, data=word_prompts(6), config=config, seed=3, candidates=())
    assert [r.where for r in other.samples] != [r.where for r in result.samples] and other.truncation is None
    for removed in ({"curve_importance": "sum"}, {"uniform_ratios": True}):
        with pytest.raises(TypeError):
            calibrate("no-such-model", 0.3, **removed)


@pytest.mark.parametrize("budget", [0.1, 0.3, 0.55, 0.9])
def test_ratios_meet_the_budget_exactly(tiny: LoadedModel, budget: float) -> None:
    profile = calibrate(tiny, budget, data=word_prompts(4), samples=3, candidates=()).profile
    ratios = compressed_ratios(profile)
    assert ratios.mean() == pytest.approx(budget, abs=1e-12)
    assert profile.budget == budget
    assert np.all((ratios > 0) & (ratios <= 1))


def test_layers_with_higher_gini_get_smaller_ratios(result) -> None:
    gini = np.array([layer.gini for layer in result.profile.layers])
    ratios = compressed_ratios(result.profile)
    assert len(set(np.round(gini, 3))) == len(gini), "the sharpened layers should differ in concentration"
    assert list(np.argsort(gini)) == list(np.argsort(-ratios))
    assert gini[0] > gini[2] and ratios[0] < ratios[2]


def test_profile_records_curves_spread_and_calibration(result) -> None:
    profile = result.profile
    info = profile.calibration
    assert info.samples == 4 and info.seed == 1 and info.dataset_hash.startswith("sha256:")
    assert 0 < info.retention_p <= 1 and info.retention_p == pytest.approx(result.allocation.p)
    assert info.prompt_tokens.min <= info.prompt_tokens.mean <= info.prompt_tokens.max
    for layer in profile.layers:
        curve = np.array(layer.priority_curve)
        assert curve[0] == 0 and curve[-1] == 1 and np.all(np.diff(curve) >= 0)
        assert layer.ratio_std is not None and layer.ratio_std >= 0
    assert result.per_sample_ratios.shape == (4, 3)
    assert np.allclose(result.per_sample_ratios.mean(axis=1), 0.3)
    assert np.allclose(result.per_sample_ratios.std(axis=0), [layer.ratio_std for layer in profile.layers])


def test_truncation_table_has_every_candidate(tiny: LoadedModel, result) -> None:
    info = result.profile.calibration
    assert set(info.truncation_ppl) == set(FAST["candidates"])
    assert result.profile.method.truncation_distance == result.truncation.best
    assert info.ppl_compressed == min(info.truncation_ppl.values())
    assert info.ppl_full > 0 and all(ppl > 0 for ppl in info.truncation_ppl.values())
    default = calibrate(tiny, 0.3, data=word_prompts(4), samples=3, reference_tokens=4, search=None)
    assert set(default.profile.calibration.truncation_ppl) == set(DEFAULT_CANDIDATES)


def test_budget_one_keeps_everything(tiny: LoadedModel) -> None:
    full = calibrate(tiny, 1.0, data=word_prompts(4), samples=3, **FAST)
    assert all(layer.ratio == 1.0 for layer in full.profile.layers)
    # Nothing is ever evicted, so every D scores the full cache's own references exactly.
    info = full.profile.calibration
    assert all(ppl == pytest.approx(info.ppl_full, rel=1e-9) for ppl in info.truncation_ppl.values())
    assert full.profile.method.truncation_distance == 25  # ties go to the default D


def test_answers_are_the_references_when_given(tiny: LoadedModel) -> None:
    records = [dataclasses.replace(r, answer="the cat sat on the mat") for r in word_prompts(3)]
    run = calibrate(tiny, 0.3, data=records, samples=3, reference_tokens=10, candidates=(0,), search=None)
    # "the cat sat on the mat" is 6 words, scored in full (no EOS is appended), in every sample.
    assert run.truncation.tokens == 3 * 6
    shorter = calibrate(tiny, 0.3, data=records, samples=3, reference_tokens=4, candidates=(0,), search=None)
    assert shorter.truncation.tokens == 3 * 4


def test_written_profile_loads_and_attaches(tiny: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "nested" / "tiny.yaml"
    run = calibrate(tiny, 0.3, data=word_prompts(4), samples=3, out=out, **FAST)
    assert run.path == out
    profile = read_profile(out)
    assert profile.ratios == run.profile.ratios and profile.method == run.profile.method
    assert profile.calibration == run.profile.calibration
    handle = attach(tiny.model, profile)
    try:
        ids = torch.tensor([[1, 5, 9, 12, 7, 8, 30, 31, 32, 33, 34, 35, 36, 37, 38, 40, 41, 42]])
        sequences = handle.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert sequences.shape == (1, ids.shape[1] + 5)
    finally:
        handle.detach()
    assert [p.name for p in out.parent.iterdir()] == ["tiny.yaml"]  # no temp file left behind


def test_hybrid_budget_is_the_whole_cache_at_its_reference_length() -> None:
    from kvtool.profiles import whole_cache

    gemma = loaded(tiny_gemma3(dtype=torch.float32))
    # No prompt-overhead limit: which draft fits one depends on measured times (the machine's load).
    profile = calibrate(gemma, 0.25, data=word_prompts(4), samples=3, max_prompt_overhead=None, **FAST).profile
    kinds = profile.model.layer_types
    for kind, layer in zip(kinds, profile.layers):
        if kind == "sliding_attention":  # its own 7 entries are already the smallest window
            assert layer.ratio == 1.0 and not layer.compress and not layer.priority_curve and layer.window is None
        else:
            assert layer.compress and layer.priority_curve
    assert profile.budget_tokens == 4096
    assert whole_cache.shares(profile)["all"] == pytest.approx(0.25, abs=1e-3)
    # A hybrid model gets the default draft, as any other model does.
    assert profile.method.draft == CalibrateConfig().draft


def test_hybrid_calibration_chooses_the_sliding_windows_by_measured_loss() -> None:
    import dataclasses as dc

    from kvtool.profiles import whole_cache
    from transformers import Gemma3ForCausalLM

    model = tiny_gemma3(dtype=torch.float32)
    config = dc.replace(model.config) if dc.is_dataclass(model.config) else model.config.__class__(**model.config.to_dict())
    config.sliding_window = 40
    torch.manual_seed(0)
    wide = Gemma3ForCausalLM(config).to(torch.float32).eval()
    wide.set_attn_implementation("sdpa")
    run = calibrate(
        loaded(wide), 0.3, data=word_prompts(6), samples=4, budget_tokens=160, long_prompt_tokens=120,
        reference_tokens=6, candidates=(0,), draft=None,
    )
    profile = run.profile
    assert set(run.windows.ppl) == {39, 19, 9}  # its own 39 entries, half, and the smallest rung (a quarter)
    assert {t.heads for t in profile.calibration.recipes} == {"shared"}  # one KV head: per-head is the same
    assert profile.calibration.window_ppl == run.windows.ppl
    best = min(run.windows.ppl, key=run.windows.ppl.get)
    sliding = [layer for kind, layer in zip(profile.model.layer_types, profile.layers) if kind == "sliding_attention"]
    assert all(layer.window == (None if best == 39 else best) for layer in sliding)
    assert profile.budget_tokens == 160
    assert whole_cache.shares(profile)["all"] == pytest.approx(0.3, abs=0.01)
    assert profile.calibration.prompt_tokens.min > 40  # the long prompts pass the window
    with pytest.raises(KvtoolError) as err:  # refused before any model work
        calibrate(loaded(wide), 0.01, data=word_prompts(6), samples=4, budget_tokens=160, reference_tokens=6)
    assert "floor" in str(err.value) and "\n" not in str(err.value)


def test_the_default_draft_reaches_a_full_attention_profile(tiny: LoadedModel) -> None:
    from kvtool.calibration.config import DEFAULT_DRAFT
    from kvtool.profiles import Draft

    assert DEFAULT_DRAFT.tokens > 0 and DEFAULT_DRAFT.rounds >= 1
    # No limit: on these 3-row toy prompts a draft costs many times their prompt forward.
    method = calibrate(tiny, 0.3, data=word_prompts(3), samples=3, candidates=(), max_prompt_overhead=None).profile.method
    assert method.draft == DEFAULT_DRAFT
    method = calibrate(tiny, 0.3, data=word_prompts(3), samples=3, candidates=(), draft=None).profile.method
    assert method.draft is None  # no draft, nothing written
    with pytest.raises(KvtoolError, match="draft rounds must be an integer >= 1"):
        calibrate(tiny, 0.3, data=word_prompts(3), samples=3, candidates=(), draft=Draft(4, rounds=0))


def test_long_prompts_are_cut_to_max_prompt_tokens(tiny: LoadedModel) -> None:
    records = word_prompts(3, low=200, high=260)
    run = calibrate(tiny, 0.3, data=records, samples=3, max_prompt_tokens=64, candidates=())
    assert run.profile.calibration.prompt_tokens.max <= 64


# --------------------------------------------------------------------------- data files (their own tests: test_data.py)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- bad inputs leave no file


@pytest.fixture()
def out_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "out"
    directory.mkdir()
    return directory


def fails_without_file(out_dir: Path, message: str, model, budget: float, **options) -> None:
    with pytest.raises(KvtoolError) as caught:
        calibrate(model, budget, out=out_dir / "p.yaml", **options)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("budget", [0.0, -0.2, 1.5, math.nan])
def test_bad_budget(out_dir: Path, budget: float) -> None:
    # Checked before the model is even looked at: a bogus spec is never loaded.
    fails_without_file(out_dir, "budget must be a kept fraction in (0, 1]", "no-such-model", budget)


def test_empty_and_malformed_data(out_dir: Path, tmp_path: Path, tiny: LoadedModel) -> None:
    empty = write_lines(tmp_path / "empty.jsonl", [])
    fails_without_file(out_dir, "no prompts", tiny, 0.3, data=empty)
    broken = write_lines(tmp_path / "broken.jsonl", ['{"prompt": "a b c"}', "{oops"])
    fails_without_file(out_dir, "broken.jsonl line 2: not valid JSON", tiny, 0.3, data=broken, samples=1)


def test_prompts_shorter_than_the_protected_tokens(out_dir: Path, tiny: LoadedModel) -> None:
    records = [*word_prompts(2), Record(prompt="hi", where="short.jsonl line 3")]
    fails_without_file(out_dir, "sample 3 (short.jsonl line 3) is", tiny, 0.3, data=records, samples=3, search=None)
    # With the search the prompts are split into two halves first; the message still names the line.
    fails_without_file(out_dir, "(short.jsonl line 3) is", tiny, 0.3, data=records, samples=3)


def test_unwritable_out_fails_before_the_model_runs(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for target in (blocker / "p.yaml", tmp_path):
        with pytest.raises(KvtoolError, match="cannot write profile to"):
            # The model spec is bogus: reaching it would be a different error.
            calibrate("no-such-model", 0.3, out=target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert check_writable(tmp_path / "new" / "dir" / "p.yaml") == tmp_path / "new" / "dir" / "p.yaml"
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- re-budgeting a profile


def test_load_profile_rederives_ratios_for_another_budget(
    result, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = save_profile(result.profile, tmp_path / "p.yaml")
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        same = load_profile(path)
        assert not caplog.records
        other = load_profile(path, budget=0.6)
    assert other.budget == 0.6
    assert compressed_ratios(other).mean() == pytest.approx(0.6, abs=1e-12)
    assert np.all(compressed_ratios(other) > compressed_ratios(same))
    # The layer order by concentration survives the new budget.
    assert list(np.argsort(compressed_ratios(other))) == list(np.argsort(compressed_ratios(same)))
    assert other.calibration.retention_p > same.calibration.retention_p
    assert other.calibration.truncation_ppl == {} and other.calibration.ppl_compressed is None
    assert len(caplog.records) == 1 and "re-derived" in caplog.records[0].getMessage()
    # At its own budget the stored curves give the stored ratios back (up to their 6 digits).
    back = load_profile(path, budget=0.6)
    assert np.allclose(compressed_ratios(back), compressed_ratios(other))
    from kvtool.profiles.whole_cache import rebudget

    again, _ = rebudget(same, 0.3)
    assert np.allclose(compressed_ratios(again), compressed_ratios(same), atol=1e-5)


def test_load_profile_without_curves_cannot_be_rebudgeted(tiny: LoadedModel, tmp_path: Path) -> None:
    path = save_profile(uniform_profile(tiny.model, 0.3), tmp_path / "uniform.yaml")
    assert load_profile(path, budget=0.3).budget == 0.3
    with pytest.raises(KvtoolError, match="has no priority curve"):
        load_profile(path, budget=0.5)
    with pytest.raises(KvtoolError, match=r"budget must be a kept fraction in \(0, 1\]"):
        load_profile(save_profile(tiny_profile_with_curves(tiny), tmp_path / "c.yaml"), budget=1.2)


def tiny_profile_with_curves(tiny: LoadedModel):
    base = uniform_profile(tiny.model, 0.3)
    curve = tuple(float(v) for v in np.linspace(0, 1, 11) ** 0.5)
    return dataclasses.replace(base, layers=tuple(dataclasses.replace(l, priority_curve=curve) for l in base.layers))


# --------------------------------------------------------------------------- replaying the prompt


# The scorers the recipe search reaches, each with the generation rule that reads its seed: the
# recording's own window (32), and TOVA's one row, which the recorded rows must serve (the search
# once ranked TOVA's seed by the recording's 32-row sums and measured Gemma 3's TOVA 6x worse).
REPLAYED_RECIPES = (
    {},
    {"scorer": "window", "window": 32, "pool": 7, "heads": "per-head"},
    {"scorer": "window", "window": 1, "pool": 1, "eviction": "tova"},
    {"scorer": "union", "window": 8, "pool": 3, "eviction": "tova"},
)


@pytest.mark.parametrize("recipe", REPLAYED_RECIPES, ids=["attention-sum", "window-32", "tova", "union-8"])
def test_recorded_prompt_compresses_like_a_compressed_prompt_forward(recipe) -> None:
    """The truncation search builds its compressed caches from the full pass's recorded state; they
    must match what a prompt forward through the calibrated cache stores, and decode the same,
    whatever observation window the recipe's scorer reads."""
    from kvtool.scoring import left_pad
    from kvtool.calibration.truncation import compress_recorded_prompt
    from tiny_models import profile_with

    for model in (tiny_llama(layers=3, seed=4), tiny_gemma3(seed=4)):
        gen = torch.Generator().manual_seed(0)
        sequences = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (40, 29, 35)]
        batch = left_pad(sequences, (0, 1, 2), pad_id=0)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
        profile = profile_with(model, [0.3, 0.5, 0.2, 0.4][: model.config.num_hidden_layers], truncation_distance=8, **recipe)
        with torch.inference_mode():
            full_handle = attach(model, uniform_profile(model, 1.0))  # records the default window, 32
            full = full_handle.new_cache(record_importance=True)
            model(**inputs, **with_cache(model, full), use_cache=True)
            full_handle.detach()
            handle = attach(model, profile)
            real = handle.new_cache()
            model(**inputs, **with_cache(model, real), use_cache=True)
            replayed = compress_recorded_prompt(handle.new_cache(), full, batch.attention_mask)
            for index, layer in real.compressing_layers().items():
                other = replayed.layers[index]
                assert torch.equal(layer.valid, other.valid) and torch.equal(layer.order, other.order)
                assert torch.equal(layer.frozen, other.frozen) and np.array_equal(layer.kept, other.kept)
                assert torch.allclose(layer.keys, other.keys) and torch.allclose(layer.values, other.values)
            assert_decodes_alike(model, batch, real, replayed, steps=12)  # past the first evictions
            handle.detach()


def assert_decodes_alike(model, batch, real, replayed, steps: int) -> None:
    """`steps` greedy decode steps (from fixed first tokens) give the same logits through both caches."""
    mask, position = batch.attention_mask, batch.next_positions
    token = torch.tensor([[5], [6], [7]])
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
        step = {"input_ids": token, "attention_mask": mask, "position_ids": position, "use_cache": True}
        a = model(**step, **with_cache(model, real)).logits[:, -1]
        b = model(**step, **with_cache(model, replayed)).logits[:, -1]
        assert torch.allclose(a, b, atol=1e-9)
        token, position = a.argmax(dim=-1, keepdim=True), position + 1


@pytest.mark.parametrize("window,sinks,scored", [(7, 0, None), (5, 0, None), (4, 1, None), (3, 2, None), (5, 0, (2, 1)), (4, 1, (1, 3))])
def test_recorded_prompt_cuts_any_sliding_window_as_its_prompt_forward(window, sinks, scored, monkeypatch) -> None:
    """The window stage builds every rung's cache from the full pass's record: the sliding layers'
    kept entries (sinks included, which transformers' own layer no longer holds) and every decode
    step must match a prompt forward through that rung's cache (tiny Gemma 3's own window: 7 entries).
    `scored`: the windows keep their top-scored entries, ranked by that many last rows and pool width
    (the record's rows under the model's sliding mask must rank as the prompt forward's own scores)."""
    import importlib
    attach_module = importlib.import_module("kvtool.runtime.attach")
    from kvtool.calibration.truncation import compress_recorded_prompt
    from kvtool.runtime.layer.recorded_window import RecordedWindowLayer
    from kvtool.scoring import left_pad
    from tiny_models import profile_with

    model = tiny_gemma3(seed=6)
    gen = torch.Generator().manual_seed(2)
    batch = left_pad([torch.randint(3, 90, (n,), generator=gen).tolist() for n in (30, 19, 25)], (0, 1, 2), pad_id=0)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
    base = profile_with(model, [1.0, 0.4, 1.0, 0.3])
    profile = dataclasses.replace(base, layers=tuple(
        dataclasses.replace(layer, window=window, sinks=sinks, compress=False, ratio=1.0, scored=scored is not None)
        if kind == "sliding_attention" else layer
        for kind, layer in zip(base.model.layer_types, base.layers)
    ))
    if scored is not None:
        monkeypatch.setattr(attach_module, "SCORED_WINDOW_ROWS", scored[0])
        monkeypatch.setattr(attach_module, "SCORED_WINDOW_POOL", scored[1])
    with torch.inference_mode():
        recording = attach(model, uniform_profile(model, 1.0))
        full = recording.new_cache(record_importance=True)
        model(**inputs, **with_cache(model, full), use_cache=True)
        recording.detach()
        assert all(isinstance(full.layers[i], RecordedWindowLayer) for i in (0, 2))
        handle = attach(model, profile)
        real = handle.new_cache()
        model(**inputs, **with_cache(model, real), use_cache=True)
        replayed = compress_recorded_prompt(handle.new_cache(), full, batch.attention_mask)
        for index in range(4):
            a, b = real.layers[index], replayed.layers[index]
            if index % 2 == 0 and (window, sinks) == (7, 0):
                continue  # the model's own window: transformers' layer stands in, entry for entry (decoding below)
            assert type(a) is type(b)
            if hasattr(a, "valid"):
                assert torch.equal(a.valid, b.valid) and torch.equal(a.order, b.order)
                assert torch.allclose(a.keys, b.keys) and torch.allclose(a.values, b.values)
        assert_decodes_alike(model, batch, real, replayed, steps=10)  # past the windows' first evictions
        handle.detach()


def test_recipes_side_by_side_decode_exactly_as_each_alone() -> None:
    """The recipe search runs a stage's recipes as blocks of one batch (runtime.grouped): every
    block must decode, evict and score as its cache would alone, sliding-window layers included."""
    from kvtool.calibration.passes import PromptState, recipe_ppls
    from kvtool.calibration.truncation import compress_recorded_prompt
    from kvtool.runtime.grouped import GroupedCache
    from kvtool.scoring import References, left_pad
    from tiny_models import profile_with

    for model in (tiny_llama(layers=3, seed=5), tiny_gemma3(seed=5)):
        layers = model.config.num_hidden_layers
        gen = torch.Generator().manual_seed(1)
        sequences = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (40, 29, 35)]
        batch = left_pad(sequences, (0, 1, 2), pad_id=0)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
        ratios = [0.3, 0.5, 0.2, 0.4][:layers]
        profiles = [
            profile_with(model, ratios, truncation_distance=8, merge="position"),
            profile_with(model, ratios, eviction="tova", scorer="window", window=4, pool=3, heads="per-head"),
            profile_with(model, 0.25, eviction="heavy-hitter", selection="heavy-hitter"),
        ]
        with torch.inference_mode():
            full_handle = attach(model, uniform_profile(model, 1.0))
            full = full_handle.new_cache(record_importance=True)
            first = model(**inputs, **with_cache(model, full), use_cache=True).logits[:, -1]
            full_handle.detach()
            handle = attach(model, profiles[0])
            alone = [compress_recorded_prompt(handle.cache_for(p), full, batch.attention_mask) for p in profiles]
            parts = [compress_recorded_prompt(handle.cache_for(p), full, batch.attention_mask) for p in profiles]
            grouped = GroupedCache(parts, rows=3)
            # Merged: the first recipe twice, in blocks that are not adjacent (rows 0-2 and 9-11), share
            # one layer with a share per row; the other rules (per-head tova, heavy-hitter) stay alone.
            # A fourth recipe with the first one's rule but other ratios joins that layer too.
            other_ratios = profile_with(model, [0.45, 0.25, 0.35, 0.3][:layers], truncation_distance=8, merge="position")
            alone_other = compress_recorded_prompt(handle.cache_for(other_ratios), full, batch.attention_mask)
            merged_parts = [
                compress_recorded_prompt(handle.cache_for(p), full, batch.attention_mask) for p in profiles + [other_ratios]
            ]
            merged = GroupedCache(merged_parts, rows=3, merge=True)
            units = merged.layers[next(iter(merged_parts[0].compressing_layers()))].units()
            assert [type(u.plan).__name__ for u, _ in units] == ["RowShares", "LayerPlan", "LayerPlan"]
            plain = [layer for layer in merged.layers if not layer.compressing]
            assert all(len(layer.units()) == 1 for layer in plain)  # sliding layers: one stacked layer
            assert plain or model.config.model_type == "llama"
            assert units[0][1].tolist() == [0, 1, 2, 9, 10, 11]
            mask, position = batch.attention_mask, batch.next_positions
            tokens = torch.randint(3, 90, (3, 14), generator=gen)
            for t in range(14):  # past the first evictions
                mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
                step = {"input_ids": tokens[:, t : t + 1], "position_ids": position, "use_cache": True}
                together = model(
                    **{**step, "input_ids": tokens[:, t : t + 1].repeat(3, 1), "position_ids": position.repeat(3, 1)},
                    attention_mask=mask.repeat(3, 1), **with_cache(model, grouped),
                ).logits[:, -1]
                side_by_side = model(
                    **{**step, "input_ids": tokens[:, t : t + 1].repeat(4, 1), "position_ids": position.repeat(4, 1)},
                    attention_mask=mask.repeat(4, 1), **with_cache(model, merged),
                ).logits[:, -1]
                for i, cache in enumerate(alone):
                    logits = model(**step, attention_mask=mask, **with_cache(model, cache)).logits[:, -1]
                    assert torch.allclose(together[3 * i : 3 * i + 3], logits, atol=1e-10)
                    assert torch.allclose(side_by_side[3 * i : 3 * i + 3], logits, atol=1e-10)
                logits = model(**step, attention_mask=mask, **with_cache(model, alone_other)).logits[:, -1]
                assert torch.allclose(side_by_side[9:], logits, atol=1e-10)
                position = position + 1
            for cache, part in zip(alone, parts):
                for index, layer in cache.compressing_layers().items():
                    other = part.layers[index]
                    assert torch.equal(layer.valid, other.valid) and torch.equal(layer.order, other.order)
            handle.detach()
            # The search's measure: side by side equals one at a time.
            scored = torch.ones(3, 10, dtype=torch.bool)
            scored[1, 6:] = False
            references = References(tokens=tokens[:, :10], scored=scored, nll_full=torch.zeros(3, 10, dtype=torch.float64))
            state = PromptState(batch, first, full, references)
            together = recipe_ppls(model, profiles, [state])
            assert together == pytest.approx([recipe_ppls(model, [p], [state])[0] for p in profiles], rel=1e-12)
            assert len(set(together)) == 3


# --------------------------------------------------------------------------- shipped profiles


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.5])
def test_the_builtin_profiles_draw_is_drawn_again(budget: float) -> None:
    """benchmarks/prompt_overhead.py measures a built-in profile again on the prompts its
    calibration drew: `draw` with the profile's sample count and seed gives the same prompts."""
    from kvtool.calibration.runner import draw
    from kvtool.data import dataset_hash, load_jsonl
    from kvtool.profiles.builtin import builtin_profile

    info = read_profile(builtin_profile("smollm2", budget)).calibration
    chosen, choosing, confirming = draw(load_jsonl(None), CalibrateConfig(samples=info.samples, seed=info.seed))
    assert dataset_hash(chosen) == info.dataset_hash
    assert len(choosing) == info.chosen_on and len(confirming) == info.confirmed_on


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.5])
def test_builtin_smollm2_profiles_are_calibrated_and_rebudgetable(budget: float) -> None:
    from kvtool.calibration.storage import AS_SEARCHED
    from kvtool.profiles.builtin import builtin_profile
    from kvtool.profiles.byte_budget import byte_share
    from kvtool.runtime.precision import KVStorage

    path = builtin_profile("smollm2", budget)
    assert path is not None, "run scripts/build_builtin_profiles.sh"
    profile = read_profile(path)
    info = profile.calibration
    assert profile.budget == budget and profile.model.name == "smollm2"
    # The budget is bytes: the mean kept ratio at the model's own precision, more entries at int8.
    assert byte_share(profile) == pytest.approx(budget, abs=1e-6)
    shipped = next((t for t in info.storages or () if t.shipped), None)
    if shipped is not None and shipped.storage != AS_SEARCHED:
        # The storage stage shipped the searched recipe at one storage in every layer, at the same bytes.
        assert {(layer.keys_format, layer.values_format) for layer in profile.layers} == {(KVStorage.parse(shipped.storage).keys, KVStorage.parse(shipped.storage).values)}
        # ... confirmed by the held-out prompts against the first trial: the search's own profile, or
        # (searched at a format's entries) its recipe at the model's precision, at the same bytes.
        assert shipped.held_out_ppl <= info.storages[0].held_out_ppl
    else:
        assert compressed_ratios(profile).mean() == pytest.approx(budget, abs=1e-9)
    # scripts/build_builtin_profiles.sh calibrates on 20 prompts (the command's default is 12).
    assert info.samples == 20 and info.seed == 0
    # The recipe search ran: the prompts split by kind (20 over six kinds: 12 choose, 8 confirm); the
    # profile's recipe is the lowest-PPL one tried, and it beat the papers' recipe on the held-out half too.
    assert (info.chosen_on, info.confirmed_on) == (12, 8) and info.recipes
    best = min(info.recipes, key=lambda t: t.ppl)
    if info.fell_back:
        # The held-out half rejected the search's choice: the profile runs the finalist with the
        # lowest prompt-weighted log PPL over both halves.
        finalists = [t for t in info.recipes if t.held_out_ppl is not None]
        best = min(finalists, key=lambda t: math.log(t.ppl) + math.log(t.held_out_ppl))
    assert best.held_out_ppl < info.recipes[0].held_out_ppl  # the search's pick beat the papers' recipe held out
    drafted = [t for t in info.recipes if t.drafted_ppl is not None]
    if drafted:
        # The draft stage ran (--draft-stage): it ships its lowest drafted PPL when the held-out
        # half, drafted too, is no worse than for the search's pick; else the pick stays.
        challenger = min(drafted, key=lambda t: t.drafted_ppl)
        if challenger is not best:
            assert challenger.drafted_held_out_ppl is not None and best.drafted_held_out_ppl is not None
            if challenger.drafted_held_out_ppl <= best.drafted_held_out_ppl:
                best = challenger
    method = profile.method
    assert (best.eviction, best.selection, best.scorer, best.ratios, best.heads, best.recent_share, best.merge) == (
        method.eviction, method.selection, method.scorer, method.ratios, method.heads, method.recent_share, method.merge
    )
    if method.scorer == "window":
        assert (best.window, best.pool) == (method.window, method.pool)
    assert info.ppl_compressed == (best.ppl if shipped is None or shipped.storage == AS_SEARCHED else shipped.ppl)
    assert info.recipes[0].stage == "start" and info.recipes[0].eviction == "fixed-point"
    drawn = select_by_kind(load_jsonl(), info.samples, seed=0)
    assert info.dataset_hash == dataset_hash(sum(split_by_kind(drawn), ()))
    assert all(len(layer.priority_curve) > 2 for layer in profile.layers)
    if method.scorer != "attention-sum" and method.ratios == "scorer":
        assert all(len(layer.scorer_curve) == len(layer.priority_curve) for layer in profile.layers)
    if method.ratios == "uniform" and shipped is None:
        assert set(compressed_ratios(profile)) == {budget}
    assert byte_share(load_profile(path, budget=0.15)) == pytest.approx(0.15, abs=1e-6)


# --------------------------------------------------------------------------- curve importance and merge mode


def test_per_row_mean_removes_the_causal_bias() -> None:
    from kvtool.calibration.statistics import compressible

    n = 20
    # Every row spreads its attention evenly over the tokens it sees: column j collects sum_{r>=j} 1/(r+1).
    sums = np.array([sum(1.0 / (r + 1) for r in range(j, n)) for j in range(n)])
    valid = np.ones(n, dtype=bool)
    mean = compressible(sums, valid, 0, 0, per_row_mean=True)
    plain = compressible(sums, valid, 0, 0, per_row_mean=False)
    assert np.allclose(plain, sums)
    assert np.allclose(mean, sums / (n - np.arange(n)))
    # the plain sums look concentrated on early tokens; the means are much flatter
    from kvtool.profiles.lorenz import gini_from_importance

    assert gini_from_importance(mean) < gini_from_importance(plain)


def test_merge_mode_is_chosen_with_d_by_calibration_ppl(tiny: LoadedModel, result) -> None:
    """The default search tries position merging and pure eviction; the lower PPL wins, and each
    mode's PPL equals a search restricted to that mode alone."""
    assert set(result.merge_ppl) == {"position", "none"}
    best = min(result.merge_ppl, key=result.merge_ppl.get)
    assert result.profile.method.merge == best
    assert result.truncation.ppl_compressed == result.merge_ppl[best]
    assert result.profile.calibration.ppl_compressed == result.merge_ppl[best]
    for mode in ("position", "none"):
        alone = calibrate(tiny, 0.3, data=word_prompts(6), samples=4, seed=1, merge_modes=(mode,), **FAST)
        assert alone.profile.method.merge == mode
        assert alone.merge_ppl == {mode: pytest.approx(result.merge_ppl[mode], rel=1e-12)}


def test_unknown_merge_mode_is_refused(tiny: LoadedModel) -> None:
    with pytest.raises(KvtoolError, match="unknown merge mode 'blend'"):
        calibrate(tiny, 0.3, data=word_prompts(4), samples=3, merge_modes=("position", "blend"))


def test_ablation_script_rebuilds_the_removed_variants(tiny: LoadedModel, result, tmp_path: Path) -> None:
    """benchmarks/calibration_curves.py assembles sum curves and uniform ratios from calibration's
    steps; its mean-curve run must be calibrate()'s own."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration_curves.py"
    spec = importlib.util.spec_from_file_location("calibration_curves", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": r.prompt}) for r in word_prompts(6)])
    report = module.compare(tiny, 0.3, CalibrateConfig(samples=4, seed=1, **FAST), data=data)
    mean, plain, uniform = report["prefixkv-mean-curves"], report["prefixkv-sum-curves"], report["uniform"]
    assert mean["ppl"] == round(result.truncation.ppl_compressed, 4) and mean["best_D"] == result.truncation.best
    assert mean["merge"] == result.profile.method.merge
    assert mean["ratios"] == [round(r, 3) for r in result.profile.ratios]
    # Plain column sums look concentrated on early tokens in every layer: other ratios, same budget.
    assert plain["ratios"] != mean["ratios"] and np.mean(plain["ratios"]) == pytest.approx(0.3, abs=2e-3)
    assert uniform["ratios"] == [0.3] * 3
    assert mean["ppl_full"] == plain["ppl_full"] == uniform["ppl_full"]  # the same references


# --------------------------------------------------------------------------- the recipe search


def test_the_search_chooses_on_one_half_and_confirms_on_the_other(tiny: LoadedModel) -> None:
    from kvtool.calibration.recipes import SearchSpace, recipe_key

    records = [dataclasses.replace(r, kind=("a", "b")[i % 2]) for i, r in enumerate(word_prompts(8))]
    run = calibrate(tiny, 0.3, data=records, samples=4, seed=1, reference_tokens=6, candidates=(0, 8))
    info, chosen = run.profile.calibration, run.recipes
    assert info.chosen_on == info.confirmed_on == 2 and chosen.chosen_on == 2
    first, second = split_by_kind(select_by_kind(records, 4, 1))
    assert run.samples == first + second and {r.kind for r in first} == {r.kind for r in second} == {"a", "b"}
    # The profile's recipe is the search's choice, the lowest PPL of every recipe tried.
    assert recipe_key(run.profile.method) == recipe_key(chosen.search.chosen)
    assert info.ppl_compressed == min(t.ppl for t in info.recipes)
    assert len(info.recipes) == len({
        (t.eviction, t.selection, t.scorer, t.window, t.pool, t.ratios, t.heads,
         t.recent_share if t.selection == "importance" else None, t.merge,
         t.truncation_distance if t.eviction == "fixed-point" else None)
        for t in info.recipes
    })
    # The window scorer was tried at every pool width of the space; only its trials record one.
    assert {t.pool for t in info.recipes if t.scorer == "window"} >= set(SearchSpace().pools)
    assert all(t.pool is None for t in info.recipes if t.scorer == "attention-sum")
    # Held-out figures exist for the finalists only, the papers' start recipe among them.
    held = [t for t in info.recipes if t.held_out_ppl is not None]
    # (chosen, two runners-up, the best of each other scorer, the chosen with uniform ratios, the start)
    assert info.recipes[0].stage == "start" and info.recipes[0].held_out_ppl is not None and 2 <= len(held) <= 9
    # Same inputs, same search (the draft follows a timing of the prompt phase: `calibrate`'s docstring).
    again = calibrate(tiny, 0.3, data=records, samples=4, seed=1, reference_tokens=6, candidates=(0, 8))
    assert again.profile.calibration.recipes == info.recipes
    assert dataclasses.replace(again.profile.method, draft=None) == dataclasses.replace(run.profile.method, draft=None)


def test_window_curves_are_recorded_per_pool_width(tiny: LoadedModel) -> None:
    """Ratios from the window scorer's curves come from the pool width the recipe uses."""
    from kvtool.calibration.passes import full_pass, scorer_key
    from kvtool.scoring import encode_batches

    records = word_prompts(3)
    method = MethodSettings(scorer="window", window=4)
    batches, answers = encode_batches(tiny, records, max_tokens=512, method=method, batch_size=3)
    variants = [dataclasses.replace(method, pool=p) for p in (1, 7)]
    measured = full_pass(tiny.model, tiny.tokenizer, batches, answers, method, reference_tokens=2,
                         with_references=False, scorers=variants)
    one, seven = (measured.stats_by_scorer[scorer_key(v)] for v in variants)
    assert scorer_key(variants[0]) != scorer_key(variants[1])
    assert one.curves.shape == seven.curves.shape and not np.allclose(one.curves, seven.curves)


def test_window_curves_are_recorded_per_window(tiny: LoadedModel) -> None:
    """The recording keeps the widest window any scorer reads; each window's curves are that
    window's own, as a pass asked for it alone would give them."""
    from kvtool.calibration.passes import full_pass, scorer_key
    from kvtool.scoring import encode_batches

    records = word_prompts(3)
    method = MethodSettings(scorer="window", window=4, pool=1)
    batches, answers = encode_batches(tiny, records, max_tokens=512, method=method, batch_size=3)

    def measured(windows, recording):
        variants = [dataclasses.replace(method, window=w) for w in windows]
        run = full_pass(tiny.model, tiny.tokenizer, batches, answers, dataclasses.replace(method, window=recording),
                        reference_tokens=2, with_references=False, scorers=variants)
        return [run.stats_by_scorer[scorer_key(v)] for v in variants]

    one, four, nine = measured((1, 4, 9), recording=4)  # records 9 rows, serves 1 and 4 from them
    (alone,) = measured((1,), recording=1)  # records the one row itself
    np.testing.assert_allclose(one.curves, alone.curves, rtol=1e-6, atol=1e-9)
    assert not np.allclose(one.curves, four.curves) and not np.allclose(four.curves, nine.curves)


def test_a_searched_union_window_share_is_recorded_and_applied(tiny: LoadedModel, tmp_path: Path) -> None:
    """With window shares in the space, every union trial records its share, the union's curves are
    kept per share, and the profile written runs the share it chose."""
    from kvtool.calibration.passes import scorer_key
    from kvtool.calibration.recipes import SearchSpace
    from kvtool.runtime import load_profile
    from kvtool.runtime.attach import layer_plans

    records = [dataclasses.replace(r, kind=("a", "b")[i % 2]) for i, r in enumerate(word_prompts(8))]
    space = SearchSpace(
        evictions=("tova",), selections=("importance",), scorers=("union",), windows=(4,), pools=(3,),
        ratio_sources=("scorer",), heads=("shared",), recent_shares=(0.0,), merge_modes=("none",),
        window_shares=(0.5, 0.7, 0.85), seeds=(),
    )
    out = tmp_path / "share.yaml"
    # Started from a union recipe, so every recipe tried is a union (the start's scorer is a candidate too).
    start = MethodSettings(scorer="union", window=4, pool=3, eviction="tova", merge="none")
    run = calibrate(tiny, 0.3, data=records, samples=4, seed=1, reference_tokens=6, candidates=(0,), search=space, out=out,
                    method=start)
    unions = [t for t in run.profile.calibration.recipes if t.scorer == "union"]
    assert {t.window_share for t in unions} == {0.5, 0.7, 0.85}
    chosen = run.profile.method
    # The shipped recipe is the search's best that the held-out half confirmed, not always the lowest trial.
    assert chosen.scorer == "union" and chosen.window_share in {t.window_share for t in unions}
    assert len({scorer_key(dataclasses.replace(chosen, window_share=f)) for f in (0.5, 0.7, 0.85)}) == 3
    loaded = load_profile(out)
    assert loaded.method == chosen
    plans = [p for p in layer_plans(loaded) if p is not None]
    assert plans and all(p.window_share == chosen.window_share and p.scoring.window_share == chosen.window_share for p in plans)


def test_a_draft_over_the_prompt_overhead_limit_gives_way_to_the_next_cheaper_one(tiny: LoadedModel, monkeypatch) -> None:
    """The ladder: half the tokens down to 32, then later rounds from the last one's predictions
    (Jacobi), then one round fewer, then half the tokens down to 8, then none; the first draft within
    the limit ships, and the profile records its measured overhead and the limit (canned overheads:
    the measurement itself is a benchmark's business, not a test's)."""
    from kvtool.calibration import cost
    from kvtool.profiles import Draft

    jacobi = lambda tokens, rounds: Draft(tokens, rounds, True, jacobi=True)  # noqa: E731
    assert cost.cheaper_drafts(Draft(32, 3, True)) == [
        Draft(32, 3, True), jacobi(32, 3), jacobi(32, 2), Draft(32, 1, True), Draft(16, 1, True), Draft(8, 1, True), None
    ]
    assert cost.cheaper_drafts(Draft(64, 2, True)) == [
        Draft(64, 2, True), Draft(32, 2, True), jacobi(32, 2), Draft(32, 1, True), Draft(16, 1, True), Draft(8, 1, True), None
    ]
    assert cost.cheaper_drafts(jacobi(32, 2)) == [jacobi(32, 2), Draft(32, 1, True), Draft(16, 1, True), Draft(8, 1, True), None]
    assert cost.cheaper_drafts(Draft(128, 1, False))[:3] == [Draft(128, 1, False), Draft(64, 1, False), Draft(32, 1, False)]
    overheads = {Draft(32, 2, True): 5.0, jacobi(32, 2): 4.0, Draft(32, 1, True): 3.5, Draft(16, 1, True): 2.5,
                 Draft(8, 1, True): 1.8, None: 1.1}
    measured = []

    def canned(model, profile, prompts, repeats=cost.REPEATS, limit=None):
        measured.append(profile.method.draft)
        return overheads[profile.method.draft]

    monkeypatch.setattr(cost, "prompt_overhead", canned)
    run = lambda limit: calibrate(  # noqa: E731
        tiny, 0.3, data=word_prompts(3), samples=3, candidates=(), draft=Draft(32, 2, True), max_prompt_overhead=limit
    ).profile
    profile = run(3.0)
    assert measured == [Draft(32, 2, True), jacobi(32, 2), Draft(32, 1, True), Draft(16, 1, True)]
    assert profile.method.draft == Draft(16, 1, True)
    assert (profile.calibration.prompt_overhead, profile.calibration.max_prompt_overhead) == (2.5, 3.0)
    measured.clear()
    assert run(1.0).method.draft is None and measured[-1] is None  # nothing fits: no draft
    measured.clear()
    unlimited = run(None)
    assert unlimited.method.draft == Draft(32, 2, True) and measured == [Draft(32, 2, True)]
    assert unlimited.calibration.prompt_overhead == 5.0 and unlimited.calibration.max_prompt_overhead is None
    with pytest.raises(KvtoolError, match="max-prompt-overhead must be a number >= 1"):
        run(0.5)


def test_prompt_cost_repeats_stop_once_the_ratios_are_clear_of_the_limit() -> None:
    """Repeating a timing only matters where it could move the draft across the limit."""
    from kvtool.calibration.cost import CLEAR_OF_LIMIT, clear

    assert clear([4.0 / CLEAR_OF_LIMIT], 4.0) and clear([4.0 * CLEAR_OF_LIMIT, 9.0], 4.0)
    assert not clear([4.0 / CLEAR_OF_LIMIT + 0.01], 4.0) and not clear([1.0, 7.0], 4.0)
    assert not clear([1.0], None) and not clear([], 4.0)


def test_prompt_cost_repeats_stop_once_a_majority_settles_the_median() -> None:
    """Of three repeats, two on one side of the limit decide the median's side: the third cannot."""
    import itertools
    import statistics

    from kvtool.calibration.cost import settled

    assert settled([2.8, 2.7], 4.0, 3) and settled([4.5, 5.0], 4.0, 3) and settled([4.0, 4.0], 4.0, 3)
    assert not settled([2.8], 4.0, 3) and not settled([2.8, 4.5], 4.0, 3) and not settled([2.8, 2.7], None, 3)
    assert not settled([2.8, 2.7], 4.0, 4) and settled([2.8, 2.7, 3.9], 4.0, 4)
    # Whatever the repeats measure, stopping once settled gives the decision all of them give.
    values = (1.0, 3.9, 4.0, 4.1, 9.0)
    for repeats in (3, 4, 5):
        for measured in itertools.product(values, repeat=repeats):
            stop = next(k for k in range(1, repeats + 1) if k == repeats or settled(measured[:k], 4.0, repeats))
            assert (statistics.median(measured[:stop]) <= 4.0) == (statistics.median(measured) <= 4.0), measured


def test_the_prompt_cost_looks_at_one_row_first_and_times_the_batch_only_when_that_is_not_clearly_within(
    tiny: LoadedModel, monkeypatch
) -> None:
    """A row alone pays the draft's steps alone, so its ratio bounds its batch's from above: when it is
    clearly within the limit the batch is not timed; otherwise the batch's repeats decide as before."""
    from kvtool.calibration import cost
    from kvtool.scoring import left_pad

    seen, durations = [], []

    def forward(model, prompt, cache):  # a prompt forward costs 1 s per row
        seen.append(("full", prompt.input_ids.tolist()))
        durations.append(1.0 * prompt.input_ids.shape[0])

    def prepare(model, prompt, bare_cache, draft):  # the draft's steps cost 1.5 s whatever the rows
        seen.append(("kvtool", prompt.input_ids.tolist()))
        durations.append(1.0 * prompt.input_ids.shape[0] + 1.5)

    monkeypatch.setattr(cost, "prompt_forward", forward)
    monkeypatch.setattr(cost, "prepare", prepare)
    monkeypatch.setattr(cost, "_seconds", lambda work: (work(), durations.pop())[1])
    batch = left_pad([[5, 6, 7], [5, 6, 7, 8, 9], [4, 5, 6, 7]], (0, 1, 2), pad_id=0)
    profile = uniform_profile(tiny.model, 0.5)
    longest = [[5, 6, 7, 8, 9]]

    assert cost.prompt_overhead(tiny.model, profile, [batch], limit=4.0) == 2.5  # 2.5 x 1.5 <= 4
    assert seen == [("full", longest), ("kvtool", longest)]
    seen.clear()
    assert cost.prompt_overhead(tiny.model, profile, [batch], limit=3.0) == 1.5  # the batch: 4.5 s / 3 s
    assert [rows for _, rows in seen] == [longest, longest, batch.input_ids.tolist(), batch.input_ids.tolist()]
    seen.clear()
    assert cost.prompt_overhead(tiny.model, profile, [batch], limit=None) == 1.5
    assert len(seen) == 2 * cost.REPEATS and all(rows == batch.input_ids.tolist() for _, rows in seen)
    assert cost.first_look([batch.row_slice(slice(1, 2))]) is None  # a row alone is its own batch


def test_recorded_rows_give_the_recorded_window_and_any_shorter_one() -> None:
    """A recording keeps its last `window` query rows; from them `scores_for` gives the window sums a
    prompt pass asked for that window would give (float64: the kernels' own sums, to rounding)."""
    from kvtool.scoring import left_pad

    model = tiny_llama(layers=2, seed=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    batch = left_pad([torch.randint(3, 90, (n,), generator=gen).tolist() for n in (30, 21)], (0, 1), pad_id=0)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}

    def recorded(window: int):
        handle = attach(model, uniform_profile(model, 1.0, MethodSettings(window=window)))
        cache = handle.new_cache(record_importance=True)
        with torch.inference_mode():
            model(**inputs, **with_cache(model, cache), use_cache=True)
        handle.detach()
        return cache.compressing_layers()

    wide, one, six = recorded(8), recorded(1), recorded(6)
    for index, layer in wide.items():
        assert layer.prompt_rows.shape[2] == 8 and layer.scores_for(8) is layer.prompt_scores
        for narrow, window in ((one, 1), (six, 6)):
            torch.testing.assert_close(layer.scores_for(window).window, narrow[index].prompt_scores.window, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(layer.scores_for(window=8).importance, layer.prompt_importance)
    with pytest.raises(KvtoolError, match="cannot serve an observation window of 9"):
        next(iter(wide.values())).scores_for(9)


def test_long_answer_prompts_get_long_references_in_batches_of_their_own(tiny: LoadedModel) -> None:
    """Rows of kind long-answer are batched apart in the confirming half and scored there on
    `long_reference_tokens`; the choosing half scores them with the others. The last batch stays the
    confirming half's other prompts (where the prompt phase is timed)."""
    from kvtool.calibration.passes import full_pass
    from kvtool.calibration.runner import encode_halves

    answer = " ".join(WORDS[:10])  # forced references: each runs its batch's whole length
    records = [
        dataclasses.replace(r, kind="long-answer" if i % 3 == 0 else "doc", answer=answer) for i, r in enumerate(word_prompts(6))
    ]
    choosing, confirming = tuple(records[:3]), tuple(records[3:])
    config = CalibrateConfig(reference_tokens=3, long_reference_tokens=7, batch_size=4).checked()
    batches, answers, lengths = encode_halves(tiny, choosing, confirming, config)
    assert [sorted(b.rows) for b in batches] == [[0, 1, 2], [3], [4, 5]]  # a batch orders its rows by length
    assert lengths == [3, 7, 3]
    measured = full_pass(tiny.model, tiny.tokenizer, batches, answers, config.method, reference_tokens=lengths, with_references=True)
    assert [s.references.steps for s in measured.states] == lengths
