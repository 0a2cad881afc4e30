"""A budget in bytes: the per-layer storage and ratio allocation against a brute force, re-budgeting a
profile whose layers store other formats, the stored-entry layer loss against an independent
forward, and calibration choosing precision per layer (`--kv-formats`)."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvtool.calibration.layer_loss import measure_layer_losses, nll_per_token
from kvtool.errors import KvtoolError
from kvtool.profiles import MethodSettings, read_profile, save_profile
from kvtool.profiles.byte_budget import BYTE_STEP, RATIO_STEP, byte_share, rebudget_bytes, solve_by_bytes
from kvtool.profiles.entry_bytes import entry_bytes, entry_share
from kvtool.profiles.loss_budget import clean_curves
from kvtool.profiles.whole_cache import rebudget
from kvtool.runtime import attach
from kvtool.runtime.memory import kv_bytes, kv_bytes_full
from kvtool.runtime.precision import NATIVE, KVStorage, at_storage
from kvtool.runtime.storage import FORMATS, storage_format
from tiny_models import left_pad, profile_with, prompts, tiny_gemma3, tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from test_calibrate import sharpened_llama, word_prompts  # noqa: E402

NATIVE_PAIR, INT8, INT4 = ("native", "native"), ("int8", "int8"), ("int4", "int4")


def test_the_byte_table_is_what_every_format_stores():
    for name, fmt in FORMATS.items():
        for head_dim in (32, 64, 128):
            x = torch.randn(3, 5, head_dim)
            assert fmt.encode(x).nbytes() == entry_bytes(name, head_dim, 4) * 15
    assert entry_share("int8", "int4", 64, 4) == pytest.approx((68 + 36) / 512)


def test_allocation_is_the_least_loss_of_every_choice_within_the_bytes():
    rng = np.random.default_rng(5)
    head_dim, native, floor = 64, 4, 0.9
    for _ in range(4):
        curves = {
            NATIVE_PAIR: clean_curves(rng.gamma(1.0, 1.0, size=(3, 2))),
            INT8: clean_curves(rng.gamma(1.0, 0.5, size=(3, 3))),
        }
        points = {NATIVE_PAIR: (0.9, 0.95), INT8: (0.9, 0.95, 1.0)}
        budget = 0.5
        ratios, storages = solve_by_bytes(curves, points, head_dim, native, budget, floor=floor)
        grid = np.round(np.arange(floor, 1.0 + 1e-9, RATIO_STEP), 6)
        options = [(s, r) for s in curves for r in grid]

        def loss(i, s, r):
            return float(np.interp(r, [*points[s], 1.0][: len(points[s]) + (points[s][-1] < 1)],
                                   [*curves[s][i], 0.0][: len(points[s]) + (points[s][-1] < 1)]))

        def units(s, r):
            return int(np.ceil(r * entry_share(*s, head_dim, native) / BYTE_STEP - 1e-9))

        total = int(np.floor(budget * 3 / BYTE_STEP + 1e-9))
        best = min(
            sum(loss(i, s, r) for i, (s, r) in enumerate(combo))
            for combo in itertools.product(options, repeat=3)
            if sum(units(s, r) for s, r in combo) <= total
        )
        got = sum(loss(i, s, r) for i, (s, r) in enumerate(zip(storages, ratios)))
        assert got == pytest.approx(best, abs=1e-12)
        assert sum(units(s, r) for s, r in zip(storages, ratios)) <= total


def _mixed(model, budget=0.2):
    base = profile_with(model, [0.3, 0.5, 0.2])
    base = dataclasses.replace(base, method=dataclasses.replace(base.method, ratios="uniform"))
    layers = tuple(dataclasses.replace(layer, keys_format=k, values_format=v)
                   for layer, (k, v) in zip(base.layers, [INT8, INT4, ("int8", "int4")]))
    return dataclasses.replace(base, layers=layers, native_bytes=8, budget=budget)


def test_rebudget_keeps_each_layers_formats_and_spends_the_new_bytes():
    profile = _mixed(tiny_llama())
    for budget in (0.02, 0.05, 0.1):
        again, _ = rebudget(profile, budget)
        assert [(layer.keys_format, layer.values_format) for layer in again.layers] == [INT8, INT4, ("int8", "int4")]
        assert again.budget == budget
        assert byte_share(again) <= budget + 1e-12
        assert byte_share(again) == pytest.approx(budget, abs=1e-6)
    # float64 entries at 8 and 4 bits: everything kept costs 0.125 of the bytes, so 0.3 keeps all.
    assert rebudget_bytes(profile, 0.3)[0].ratios == [1.0, 1.0, 1.0]


def test_at_storage_goes_both_ways_and_leaves_a_native_profile_alone():
    model = tiny_llama(dtype=torch.float32)
    native = profile_with(model, 0.2)
    assert at_storage(native, None, model) is native and at_storage(native, NATIVE, model) is native
    stored = at_storage(native, KVStorage.parse("int8"), model)
    share = entry_share("int8", "int8", model.config.head_dim, 4)
    assert stored.native_bytes == 4 and stored.budget == native.budget
    assert byte_share(stored) == pytest.approx(0.2, abs=1e-6)
    assert stored.ratios[0] == pytest.approx(0.2 / share, abs=1e-6)
    back = at_storage(stored, NATIVE, model)
    assert back.native_bytes is None and back.ratios == pytest.approx([0.2] * 3)


def test_a_quantized_profile_round_trips_and_must_say_its_native_bytes(tmp_path):
    profile = _mixed(tiny_llama())
    path = tmp_path / "p.yaml"
    save_profile(profile, path)
    assert read_profile(path).layers == profile.layers and read_profile(path).native_bytes == 8
    doc = yaml.safe_load(path.read_text())
    del doc["native_bytes"]
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(KvtoolError, match="native_bytes") as raised:
        read_profile(path)
    assert "\n" not in str(raised.value)


def _round_trip_attention(layer: int, storage: tuple[str, str], prompt_len: int):
    """An attention that, in `layer`, lets the rows after the prompt read every key and value as
    `storage` stores them (the prompt's rows attend at full precision, as the runtime's prompt does)."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal=True, **kwargs)
        if module.layer_idx != layer:
            return out, None
        k_fmt, v_fmt = (storage_format(name) for name in storage)
        k, v = k_fmt.decode(k_fmt.encode(key), key.dtype), v_fmt.decode(v_fmt.encode(value), value.dtype)
        late, _ = sdpa_attention_forward(module, query, k, v, attention_mask, dropout, scaling, is_causal=True, **kwargs)
        out = out.clone()
        out[:, prompt_len:] = late[:, prompt_len:]
        return out, None

    return forward


