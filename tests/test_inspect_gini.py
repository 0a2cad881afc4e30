"""`kvtool inspect gini PROFILE`: PrefixKV's ratios from the stored Lorenz curves beside the shipped
ones, on the built-in profiles and small synthetic ones (no model is loaded)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from cli_runner import run
from kvtool.cli.inspect_gini import correlation
from kvtool.profiles import LayerProfile, MethodSettings, ModelFingerprint, Profile, read_profile, save_profile
from kvtool.profiles import whole_cache
from kvtool.profiles.allocation import kept_ratio
from kvtool.profiles.budget import floor_for, solve_ratios
from kvtool.profiles.builtin import builtin_dir
from kvtool.profiles.lorenz import grid

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
SMOLLM2_MEASURED = builtin_dir() / "smollm2-b0.1.yaml"  # ratios from measured loss, loss curves stored
SMOLLM2_PREFIXKV = builtin_dir() / "smollm2-b0.2.yaml"  # ratios from the attention-sum curves, no loss
GEMMA3 = builtin_dir() / "gemma3-270m-b0.2.yaml"  # sliding windows + full-attention layers, measured loss

TOP_KEYS = ["budget", "p", "truncation_distance", "budget_tokens", "ratios", "scorer", "prefixkv_p",
            "corr_gini_ratio", "corr_gini_prefixkv", "layers"]
LAYER_KEYS = ["layer", "ratio", "gini", "ratio_std", "loss", "kind", "source", "window", "prefixkv_ratio"]


def gini_json(monkeypatch, capsys, path: Path) -> dict:
    code, stdout, stderr = run(monkeypatch, capsys, "inspect", "gini", str(path), "--json")
    assert code == 0, stderr
    return json.loads(stdout)


def table_rows(stdout: str) -> list[list[str]]:
    """The body rows of the rich table, one list of stripped cells each."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in stdout.splitlines()
            if line.startswith("│") and line.split("│")[1].strip().isdigit()]


def column(stdout: str, name: str) -> list[str]:
    header = next(line for line in stdout.splitlines() if line.startswith("┃") and "Layer" in line)
    names = [cell.strip() for cell in header.split("┃")[1:-1]]
    return [row[names.index(name)] for row in table_rows(stdout)]


def brute_force(curves: np.ndarray, budget: float, floor: float) -> np.ndarray:
    """PrefixKV on a dense grid, written independently: R_l(p) = min{o : P_l(o) >= p}, then a plain
    bisection of p until the mean of the ratios clipped to [floor, 1] is the budget."""
    o = np.linspace(0.0, 1.0, 200_001)
    dense = np.stack([np.interp(o, grid(curves.shape[1]), curve) for curve in curves])

    def ratios(p: float) -> np.ndarray:
        return np.clip(o[np.argmax(dense >= p - 1e-15, axis=1)], floor, 1.0)

    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ratios(mid).mean() <= budget else (lo, mid)
    return ratios(hi)


def test_the_prefixkv_column_is_the_allocation_at_the_budget(monkeypatch, capsys):
    profile = read_profile(SMOLLM2_MEASURED)
    doc = gini_json(monkeypatch, capsys, SMOLLM2_MEASURED)
    theirs = np.array([layer["prefixkv_ratio"] for layer in doc["layers"]])
    curves = np.array([layer.priority_curve for layer in profile.layers])
    # At the profile's bytes and storage (one storage in every layer): the entries that buys.
    from kvtool.profiles.entry_bytes import entry_share

    first = profile.layers[0]
    entries = profile.budget / entry_share(first.keys_format, first.values_format, profile.model.head_dim, profile.native_bytes or 2)
    allocation = solve_ratios(curves, entries)
    np.testing.assert_allclose(theirs, allocation.ratios, rtol=0, atol=1e-9)
    assert doc["prefixkv_p"] == pytest.approx(allocation.p, abs=1e-12)
    # The budget is met, each layer sits where its curve reaches p (or at the floor), and an
    # independent dense-grid bisection lands on the same ratios.
    floor = floor_for(entries)
    assert theirs.mean() == pytest.approx(entries, abs=1e-9)
    at_p = np.array([max(floor, kept_ratio(curve, doc["prefixkv_p"])) for curve in curves])
    np.testing.assert_allclose(theirs, at_p, atol=1e-6)
    np.testing.assert_allclose(theirs, brute_force(curves, entries, floor), atol=2e-4)
    # R_l(p) never falls as p rises, in every layer.
    levels = np.linspace(0.0, 1.0, 401)
    per_level = np.array([[kept_ratio(curve, q) for curve in curves] for q in levels])
    assert np.all(np.diff(per_level, axis=0) >= -1e-12)
    # Ratios measured from loss differ from PrefixKV's here: the columns are not the same numbers.
    assert np.max(np.abs(theirs - np.array(profile.ratios))) > 0.05


