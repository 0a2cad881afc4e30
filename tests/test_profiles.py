"""Profile format v1: YAML round trip, atomic writes, validation errors, legacy keys, fingerprints, `kvtool inspect profile`."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import kvtool.profiles.io as profile_io
from kvtool.cli import app as app_module
from kvtool.cli import inspect_cmd  # noqa: F401  (registers `inspect profile` on the app)
from kvtool.errors import KvtoolError
from kvtool.profiles import (
    SCHEMA_VERSION,
    CalibrationInfo,
    Draft,
    LayerProfile,
    MethodSettings,
    ModelFingerprint,
    Profile,
    PromptStats,
    fingerprint_of,
    profile_to_dict,
    read_profile,
    save_profile,
    validate_profile,
)

# --------------------------------------------------------------------------- fixtures


def make_profile(*, calibration: bool = True, truncation_ppl: bool = True) -> Profile:
    """Four layers, the last a sliding-window layer kvtool leaves alone."""
    model = ModelFingerprint(
        name="tiny/llama-test",
        model_type="llama",
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=128,
        vocab_size=1000,
        layer_types=("full_attention",) * 3 + ("sliding_attention",),
    )
    layers = (
        LayerProfile(ratio=0.1 + 0.2, gini=0.61, ratio_std=0.02, priority_curve=(0.0, 0.5, 0.812345, 1.0)),
        LayerProfile(ratio=0.125, gini=0.4, ratio_std=0.0, priority_curve=(0.0, 0.25, 0.75, 1.0)),
        LayerProfile(ratio=1e-05, gini=0.999, ratio_std=None, priority_curve=(0.1, 0.1, 1.0, 1.0)),
        LayerProfile(ratio=1.0, compress=False),
    )
    info = None
    if calibration:
        info = CalibrationInfo(
            dataset_hash="sha256:0123abcd",
            samples=16,
            prompt_tokens=PromptStats(min=120, mean=250.5, max=512),
            retention_p=0.9,
            truncation_ppl={5: 14.25, 25: 12.5, 50: 12.0} if truncation_ppl else {},
            ppl_full=11.75,
            ppl_compressed=12.0625,
            seed=1234,
            seconds=42.5,
        )
    return Profile(
        budget=0.2,
        model=model,
        method=MethodSettings(merge="position", sink_tokens=4, recent_window=8, truncation_distance=25),
        layers=layers,
        calibration=info,
        kvtool_version="0.1.0",
        created="2025-01-02T03:04:05+00:00",
    )


@pytest.fixture
def profile() -> Profile:
    return make_profile()


@pytest.fixture
def good_file(tmp_path: Path, profile: Profile) -> Path:
    return save_profile(profile, tmp_path / "good.yaml")


@pytest.fixture
def good_document(good_file: Path) -> dict[str, Any]:
    """The plain YAML document of a valid profile, to break one field at a time."""
    return yaml.safe_load(good_file.read_text(encoding="utf-8"))


def write_document(path: Path, document: Any) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def assert_one_line_error(exc: BaseException, *fragments: str) -> None:
    message = str(exc)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    ("calibration", "truncation_ppl"),
    [(True, True), (True, False), (False, False)],
    ids=["calibrated-with-truncation-ppl", "calibrated", "uncalibrated"],
)
def test_round_trip_is_exact(tmp_path: Path, calibration: bool, truncation_ppl: bool) -> None:
    original = make_profile(calibration=calibration, truncation_ppl=truncation_ppl)
    loaded = read_profile(save_profile(original, tmp_path / "p.yaml"))
    assert loaded == original
    assert isinstance(loaded.layers, tuple)
    assert all(isinstance(layer.priority_curve, tuple) for layer in loaded.layers)
    assert isinstance(loaded.model.layer_types, tuple)
    if truncation_ppl:
        assert loaded.calibration is not None
        assert all(type(d) is int for d in loaded.calibration.truncation_ppl)


def test_image_share_round_trips_and_is_absent_from_text_profiles(tmp_path: Path, profile: Profile) -> None:
    """A calibration with images records each layer's kept image share; text profiles keep their
    YAML as it was (no `image_share` key at all)."""
    text_file = save_profile(profile, tmp_path / "text.yaml")
    assert "image_share" not in text_file.read_text(encoding="utf-8")
    shares = (0.25, 0.0, 1.0, None)
    with_images = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(layer, image_share=share) for layer, share in zip(profile.layers, shares))
    )
    path = save_profile(with_images, tmp_path / "images.yaml")
    loaded = read_profile(path)
    assert loaded == with_images
    assert [layer.image_share for layer in loaded.layers] == list(shares)
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert [layer.get("image_share") for layer in document["layers"]] == list(shares)
    assert "image_share" not in document["layers"][3]  # None is left out, not written as null


def test_save_returns_path_and_creates_parent_dirs(tmp_path: Path, profile: Profile) -> None:
    dest = tmp_path / "a" / "b" / "profile.yaml"
    assert save_profile(profile, str(dest)) == dest
    assert read_profile(dest) == profile


def test_yaml_layout_says_budget_is_kept_fraction(good_file: Path) -> None:
    text = good_file.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0] == "# kvtool profile v1 — budget is the share of the full KV cache's bytes KEPT"
    assert "budget:\n  kept_fraction: 0.2\n" in text
    assert "priority_curve: [0.0, 0.5, 0.812345, 1.0]" in text
    assert "layer_types: [full_attention, full_attention, full_attention, sliding_attention]" in text
    document = yaml.safe_load(text)
    assert list(document) == [
        "schema_version", "kvtool_version", "created", "budget", "model", "method", "calibration", "layers",
    ]
    assert document["layers"][0] == {
        "layer": 0,
        "ratio": 0.30000000000000004,
        "compress": True,
        "gini": 0.61,
        "ratio_std": 0.02,
        "priority_curve": [0.0, 0.5, 0.812345, 1.0],
    }


def test_priority_curve_is_rounded_to_six_digits(tmp_path: Path, profile: Profile) -> None:
    layers = (LayerProfile(ratio=0.5, priority_curve=(0.0, 0.123456789, 1.0)),) + profile.layers[1:]
    loaded = read_profile(save_profile(Profile(**{**vars(profile), "layers": layers}), tmp_path / "p.yaml"))
    assert loaded.layers[0].priority_curve == (0.0, 0.123457, 1.0)


def test_hand_written_minimal_profile_gets_defaults(tmp_path: Path) -> None:
    path = tmp_path / "hand.yaml"
    path.write_text(
        "schema_version: 1\n"
        "budget: {kept_fraction: 0.5}\n"
        "model: {name: m, model_type: llama, num_layers: 2, num_attention_heads: 4,"
        " num_kv_heads: 4, head_dim: 8, hidden_size: 32, vocab_size: 100}\n"
        "method: {}\n"
        "layers:\n- {layer: 0, ratio: 1}\n- {layer: 1, ratio: 0.25}\n",
        encoding="utf-8",
    )
    loaded = read_profile(path)
    assert loaded.method == MethodSettings()
    assert loaded.ratios == [1.0, 0.25]
    assert isinstance(loaded.layers[0].ratio, float)
    assert loaded.calibration is None and loaded.created == "" and loaded.model.layer_types == ()


# --------------------------------------------------------------------------- atomic writes


def test_failure_while_dumping_leaves_no_file(tmp_path: Path, profile: Profile, monkeypatch) -> None:
    def broken_dump(data: Any, stream: Any, **kwargs: Any) -> None:
        stream.write("schema_version: 1\nbudget:\n")  # half a profile, then the crash
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(profile_io.yaml, "dump", broken_dump)
    with pytest.raises(RuntimeError, match="disk on fire"):
        save_profile(profile, tmp_path / "p.yaml")
    assert files_in(tmp_path) == []


def test_failure_while_dumping_keeps_existing_profile(good_file: Path, monkeypatch) -> None:
    before = good_file.read_bytes()

    def broken_dump(data: Any, stream: Any, **kwargs: Any) -> None:
        stream.write("garbage")
        raise KeyboardInterrupt

    monkeypatch.setattr(profile_io.yaml, "dump", broken_dump)
    with pytest.raises(KeyboardInterrupt):
        save_profile(make_profile(calibration=False), good_file)
    assert good_file.read_bytes() == before
    assert files_in(good_file.parent) == [good_file.name]


def test_failed_rename_keeps_existing_profile(good_file: Path, monkeypatch) -> None:
    before = good_file.read_bytes()

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(profile_io.os, "replace", broken_replace)
    with pytest.raises(KvtoolError) as info:
        save_profile(make_profile(calibration=False), good_file)
    assert_one_line_error(info.value, str(good_file), "No space left on device")
    assert good_file.read_bytes() == before
    assert files_in(good_file.parent) == [good_file.name]


def test_unwritable_destination_parent_is_a_file(tmp_path: Path, profile: Profile) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    dest = blocker / "p.yaml"
    with pytest.raises(KvtoolError) as info:
        save_profile(profile, dest)
    assert_one_line_error(info.value, "cannot write profile", str(dest))


def test_unwritable_destination_is_a_directory(tmp_path: Path, profile: Profile) -> None:
    dest = tmp_path / "taken"
    dest.mkdir()
    with pytest.raises(KvtoolError) as info:
        save_profile(profile, dest)
    assert_one_line_error(info.value, "cannot write profile", str(dest))
    assert files_in(tmp_path) == ["taken"]
    assert files_in(dest) == []


def test_new_profile_is_not_private(good_file: Path) -> None:
    # tempfile creates 0600 files; a saved profile should be readable like any other file.
    assert stat.S_IMODE(good_file.stat().st_mode) == 0o644


def test_invalid_profile_is_not_saved(tmp_path: Path, profile: Profile) -> None:
    bad = Profile(**{**vars(profile), "budget": 1.5})
    with pytest.raises(KvtoolError) as info:
        save_profile(bad, tmp_path / "p.yaml")
    assert_one_line_error(info.value, "p.yaml", "budget.kept_fraction", "(0, 1]")
    assert files_in(tmp_path) == []


# --------------------------------------------------------------------------- validate_profile on dataclasses


def test_validate_profile_accepts_good_profile(profile: Profile) -> None:
    validate_profile(profile)


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (lambda p: {"layers": p.layers[:2]}, ("layers has 2 entries", "num_layers is 4")),
        (lambda p: {"layers": (LayerProfile(ratio=0.0),) + p.layers[1:]}, ("layers[0].ratio", "(0, 1]")),
        (lambda p: {"method": MethodSettings(merge="mean")}, ("method.merge", "'mean'")),
        (lambda p: {"method": MethodSettings(sink_tokens=-1)}, ("method.sink_tokens", ">= 0")),
        (lambda p: {"method": MethodSettings(selection="random")}, ("method.selection", "'random'")),
        (lambda p: {"schema_version": 7}, ("schema_version 7", "supported")),
        (lambda p: {"budget": float("nan")}, ("budget.kept_fraction", "finite")),
    ],
    ids=["layer-count", "ratio-zero", "merge", "negative-sink", "selection", "version", "nan-budget"],
)
def test_validate_profile_rejects(profile: Profile, change: Callable[[Profile], dict], fragments: tuple[str, ...]) -> None:
    bad = Profile(**{**vars(profile), **change(profile)})
    with pytest.raises(KvtoolError) as info:
        validate_profile(bad, source="mine.yaml")
    assert_one_line_error(info.value, "mine.yaml", *fragments)


def test_validate_profile_rejects_non_profile() -> None:
    with pytest.raises(KvtoolError) as info:
        validate_profile({"budget": 0.2})  # type: ignore[arg-type]
    assert_one_line_error(info.value, "not a kvtool profile")


# --------------------------------------------------------------------------- bad files


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, str(path), "no such profile file")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(KvtoolError) as info:
        read_profile(tmp_path)
    assert_one_line_error(info.value, str(tmp_path), "directory")


def test_unreadable_file(good_file: Path, monkeypatch) -> None:
    # Tests may run as root, where chmod 000 does not stop reads; fake the OS refusing instead.
    def refuse(self: Path, *args: Any, **kwargs: Any) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(KvtoolError) as info:
        read_profile(good_file)
    assert_one_line_error(info.value, str(good_file), "cannot read", "Permission denied")


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x00\xff\xfe\x80garbage")
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, str(path), "cannot read", "UTF-8")


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("budget: [0.2\nmodel: x\n", ("not valid YAML", "line")),
        ("a: b: c\n", ("not valid YAML",)),
        ("\t- nope\n", ("not valid YAML",)),
        ("", ("expected a YAML mapping", "null")),
        ("- 1\n- 2\n", ("expected a YAML mapping", "list")),
        ("just a string\n", ("expected a YAML mapping", "str")),
    ],
    ids=["unclosed-flow", "nested-colon", "tab", "empty", "list", "scalar"],
)
def test_not_yaml_or_not_a_mapping(tmp_path: Path, text: str, fragments: tuple[str, ...]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, str(path), *fragments)


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """Mutation setting a dotted path such as `layers.2.ratio` (numbers index lists)."""

    def apply(document: dict) -> None:
        *parents, last = path.split(".")
        node: Any = document
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return apply


def _delete(path: str) -> Callable[[dict], None]:
    def apply(document: dict) -> None:
        *parents, last = path.split(".")
        node: Any = document
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[int(last) if isinstance(node, list) else last]

    return apply


NAN, INF = float("nan"), float("inf")

BAD_DOCUMENTS: list[tuple[str, Callable[[dict], None], tuple[str, ...]]] = [
    # schema version
    ("version-2", _set("schema_version", 2), ("schema_version 2 is not supported", "version 1")),
    ("version-0", _set("schema_version", 0), ("schema_version 0 is not supported",)),
    ("version-string", _set("schema_version", "1"), ("schema_version must be an integer", "str '1'")),
    ("version-missing", _delete("schema_version"), ("missing field schema_version",)),
    # missing fields
    ("missing-budget", _delete("budget"), ("missing field budget",)),
    ("missing-kept-fraction", _set("budget", {}), ("missing field budget.kept_fraction",)),
    ("missing-model", _delete("model"), ("missing field model",)),
    ("missing-kv-heads", _delete("model.num_kv_heads"), ("missing field model.num_kv_heads",)),
    ("missing-model-name", _delete("model.name"), ("missing field model.name",)),
    ("missing-method", _delete("method"), ("missing field method",)),
    ("missing-layers", _delete("layers"), ("missing field layers",)),
    ("missing-ratio", _delete("layers.3.ratio"), ("missing field layers[3].ratio",)),
    ("missing-layer-index", _delete("layers.1.layer"), ("missing field layers[1].layer",)),
    ("missing-dataset-hash", _delete("calibration.dataset_hash"), ("missing field calibration.dataset_hash",)),
    ("missing-prompt-mean", _delete("calibration.prompt_tokens.mean"), ("missing field calibration.prompt_tokens.mean",)),
    # mistyped fields
    ("ratio-string", _set("layers.0.ratio", "0.3"), ("layers[0].ratio must be a number", "str '0.3'")),
    ("ratio-bool", _set("layers.0.ratio", True), ("layers[0].ratio must be a number", "bool")),
    ("ratio-null", _set("layers.0.ratio", None), ("layers[0].ratio must be a number", "null")),
    ("num-layers-bool", _set("model.num_layers", True), ("model.num_layers must be an integer", "bool")),
    ("kv-heads-float", _set("model.num_kv_heads", 2.0), ("model.num_kv_heads must be an integer", "float")),
    ("head-dim-string", _set("model.head_dim", "16"), ("model.head_dim must be an integer",)),
    ("name-int", _set("model.name", 3), ("model.name must be a string", "int 3")),
    ("layer-types-string", _set("model.layer_types", "full"), ("model.layer_types must be a list",)),
    ("layer-types-entry", _set("model.layer_types.0", 1), ("model.layer_types[0] must be a string",)),
    ("compress-string", _set("layers.1.compress", "yes"), ("layers[1].compress must be true or false",)),
    ("compress-int", _set("layers.1.compress", 1), ("layers[1].compress must be true or false", "int 1")),
    ("sink-string", _set("method.sink_tokens", "4"), ("method.sink_tokens must be an integer",)),
    ("merge-int", _set("method.merge", 1), ("method.merge must be a string",)),
    ("curve-string", _set("layers.0.priority_curve", "0,1"), ("layers[0].priority_curve must be a list",)),
    ("curve-entry-string", _set("layers.0.priority_curve.1", "x"), ("layers[0].priority_curve[1] must be a number",)),
    ("gini-string", _set("layers.0.gini", "high"), ("layers[0].gini must be a number",)),
    ("budget-bare-number", _set("budget", 0.2), ("budget must be a mapping like {kept_fraction: 0.2}",)),
    ("budget-string", _set("budget.kept_fraction", "20%"), ("budget.kept_fraction must be a number",)),
    ("model-list", _set("model", []), ("model must be a mapping", "list")),
    ("layer-not-mapping", _set("layers.2", 0.5), ("layers[2] must be a mapping", "float")),
    ("layers-mapping", _set("layers", {"0": 0.5}), ("layers must be a list",)),
    ("samples-float", _set("calibration.samples", 16.0), ("calibration.samples must be an integer",)),
    ("seed-string", _set("calibration.seed", "42"), ("calibration.seed must be an integer",)),
    ("created-int", _set("created", 2025), ("created must be a string",)),
    ("truncation-ppl-list", _set("calibration.truncation_ppl", [1, 2]), ("calibration.truncation_ppl must be a mapping",)),
    ("truncation-ppl-key", _set("calibration.truncation_ppl", {"far": 1.0}), ("calibration.truncation_ppl keys must be integer",)),
    # ratio outside (0, 1]
    ("ratio-zero", _set("layers.0.ratio", 0), ("layers[0].ratio must be in (0, 1]", "got 0")),
    ("ratio-negative", _set("layers.0.ratio", -0.2), ("layers[0].ratio must be in (0, 1]",)),
    ("ratio-above-one", _set("layers.2.ratio", 1.5), ("layers[2].ratio must be in (0, 1]", "1.5")),
    # NaN / inf anywhere numeric
    ("ratio-nan", _set("layers.0.ratio", NAN), ("layers[0].ratio must be a finite number", "nan")),
    ("ratio-inf", _set("layers.0.ratio", INF), ("layers[0].ratio must be a finite number", "inf")),
    ("budget-nan", _set("budget.kept_fraction", NAN), ("budget.kept_fraction must be a finite number",)),
    ("budget-inf", _set("budget.kept_fraction", INF), ("budget.kept_fraction must be a finite number",)),
    ("gini-nan", _set("layers.1.gini", NAN), ("layers[1].gini must be a finite number",)),
    ("ratio-std-inf", _set("layers.1.ratio_std", INF), ("layers[1].ratio_std must be a finite number",)),
    ("curve-nan", _set("layers.1.priority_curve.2", NAN), ("layers[1].priority_curve[2] must be a finite number",)),
    ("ppl-full-inf", _set("calibration.ppl_full", INF), ("calibration.ppl_full must be a finite number",)),
    ("ppl-compressed-nan", _set("calibration.ppl_compressed", NAN), ("calibration.ppl_compressed must be a finite",)),
    ("retention-p-nan", _set("calibration.retention_p", NAN), ("calibration.retention_p must be a finite number",)),
    ("seconds-inf", _set("calibration.seconds", -INF), ("calibration.seconds must be a finite number",)),
    ("prompt-mean-nan", _set("calibration.prompt_tokens.mean", NAN), ("calibration.prompt_tokens.mean must be a finite",)),
    ("truncation-ppl-nan", _set("calibration.truncation_ppl", {25: NAN}), ("calibration.truncation_ppl[25] must be a finite",)),
    # budget outside (0, 1]
    ("budget-zero", _set("budget.kept_fraction", 0.0), ("budget.kept_fraction must be in (0, 1]",)),
    ("budget-above-one", _set("budget.kept_fraction", 1.2), ("budget.kept_fraction must be in (0, 1]", "1.2")),
    ("budget-negative", _set("budget.kept_fraction", -0.8), ("budget.kept_fraction must be in (0, 1]",)),
    # merge mode
    ("merge-unknown", _set("method.merge", "average"), ("method.merge must be one of position, none", "'average'")),
    # negative counts
    ("sink-negative", _set("method.sink_tokens", -1), ("method.sink_tokens must be >= 0", "-1")),
    ("recent-negative", _set("method.recent_window", -8), ("method.recent_window must be >= 0",)),
    ("truncation-negative", _set("method.truncation_distance", -25), ("method.truncation_distance must be >= 0",)),
    ("truncation-ppl-negative-d", _set("calibration.truncation_ppl", {-5: 12.0}), ("calibration.truncation_ppl distance must be >= 0",)),
    # model shape
    ("num-layers-zero", _set("model.num_layers", 0), ("model.num_layers must be >= 1",)),
    ("layer-types-length", _set("model.layer_types", ["full_attention"]), ("model.layer_types has 1 entries", "num_layers is 4")),
    # layer count / order
    ("too-few-layers", lambda d: d["layers"].pop(), ("layers has 3 entries but model.num_layers is 4",)),
    ("too-many-layers", lambda d: d["model"].update(num_layers=5, layer_types=[]), ("layers has 4 entries but model.num_layers is 5",)),
    ("layers-shuffled", _set("layers.1.layer", 2), ("layers[1].layer is 2, expected 1",)),
    # priority curve
    ("curve-decreasing", _set("layers.0.priority_curve", [0.0, 0.6, 0.5, 1.0]), ("layers[0].priority_curve must be non-decreasing", "[2] = 0.5 < 0.6")),
    ("curve-above-one", _set("layers.0.priority_curve", [0.0, 0.5, 1.01]), ("layers[0].priority_curve[2] must be in [0, 1]",)),
    ("curve-negative", _set("layers.0.priority_curve", [-0.1, 0.5, 1.0]), ("layers[0].priority_curve[0] must be in [0, 1]",)),
    # gini
    ("gini-above-one", _set("layers.0.gini", 1.5), ("layers[0].gini must be in [0, 1]", "1.5")),
    ("gini-negative", _set("layers.0.gini", -0.1), ("layers[0].gini must be in [0, 1]",)),
    # other ranges
    ("ratio-std-negative", _set("layers.0.ratio_std", -0.1), ("layers[0].ratio_std must be >= 0",)),
    # kept image share (calibrations with images)
    ("image-share-above-one", _set("layers.0.image_share", 1.5), ("layers[0].image_share must be in [0, 1]", "1.5")),
    ("image-share-negative", _set("layers.1.image_share", -0.1), ("layers[1].image_share must be in [0, 1]",)),
    ("image-share-string", _set("layers.0.image_share", "half"), ("layers[0].image_share must be a number", "str 'half'")),
    ("image-share-nan", _set("layers.2.image_share", NAN), ("layers[2].image_share must be a finite number",)),
    ("samples-zero", _set("calibration.samples", 0), ("calibration.samples must be >= 1",)),
    ("prompt-min-above-max", _set("calibration.prompt_tokens.min", 600), ("calibration.prompt_tokens.min (600) is larger",)),
    ("retention-p-zero", _set("calibration.retention_p", 0.0), ("calibration.retention_p must be in (0, 1]",)),
    ("ppl-zero", _set("calibration.ppl_full", 0.0), ("calibration.ppl_full must be > 0",)),
    # unknown keys (typo protection)
    ("unknown-top", _set("budjet", {"kept_fraction": 0.2}), ("unknown field budjet", "did you mean budget?")),
    ("unknown-top-far", _set("comment", "hi"), ("unknown field comment", "known:")),
    ("unknown-budget", _set("budget.evicted_fraction", 0.8), ("unknown field budget.evicted_fraction",)),
    ("unknown-model", _set("model.num_kv_head", 2), ("unknown field model.num_kv_head", "did you mean num_kv_heads?")),
    ("unknown-method", _set("method.sinks", 4), ("unknown field method.sinks",)),
    ("unknown-layer", _set("layers.2.ratoi", 0.5), ("unknown field layers[2].ratoi", "did you mean ratio?")),
    ("unknown-calibration", _set("calibration.note", "x"), ("unknown field calibration.note",)),
    ("unknown-prompt-tokens", _set("calibration.prompt_tokens.median", 3), ("unknown field calibration.prompt_tokens.median",)),
    ("unknown-int-key", _set("layers.0.7", 1), ("unknown field layers[0].7",)),
]


@pytest.mark.parametrize(
    ("mutate", "fragments"),
    [pytest.param(mutate, fragments, id=name) for name, mutate, fragments in BAD_DOCUMENTS],
)
def test_bad_document(
    tmp_path: Path, good_document: dict, mutate: Callable[[dict], None], fragments: tuple[str, ...]
) -> None:
    document = copy.deepcopy(good_document)
    mutate(document)
    path = write_document(tmp_path / "broken.yaml", document)
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, f"{path}: ", *fragments)


def test_long_values_are_shortened_in_errors(tmp_path: Path, good_document: dict) -> None:
    good_document["model"]["name"] = 12345678901234567890123456789012345678901234567890
    path = write_document(tmp_path / "p.yaml", good_document)
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, "model.name must be a string", "...")
    assert len(str(info.value)) < 200


def test_multiline_string_value_stays_one_line(tmp_path: Path, good_document: dict) -> None:
    good_document["method"]["merge"] = "first\nsecond"
    path = write_document(tmp_path / "p.yaml", good_document)
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, "method.merge must be one of")


def test_null_calibration_and_optional_nulls_are_fine(tmp_path: Path, good_document: dict) -> None:
    good_document["calibration"] = None
    good_document["layers"][0].update(gini=None, ratio_std=None, priority_curve=[])
    loaded = read_profile(write_document(tmp_path / "p.yaml", good_document))
    assert loaded.calibration is None
    assert loaded.layers[0] == LayerProfile(ratio=0.30000000000000004)


# --------------------------------------------------------------------------- legacy keys, built-in files


@pytest.mark.parametrize("value", ["mean", "sum", None])
def test_legacy_curve_importance_is_read_and_not_written_back(
    tmp_path: Path, good_document: dict, profile: Profile, value: str | None
) -> None:
    """Profiles written before `curve_importance` was dropped still load, as the same profile."""
    good_document["calibration"]["curve_importance"] = value
    loaded = read_profile(write_document(tmp_path / "old.yaml", good_document))
    assert loaded == profile
    assert "curve_importance" not in save_profile(loaded, tmp_path / "new.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize(("value", "shown"), [("median", "'median'"), (3, "3")])
def test_legacy_curve_importance_other_values_are_refused(
    tmp_path: Path, good_document: dict, value: Any, shown: str
) -> None:
    good_document["calibration"]["curve_importance"] = value
    path = write_document(tmp_path / "p.yaml", good_document)
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert str(info.value) == f"{path}: calibration.curve_importance must be one of mean, sum, got {shown}"


@pytest.mark.parametrize("value", ["in-context", "forced", None])
def test_retired_answer_references_key_still_loads(
    tmp_path: Path, good_document: dict, profile: Profile, value: str | None
) -> None:
    """Profiles calibrated with `--answer-references` (retired) load as the same profile, and
    saving drops the key; a value it never had is refused in one line."""
    good_document["calibration"]["answer_references"] = value
    loaded = read_profile(write_document(tmp_path / "old.yaml", good_document))
    assert loaded == profile
    assert "answer_references" not in save_profile(loaded, tmp_path / "new.yaml").read_text(encoding="utf-8")
    good_document["calibration"]["answer_references"] = "inline"
    path = write_document(tmp_path / "bad.yaml", good_document)
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert str(info.value) == f"{path}: calibration.answer_references must be one of forced, in-context, got 'inline'"


def test_legacy_key_is_known_to_typo_suggestions(tmp_path: Path, good_document: dict) -> None:
    good_document["calibration"]["curve_importanc"] = "mean"
    with pytest.raises(KvtoolError) as info:
        read_profile(write_document(tmp_path / "p.yaml", good_document))
    assert_one_line_error(info.value, "unknown field calibration.curve_importanc", "did you mean curve_importance?")


OLD_METHOD_KEYS = {"lookahead": 8, "lookahead_hold": 2.0, "draft": 64, "draft_rounds": 2, "draft_verify": True, "draft_reuse": True}


def test_an_old_profile_with_retired_and_flat_draft_keys_loads(
    tmp_path: Path, good_document: dict, profile: Profile
) -> None:
    """A profile written before the draft became one value and the lookahead and reused drafts were
    retired loads through the legacy-keys table: the flat draft keys become `Draft`, the retired
    keys are dropped, and saving writes the current form only."""
    good_document["method"].update(OLD_METHOD_KEYS)
    loaded = read_profile(write_document(tmp_path / "old.yaml", good_document))
    assert loaded.method.draft == Draft(tokens=64, rounds=2, verify=True)
    assert loaded == dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=Draft(64, 2, True)))
    text = save_profile(loaded, tmp_path / "new.yaml").read_text(encoding="utf-8")
    assert "  draft: {tokens: 64, rounds: 2, verify: true}\n" in text
    assert not any(key in text for key in ("lookahead", "draft_rounds", "draft_verify", "draft_reuse"))
    assert read_profile(tmp_path / "new.yaml") == loaded


@pytest.mark.parametrize(
    ("old", "draft"),
    [
        ({"draft": 5}, Draft(5)),
        ({"draft": 0, "draft_rounds": 3, "draft_verify": True}, None),  # draft 0 was "no draft"
        ({"draft_rounds": 2}, None),  # rounds of no draft
        ({"lookahead": 3}, None),
        ({"draft": None, "lookahead_hold": None}, None),
    ],
)
def test_old_draft_keys_become_the_draft_value(
    tmp_path: Path, good_document: dict, old: dict, draft: Draft | None
) -> None:
    good_document["method"].update(old)
    assert read_profile(write_document(tmp_path / "old.yaml", good_document)).method.draft == draft


@pytest.mark.parametrize(
    ("old", "problem"),
    [
        ({"draft_rounds": 0}, "method.draft_rounds must be >= 1, got 0"),
        ({"lookahead": -1}, "method.lookahead must be >= 0, got -1"),
        ({"draft_reuse": "yes"}, "method.draft_reuse must be true or false"),
        ({"draft_rounds": 2, "draft": {"tokens": 4}}, "method.draft_rounds is the old form of method.draft"),
        ({"draft": {"rounds": 2}}, "missing field method.draft.tokens"),
        ({"draft": {"tokens": 0}}, "method.draft.tokens must be >= 1, got 0"),
    ],
)
def test_bad_draft_values_are_refused_in_one_line(tmp_path: Path, good_document: dict, old: dict, problem: str) -> None:
    good_document["method"].update(old)
    with pytest.raises(KvtoolError) as info:
        read_profile(write_document(tmp_path / "p.yaml", good_document))
    assert_one_line_error(info.value, problem)


BUILTIN_FILES = sorted((Path(profile_io.__file__).parent / "builtin").glob("*.yaml"))


@pytest.mark.parametrize("path", BUILTIN_FILES, ids=[p.name for p in BUILTIN_FILES])
def test_builtin_profiles_round_trip_byte_for_byte(tmp_path: Path, path: Path) -> None:
    """Reading and saving a shipped profile writes the very same text: no field is lost, reordered
    or reformatted, so regenerated profiles can be compared with `diff`."""
    saved = save_profile(read_profile(path), tmp_path / path.name)
    assert saved.read_bytes() == path.read_bytes()


def test_builtin_profiles_exist() -> None:
    assert [p.name for p in BUILTIN_FILES] == ["gemma3-270m-b0.2.yaml", "gemma3-270m-b0.5.yaml", "smollm2-b0.1.yaml", "smollm2-b0.2.yaml", "smollm2-b0.5.yaml"]


def test_profiles_package_imports_no_torch() -> None:
    """The format and the budget mathematics are numpy-only: `kvtool inspect` and library users
    reading profiles never pay for torch."""
    code = (
        "import pkgutil, importlib, sys, kvtool.profiles as p\n"
        "for m in pkgutil.walk_packages(p.__path__, 'kvtool.profiles.'): importlib.import_module(m.name)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers')))\n"
        "print(sorted(n for n in sys.modules if n.startswith('kvtool.profiles.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    heavy, imported = done.stdout.splitlines()
    assert heavy == "[]"
    assert "kvtool.profiles.budget" in imported and "kvtool.profiles.validate" in imported


# --------------------------------------------------------------------------- fingerprints


def test_fingerprint_of_llama_config() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=500
    )
    config._name_or_path = "meta-llama/tiny"
    assert fingerprint_of(config) == ModelFingerprint(
        name="meta-llama/tiny",
        model_type="llama",
        num_layers=3,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=64,
        vocab_size=500,
        layer_types=("full_attention",) * 3,
    )


def test_fingerprint_head_dim_and_kv_heads_fallbacks() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=96, num_attention_heads=6, vocab_size=50)
    config.head_dim = None
    config.num_key_value_heads = None
    fp = fingerprint_of(config)
    assert (fp.head_dim, fp.num_kv_heads) == (16, 6)
    assert fp.name == "llama"  # no checkpoint path: the model type


def test_fingerprint_explicit_head_dim_and_name() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=32, vocab_size=50)
    fp = fingerprint_of(config, name="my-model")
    assert (fp.head_dim, fp.name) == (32, "my-model")


def test_fingerprint_of_model_uses_its_config() -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    fp = fingerprint_of(SimpleNamespace(config=config))
    assert fp == fingerprint_of(config)
    assert fp.head_dim == 16 and fp.model_type == "qwen2"


def test_fingerprint_of_vlm_uses_text_decoder() -> None:
    from transformers import Gemma3Config

    config = Gemma3Config()
    text = config.get_text_config(decoder=True)
    fp = fingerprint_of(config)
    assert fp.num_layers == text.num_hidden_layers
    assert fp.num_kv_heads == text.num_key_value_heads
    assert fp.head_dim == text.head_dim
    assert fp.vocab_size == text.vocab_size
    assert fp.layer_types == tuple(text.layer_types)
    assert {"full_attention", "sliding_attention"} <= set(fp.layer_types)


def test_fingerprint_round_trips_through_profile(tmp_path: Path) -> None:
    from transformers import Gemma3Config

    fp = fingerprint_of(Gemma3Config(), name="google/gemma-3-4b-it")
    layers = tuple(LayerProfile(ratio=0.2, compress=t == "full_attention") for t in fp.layer_types)
    profile = Profile(budget=0.2, model=fp, method=MethodSettings(), layers=layers)
    assert read_profile(save_profile(profile, tmp_path / "g.yaml")) == profile


def test_fingerprint_rejects_non_models() -> None:
    with pytest.raises(KvtoolError) as info:
        fingerprint_of(object())
    assert_one_line_error(info.value, "cannot fingerprint", "object")


def test_fingerprint_rejects_config_without_decoder_shape() -> None:
    from transformers import PretrainedConfig

    with pytest.raises(KvtoolError) as info:
        fingerprint_of(PretrainedConfig())
    assert_one_line_error(info.value, "no num_hidden_layers")


# --------------------------------------------------------------------------- CLI


runner = CliRunner()


def test_cli_inspect_profile_shows_summary_and_table(good_file: Path) -> None:
    result = runner.invoke(app_module.app, ["inspect", "profile", str(good_file)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for fragment in (
        "tiny/llama-test (llama)",
        "keeps 20.0% of KV entries",
        "merge position",
        "sha256:0123abcd",
        "D=25: 12.500",
        "Per-layer KV budget",
        "Gini",
        "Spread",
        "sliding",
        "0.300",
        "±0.020",
        "██████",
        "is a valid kvtool profile",
    ):
        assert fragment in out, fragment
    assert out.rstrip().splitlines()[-1].startswith("✓")


def test_cli_inspect_uncalibrated_profile(tmp_path: Path) -> None:
    path = save_profile(make_profile(calibration=False), tmp_path / "u.yaml")
    result = runner.invoke(app_module.app, ["inspect", "profile", str(path)])
    assert result.exit_code == 0, result.output
    assert "none (uniform profile)" in result.stdout


def test_cli_inspect_profile_json_is_pure_json(good_file: Path, profile: Profile) -> None:
    result = runner.invoke(app_module.app, ["inspect", "profile", str(good_file), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["budget"] == {"kept_fraction": 0.2}
    assert document["schema_version"] == SCHEMA_VERSION
    assert [layer["ratio"] for layer in document["layers"]] == profile.ratios
    assert document["calibration"]["truncation_ppl"] == {"5": 14.25, "25": 12.5, "50": 12.0}
    assert document == json.loads(json.dumps(profile_to_dict(profile)))


def test_cli_inspect_bad_profile_raises_kvtool_error(tmp_path: Path, good_document: dict) -> None:
    good_document["layers"][0]["ratio"] = 2.0
    path = write_document(tmp_path / "bad.yaml", good_document)
    result = runner.invoke(app_module.app, ["inspect", "profile", str(path)])
    assert result.exit_code != 0
    assert isinstance(result.exception, KvtoolError)
    assert_one_line_error(result.exception, "layers[0].ratio")


def run_main(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Call the real `kvtool` entry point in-process; the other subcommands need not exist."""
    monkeypatch.setattr(sys, "argv", ["kvtool", *argv])
    monkeypatch.setattr(app_module, "_register", lambda: None)  # inspect_cmd is already imported
    code = 0
    try:
        app_module.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_main_good_profile(good_file: Path, monkeypatch, capsys) -> None:
    code, out, err = run_main(["inspect", "profile", str(good_file)], monkeypatch, capsys)
    assert code == 0, err
    assert "Per-layer KV budget" in out and "is a valid kvtool profile" in out


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "no such profile file"),
        ("schema_version: 1\nbudget: 0.2\nmodel: {}\nmethod: {}\nlayers: []\n", "budget must be a mapping"),
        ("a: [1\n", "not valid YAML"),
        ("schema_version: 9\n", "schema_version 9 is not supported"),
    ],
    ids=["missing", "bare-budget", "not-yaml", "version"],
)
def test_main_bad_profile_prints_one_line_error(
    tmp_path: Path, monkeypatch, capsys, content: str | None, fragment: str
) -> None:
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    code, out, err = run_main(["inspect", "profile", str(path)], monkeypatch, capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and str(path) in lines[0] and fragment in lines[0]
    assert "Traceback" not in err


@pytest.mark.skipif(
    importlib.util.find_spec("kvtool.cli.generate") is None,
    reason="the real entry point also registers `kvtool generate`, not written yet",
)
def test_real_entry_point_in_subprocess(tmp_path: Path, good_file: Path, good_document: dict) -> None:
    good_document["model"]["num_kv_head"] = good_document["model"].pop("num_kv_heads")
    bad = write_document(tmp_path / "typo.yaml", good_document)
    entry = "from kvtool.cli.app import main; main()"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}

    ok = subprocess.run(
        [sys.executable, "-c", entry, "inspect", "profile", str(good_file)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert "is a valid kvtool profile" in ok.stdout

    failed = subprocess.run(
        [sys.executable, "-c", entry, "inspect", "profile", str(bad)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert failed.returncode == 2
    assert "Traceback" not in failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "missing field model.num_kv_heads" in lines[0]