@torch.no_grad()
def test_stored_loss_with_nothing_dropped_is_the_nll_of_reading_stored_entries():
    model = tiny_llama(dtype=torch.float64)
    seq = prompts([30], seed=4)[0]
    prompt, ref = seq[:24], seq[24:]
    batch = SimpleNamespace(**left_pad([prompt]), extras={})
    state = SimpleNamespace(batch=batch, references=SimpleNamespace(tokens=ref[None], scored=torch.ones(1, 6, dtype=torch.bool)))
    storages = [INT8, ("int8", "int4")]
    losses = measure_layer_losses(model, [state], MethodSettings(sink_tokens=2, recent_window=3), [0, 2], tokens=6, storages=storages)
    assert losses.stored_ratios[-1] == 1.0 and set(losses.stored) == set(storages)
    full = nll_per_token(model(seq[None]).logits[:, 24:], ref)
    try:
        for j, layer in enumerate([0, 2]):
            for storage in storages:
                AttentionInterface.register("byte_budget_test", _round_trip_attention(layer, storage, 24))
                model.set_attn_implementation("byte_budget_test")
                stored = nll_per_token(model(seq[None]).logits[:, 24:], ref)
                model.set_attn_implementation("sdpa")
                assert losses.stored[storage][0, j, -1] == pytest.approx(stored - full, abs=1e-9)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def calibrated():
    from kvtool.calibration.runner import calibrate

    tiny = sharpened_llama((400.0, 60.0, 1.0))
    run = calibrate(
        tiny, 0.2, data=word_prompts(6), samples=4, seed=1, reference_tokens=6, candidates=(0, 8), search=None,
        method=MethodSettings(ratios="measured"), kv_formats=("int8", "int4"), layer_storage=True, max_prompt_overhead=None,
    )
    return tiny, run.profile


def test_calibration_chooses_storage_per_layer_within_the_bytes(calibrated, tmp_path):
    tiny, profile = calibrated
    assert profile.native_bytes == 4 and profile.budget == 0.2
    assert byte_share(profile) <= 0.2 + 1e-9
    assert any(layer.keys_format != "native" for layer in profile.layers)
    save_profile(profile, tmp_path / "p.yaml")
    again = read_profile(tmp_path / "p.yaml")
    assert [(l.ratio, l.keys_format, l.values_format) for l in again.layers] == [
        (l.ratio, l.keys_format, l.values_format) for l in profile.layers]