def test_a_profile_that_ships_prefixkv_shows_the_same_ratios_twice(monkeypatch, capsys):
    profile = read_profile(SMOLLM2_PREFIXKV)
    doc = gini_json(monkeypatch, capsys, SMOLLM2_PREFIXKV)
    assert doc["ratios"] == "attention-sum" and doc["prefixkv_p"] == pytest.approx(profile.calibration.retention_p, abs=1e-6)
    np.testing.assert_allclose([layer["prefixkv_ratio"] for layer in doc["layers"]], profile.ratios, atol=1e-6)
    assert doc["corr_gini_ratio"] == pytest.approx(doc["corr_gini_prefixkv"], abs=1e-6)


def test_the_json_carries_both_ratios_per_layer(monkeypatch, capsys):
    profile = read_profile(SMOLLM2_MEASURED)
    doc = gini_json(monkeypatch, capsys, SMOLLM2_MEASURED)
    assert list(doc) == TOP_KEYS
    assert [list(layer) for layer in doc["layers"]] == [LAYER_KEYS] * len(profile.layers)
    assert doc["budget"] == profile.budget and doc["ratios"] == "measured" and doc["p"] is None
    assert doc["scorer"] == profile.method.scorer and doc["budget_tokens"] == profile.budget_tokens
    assert [layer["layer"] for layer in doc["layers"]] == list(range(len(profile.layers)))
    assert [layer["ratio"] for layer in doc["layers"]] == profile.ratios
    assert [layer["gini"] for layer in doc["layers"]] == [layer.gini for layer in profile.layers]
    assert {layer["kind"] for layer in doc["layers"]} == {"full"}
    assert {layer["source"] for layer in doc["layers"]} == {"measured"}
    assert all(layer["loss"] is not None and layer["window"] is None for layer in doc["layers"])
    ginis = [layer.gini for layer in profile.layers]
    assert doc["corr_gini_ratio"] == pytest.approx(np.corrcoef(ginis, profile.ratios)[0, 1], abs=1e-12)
    theirs = [layer["prefixkv_ratio"] for layer in doc["layers"]]
    assert doc["corr_gini_prefixkv"] == pytest.approx(np.corrcoef(ginis, theirs)[0, 1], abs=1e-12)
    assert doc["corr_gini_prefixkv"] < -0.9  # PrefixKV gives concentrated layers less


def test_the_table_shows_the_shipped_ratios_their_source_and_the_loss(monkeypatch, capsys):
    profile = read_profile(SMOLLM2_MEASURED)
    doc = gini_json(monkeypatch, capsys, SMOLLM2_MEASURED)
    code, stdout, stderr = run(monkeypatch, capsys, "inspect", "gini", str(SMOLLM2_MEASURED))
    assert code == 0, stderr
    assert column(stdout, "Shipped") == [f"{ratio:.3f}" for ratio in profile.ratios]
    assert column(stdout, "PrefixKV") == [f"{layer['prefixkv_ratio']:.3f}" for layer in doc["layers"]]
    assert column(stdout, "Gini") == [f"{layer.gini:.3f}" for layer in profile.layers]
    assert set(column(stdout, "Source")) == {"measured"} and set(column(stdout, "Kind")) == {"full"}
    assert column(stdout, "Loss") == [f"+{layer['loss']:.3f}" for layer in doc["layers"]]
    assert f"corr(Gini, shipped ratio) {doc['corr_gini_ratio']:+.2f}" in stdout
    assert f"corr(Gini, PrefixKV ratio) {doc['corr_gini_prefixkv']:+.2f}" in stdout
    assert f"PrefixKV: retention p {doc['prefixkv_p']:.4f}" in stdout and "shipped: ratios from measured loss" in stdout


def test_a_profile_without_measured_losses_shows_blanks(monkeypatch, capsys):
    doc = gini_json(monkeypatch, capsys, SMOLLM2_PREFIXKV)
    assert all(layer["loss"] is None for layer in doc["layers"])
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(SMOLLM2_PREFIXKV))
    assert code == 0 and set(column(stdout, "Loss")) == {"—"}
    assert set(column(stdout, "Source")) == {"attention-sum"} and "Loss =" not in stdout