def test_the_storage_stage_measures_the_recipe_at_each_format_and_ships_what_the_held_out_prompts_confirm(calibrated, tmp_path):
    """`calibration.storages`: the search's own profile and the recipe with every layer at int8 and at
    int4, each at the same bytes; the lowest PPL on the prompts that chose ships where the held-out
    prompts find it no worse than the search's own, and the profile holds exactly that storage."""
    from kvtool.calibration.storage import AS_SEARCHED

    tiny, profile = calibrated
    trials = profile.calibration.storages
    assert [t.storage for t in trials] == [AS_SEARCHED, "int8", "int4"]
    assert sum(bool(t.shipped) for t in trials) == 1
    best = min(trials, key=lambda t: t.ppl)
    searched = trials[0]
    shipped = next(t for t in trials if t.shipped)
    if searched.held_out_ppl is None:  # every prompt chose (no search, no held-out half): the lowest ships
        assert shipped is best and all(t.held_out_ppl is None for t in trials)
    else:
        assert shipped is (best if best.held_out_ppl <= searched.held_out_ppl else searched)
    assert profile.calibration.ppl_compressed == shipped.ppl
    if shipped.storage != AS_SEARCHED:
        formats = {(l.keys_format, l.values_format) for l in profile.layers if l.compress}
        assert formats == {(shipped.storage, shipped.storage)}
    assert byte_share(profile) <= 0.2 + 1e-9
    again = read_profile(save_profile(profile, tmp_path / "s.yaml"))
    assert again.calibration.storages == trials


@pytest.mark.parametrize(("held_out", "ships"), [((2.0, 1.9), "int8"), ((2.0, 2.1), "as searched")], ids=["confirmed", "rejected"])
def test_the_storage_stage_ships_a_format_only_where_the_held_out_prompts_confirm_it(monkeypatch, held_out, ships) -> None:
    from kvtool.calibration import storage as stage
    from kvtool.runtime import uniform_profile
    from tiny_models import tiny_llama

    model = tiny_llama(dtype=torch.float32)
    searched = uniform_profile(model, 0.2)
    # Choosing: as searched, int8, int4; held out (as searched, int8), measured int8 first.
    measured = iter([[3.0, 2.5, 2.8], list(held_out)])
    seen = []

    def fake_ppls(model, profiles, states, on_step):
        seen.append([{(l.keys_format, l.values_format) for l in p.layers if l.compress} for p in profiles])
        return next(measured)[::-1] if len(profiles) == 2 else next(measured)

    monkeypatch.setattr(stage, "recipe_ppls", fake_ppls)
    monkeypatch.setattr(stage, "reference_steps", lambda states: 1)
    storages = [KVStorage.parse("int8"), KVStorage.parse("int4")]
    choice = stage.choose_storage(model, searched, storages, 0.2, ["choosing"], ["held out"], lambda *a: None)
    assert seen[0] == [{("native", "native")}, {("int8", "int8")}, {("int4", "int4")}]
    assert seen[1] == [{("int8", "int8")}, {("native", "native")}]  # the best on the prompts that chose, against the search's own
    assert choice.shipped.storage == ships and [t.storage for t in choice.trials if t.shipped] == [ships]
    assert choice.profile is searched if ships == "as searched" else byte_share(choice.profile) == pytest.approx(0.2, abs=0.01)
    assert [t.held_out_ppl for t in choice.trials] == [held_out[0], held_out[1], None]


@torch.no_grad()
def test_the_calibrated_cache_holds_its_bytes(calibrated):
    tiny, profile = calibrated
    model, tokenizer = tiny.model, tiny.tokenizer
    text = " ".join(word_prompts(1, seed=9, low=300, high=300)[0].prompt.split())
    ids = tokenizer(text, return_tensors="pt").input_ids
    n, new, head_dim = ids.shape[1], 3, profile.model.head_dim
    handle = attach(model, profile)
    try:
        cache = handle.bare_cache()
        model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)
        heads = model.config.num_key_value_heads
        # What is held is every slot's stored row, spare slots included, and each slot's bookkeeping
        # (validity, position, score: a few bytes a slot, not per head).
        rows = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
        slots = sum(layer.keys.shape[0] * layer.keys.shape[2] for layer in cache.layers)
        assert rows < kv_bytes(cache) <= rows + 16 * slots
        kept = 0
        for layer, config in zip(cache.layers, profile.layers):
            entry = entry_bytes(config.keys_format, head_dim, 4) + entry_bytes(config.values_format, head_dim, 4)
            assert layer.keys.shape[-1] == entry_bytes(config.keys_format, head_dim, 4)
            assert int(layer.kept[0]) <= np.ceil(config.ratio * n) + new
            kept += int(layer.kept[0]) * heads * entry
        # The kept entries' bytes: the profile's share of the prompt's, plus the new tokens'.
        full_prompt = kv_bytes_full(cache) * n / (n + new - 1)
        assert kept <= byte_share(profile) * full_prompt + new * heads * 2 * head_dim * 4 * len(cache.layers)
    finally:
        handle.detach()