def test_a_hybrid_profile_keeps_its_windows_and_shares_the_rest_between_full_layers(monkeypatch, capsys):
    profile = read_profile(GEMMA3)
    doc = gini_json(monkeypatch, capsys, GEMMA3)
    layers = doc["layers"]
    sliding = [i for i, kind in enumerate(profile.model.layer_types) if kind == "sliding_attention"]
    full = [i for i, layer in enumerate(profile.layers) if layer.compress]
    assert [layer["kind"] for layer in layers] == ["sliding" if i in sliding else "full" for i in range(len(layers))]
    assert all(layers[i]["window"] == profile.layers[i].window == 32 and layers[i]["source"] == "window" for i in sliding)
    assert all(layers[i]["prefixkv_ratio"] == 1.0 and layers[i]["loss"] is None for i in sliding)
    assert [layers[i]["source"] for i in full] == ["measured"] * len(full)
    # The full-attention layers share what the windows leave: PrefixKV's allocation at that mean.
    tokens = profile.budget_tokens
    share = whole_cache.global_budget(profile, profile.budget, tokens)
    curves = np.array([profile.layers[i].priority_curve for i in full])
    theirs = np.array([layers[i]["prefixkv_ratio"] for i in full])
    np.testing.assert_allclose(theirs, solve_ratios(curves, share).ratios, atol=1e-12)
    assert theirs.mean() == pytest.approx(np.mean([profile.layers[i].ratio for i in full]), abs=1e-9)
    papers = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, ratio=layers[i]["prefixkv_ratio"]) for i, layer in enumerate(profile.layers)))
    assert whole_cache.shares(papers)["all"] == pytest.approx(profile.budget, abs=1e-3)
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(GEMMA3))
    assert code == 0
    kinds, shipped, prefix = column(stdout, "Kind"), column(stdout, "Shipped"), column(stdout, "PrefixKV")
    assert [kinds[i] for i in sliding] == ["sliding"] * len(sliding)
    assert {shipped[i] for i in sliding} == {prefix[i] for i in sliding} == {"w=32"}
    assert [shipped[i] for i in full] == [f"{profile.layers[i].ratio:.3f}" for i in full]
    assert f"over the {len(full)} compressing layers" in stdout and "w=32: a sliding layer kept as a window" in stdout


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the plot extra is not installed")
@pytest.mark.parametrize("path", [SMOLLM2_MEASURED, GEMMA3], ids=["smollm2", "gemma3"])
def test_the_plot_is_written(path, tmp_path, monkeypatch, capsys):
    png = tmp_path / "gini.png"
    code, stdout, stderr = run(monkeypatch, capsys, "inspect", "gini", str(path), "--plot", str(png))
    assert code == 0, stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {png}" in stdout


def _synthetic(tmp_path: Path, curves, *, name: str = "p.yaml") -> Path:
    """A three-layer full-attention profile with uniform shipped ratios and the given curves."""
    model = ModelFingerprint(name="tiny", model_type="llama", num_layers=3, num_attention_heads=2, num_kv_heads=1,
                             head_dim=8, hidden_size=16, vocab_size=100, layer_types=("full_attention",) * 3)
    ginis = (0.6, 0.3, 0.5)
    layers = tuple(LayerProfile(ratio=0.3, gini=g, priority_curve=c) for g, c in zip(ginis, curves))
    profile = Profile(0.3, model, MethodSettings(ratios="uniform"), layers)
    return save_profile(profile, tmp_path / name)


def test_a_profile_without_curves_has_no_prefixkv_column(tmp_path, monkeypatch, capsys):
    path = _synthetic(tmp_path, [(0.0, 0.8, 0.95, 1.0), (), (0.0, 0.5, 0.8, 1.0)])
    doc = gini_json(monkeypatch, capsys, path)
    assert doc["prefixkv_p"] is None and doc["corr_gini_prefixkv"] is None
    assert all(layer["prefixkv_ratio"] is None and layer["source"] == "uniform" for layer in doc["layers"])
    assert doc["corr_gini_ratio"] is None  # the same ratio everywhere: no correlation to speak of
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(path))
    assert code == 0 and set(column(stdout, "PrefixKV")) == {"—"} and set(column(stdout, "Shipped")) == {"0.300"}
    assert "PrefixKV: no ratios (layer 1 stores no priority curve)" in stdout


def test_a_synthetic_profile_gets_prefixkv_from_its_curves(tmp_path, monkeypatch, capsys):
    curves = [(0.0, 0.8, 0.95, 1.0), (0.0, 0.4, 0.7, 1.0), (0.0, 0.5, 0.8, 1.0)]
    doc = gini_json(monkeypatch, capsys, _synthetic(tmp_path, curves))
    theirs = np.array([layer["prefixkv_ratio"] for layer in doc["layers"]])
    np.testing.assert_allclose(theirs, solve_ratios(np.array(curves), 0.3).ratios, atol=1e-12)
    assert theirs.mean() == pytest.approx(0.3, abs=1e-12) and theirs[0] < theirs[2] < theirs[1]


def test_unusable_curves_are_a_one_line_error(tmp_path, monkeypatch, capsys):
    path = _synthetic(tmp_path, [(0.0, 0.8, 0.95, 1.0), (0.0, 0.5, 1.0), (0.0, 0.5, 0.8, 1.0)])
    for args in ((), ("--json",)):
        code, stdout, stderr = run(monkeypatch, capsys, "inspect", "gini", str(path), *args)
        assert code == 2 and stdout == "" and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1
        assert "different lengths" in stderr


def test_a_file_that_is_not_a_profile_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    path = tmp_path / "notes.yaml"
    path.write_text("hello: world\n", encoding="utf-8")
    code, _, stderr = run(monkeypatch, capsys, "inspect", "gini", str(path))
    assert code == 2 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1


def test_correlation_needs_two_points_with_spread():
    assert correlation([0.5], [0.2]) is None and correlation([0.1, 0.2], [0.3, 0.3]) is None
    assert correlation([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5, abs=1e-12)