def test_bad_precision_requests_are_one_line_errors():
    from kvtool.calibration.runner import calibrate

    cases = [
        (tiny_llama(dtype=torch.float32), {"kv_formats": ("int8",), "candidates": ()}, "makes none"),
        (tiny_llama(dtype=torch.float32), {"kv_formats": ("int4-g32",), "method": MethodSettings(ratios="measured")}, "int4-g32"),
        (tiny_llama(dtype=torch.float32), {"kv_formats": ("int9",)}, "int9"),
        (tiny_llama(dtype=torch.float32), {"layer_storage": True}, "beside native"),
        (tiny_llama(dtype=torch.float32), {"kv_formats": ("int8",), "layer_storage": True}, "measures none"),
        (tiny_gemma3(dtype=torch.float32), {"kv_formats": ("int8",), "layer_storage": True, "budget_tokens": 64}, "sliding-window"),
    ]
    from test_calibrate import loaded

    for model, settings, words in cases:
        settings = {"candidates": (0,), **settings}
        with pytest.raises(KvtoolError, match=words) as raised:
            calibrate(loaded(model), 0.3, data=word_prompts(4), samples=3, reference_tokens=4, search=None, **settings)
        assert "\n" not in str(raised.value)


def test_a_hybrid_model_gets_the_storage_stage_under_its_whole_cache_budget():
    """Gemma 3's layout: no per-layer storage choice (its sliding layers have no measured loss), but
    the shipped recipe is measured at each format with windows and global layers re-spent at the
    whole cache's bytes; what ships stays within them."""
    from kvtool.calibration.runner import calibrate
    from kvtool.calibration.storage import AS_SEARCHED
    from kvtool.profiles import whole_cache
    from test_calibrate import loaded

    model = tiny_gemma3(dtype=torch.float32)
    run = calibrate(loaded(model), 0.5, data=word_prompts(6), samples=4, seed=1, reference_tokens=4, candidates=(0,),
                    search=None, kv_formats=("int8",), max_prompt_overhead=None, budget_tokens=64)
    trials = run.profile.calibration.storages
    assert [t.storage for t in trials] == [AS_SEARCHED, "int8"] and sum(bool(t.shipped) for t in trials) == 1
    assert whole_cache.shares(run.profile, 64)["all"] <= 0.5 + 0.01


def test_the_search_runs_at_the_entries_its_format_keeps_and_each_candidate_at_the_budgets_bytes():
    """Without a storage per layer, calibration searches where the profile will live: at the share of
    entries the first quantized format keeps at the budget's bytes (at the model's precision); the
    storage stage then measures that recipe at the model's precision and at the format, each
    re-derived to the budget's bytes, and ships one of them."""
    from kvtool.calibration.runner import calibrate
    from kvtool.calibration.storage import NATIVE_NAME, search_level
    from kvtool.runtime.precision import entries_for

    tiny = sharpened_llama((400.0, 60.0, 1.0))
    int8 = KVStorage.parse("int8")
    level = search_level(0.1, [int8], tiny.model, per_layer=False, hybrid=False)
    assert level == entries_for(0.1, int8, tiny.model) and 0.1 < level < 1.0
    # Where the search spends the bytes itself, the windows share them, nothing is quantized, or the
    # format keeps every entry: the search runs at the budget.
    assert search_level(0.1, [int8], tiny.model, per_layer=True, hybrid=False) == 0.1
    assert search_level(0.1, [int8], tiny.model, per_layer=False, hybrid=True) == 0.1
    assert search_level(0.1, [NATIVE], tiny.model, per_layer=False, hybrid=False) == 0.1
    assert search_level(0.9, [int8], tiny.model, per_layer=False, hybrid=False) == 0.9
    run = calibrate(tiny, 0.1, data=word_prompts(6), samples=4, seed=1, reference_tokens=6, candidates=(0,),
                    search=None, kv_formats=("int8",), max_prompt_overhead=None)
    trials = run.profile.calibration.storages
    assert [t.storage for t in trials] == [NATIVE_NAME, "int8"] and sum(bool(t.shipped) for t in trials) == 1
    assert run.profile.budget == 0.1 and byte_share(run.profile) == pytest.approx(0.1, abs=1e-6)
    # The allocation the search ran on is at the format's entries; the shipped storage keeps the
    # entries its bytes buy (int8: the search's own; native: the budget's).
    assert np.mean(run.allocation.ratios) == pytest.approx(level, abs=0.01)
    shipped = next(t for t in trials if t.shipped)
    kept = [layer.ratio for layer in run.profile.layers if layer.compress]
    assert np.mean(kept) == pytest.approx(level if shipped.storage == "int8" else 0.1, abs=0.01)
