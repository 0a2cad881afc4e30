"""`kvtool export PROFILE --engine vllm|trtllm`: the vLLM line parsed by an argparse model of vLLM
0.33's documented flags, the TensorRT-LLM config checked against KvCacheConfig's documented fields,
the share-to-window mapping, the format mapping, a calibrated engine recipe, and one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
from pathlib import Path

import pytest
import yaml

from cli_runner import run
from kvtool.calibration.engine import ENGINE_SPACES
from kvtool.errors import KvtoolError
from kvtool.export import ENGINES, export_profile
from kvtool.profiles import save_profile
from kvtool.profiles.schema import EngineRecipe
from tiny_models import profile_with, tiny_llama

# vLLM 0.33's documented --kv-cache-dtype values (its CacheDType; TurboQuant variants left out).
VLLM_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "int4_per_token_head",
                  "fp8_per_token_head", "nvfp4")
TRTLLM_KV_DTYPES = ("auto", "fp8", "nvfp4")


def vllm_parser() -> argparse.ArgumentParser:
    """The flags of `vllm serve` an export may use, typed as vLLM documents them."""
    parser = argparse.ArgumentParser(prog="vllm", exit_on_error=False)
    serve = parser.add_subparsers(dest="command", required=True).add_parser("serve", exit_on_error=False)
    serve.add_argument("model")
    serve.add_argument("--kv-cache-dtype", choices=VLLM_KV_DTYPES, default="auto")
    serve.add_argument("--kv-cache-dtype-skip-layers", nargs="+", default=[])
    serve.add_argument("--hf-overrides", type=json.loads, default={})
    return parser


def parse_vllm(text: str, layers: int) -> argparse.Namespace:
    words = shlex.split(text.splitlines()[0])
    assert words[0] == "vllm"
    args = vllm_parser().parse_args(words[1:])
    assert args.command == "serve"
    overrides = args.hf_overrides
    if overrides:
        assert set(overrides) == {"layer_types", "sliding_window"}
        assert len(overrides["layer_types"]) == layers
        assert set(overrides["layer_types"]) <= {"full_attention", "sliding_attention"}
        assert isinstance(overrides["sliding_window"], int) and overrides["sliding_window"] >= 1
    assert all(0 <= int(i) < layers for i in args.kv_cache_dtype_skip_layers)
    return args


def check_trtllm(text: str, layers: int) -> dict:
    """The YAML as trtllm-serve --extra_llm_api_options reads it: LLM arguments and KvCacheConfig's fields."""
    config = yaml.safe_load(text)  # the note lines are YAML comments
    assert set(config) <= {"max_seq_len", "kv_cache_config"}
    kv = config["kv_cache_config"]
    assert set(kv) <= {"dtype", "max_attention_window"} and kv["dtype"] in TRTLLM_KV_DTYPES
    windows = kv.get("max_attention_window", [])
    assert len(windows) in (0, layers) and all(isinstance(w, int) and 1 <= w <= config["max_seq_len"] for w in windows)
    return config


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=3)


def test_kept_shares_become_windows_of_share_times_prompt_tokens(model) -> None:
    profile = profile_with(model, [0.1, 0.25, 1.0])
    trt = export_profile(profile, "trtllm", prompt_tokens=100, max_seq_len=4096)
    config = check_trtllm(trt.text, 3)
    assert config["kv_cache_config"]["max_attention_window"] == [10, 25, 4096]
    assert trt.held.windows == (10, 25, None) and trt.held.prompt_tokens == 100
    vllm = export_profile(profile, "vllm", prompt_tokens=100)
    args = parse_vllm(vllm.text, 3)
    # One size for vLLM: the windows' mean (the same entries in all).
    assert args.hf_overrides == {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 18}
    assert args.kv_cache_dtype == "auto" and args.model == profile.model.name
    assert "become one of 18" in vllm.held.stays_behind and "sink tokens" in vllm.held.stays_behind
    assert vllm.held.kept_entries == pytest.approx((18 + 18 + 100) / 300)
    # Without a calibration the prompt length is the stated default.
    assert export_profile(profile, "vllm").held.prompt_tokens == 4096


def test_the_full_cache_is_a_plain_serve_line(model) -> None:
    exported = export_profile(profile_with(model, 1.0), "vllm", model="org/tiny")
    assert exported.text.splitlines()[0] == "vllm serve org/tiny"
    assert exported.held.windows == (None, None, None) and exported.held.kept_entries == 1.0


def test_formats_map_to_the_engines_dtypes(model) -> None:
    base = profile_with(model, [0.2, 0.2, 0.2])

    def formats(*pairs):
        layers = tuple(dataclasses.replace(layer, keys_format=k, values_format=v) for layer, (k, v) in zip(base.layers, pairs))
        return dataclasses.replace(base, layers=layers)

    int8 = formats(("int8", "int8"), ("int8", "int8"), ("native", "native"))
    args = parse_vllm(export_profile(int8, "vllm", prompt_tokens=50).text, 3)
    assert args.kv_cache_dtype == "int8_per_token_head" and args.kv_cache_dtype_skip_layers == ["2"]
    trt = export_profile(int8, "trtllm", prompt_tokens=50)
    assert check_trtllm(trt.text, 3)["kv_cache_config"]["dtype"] == "fp8"
    assert "no int8 KV" in trt.held.stays_behind and "layers 2 at native precision are stored at fp8" in trt.held.stays_behind
    fp8 = export_profile(formats(*[("fp8", "fp8")] * 3), "vllm", prompt_tokens=50)
    assert parse_vllm(fp8.text, 3).kv_cache_dtype == "fp8_per_token_head"
    grouped = export_profile(formats(*[("int8", "int4-g32")] * 3), "vllm", prompt_tokens=50)
    assert parse_vllm(grouped.text, 3).kv_cache_dtype == "int8_per_token_head"
    assert "keys int8 / values int4-g32 stored alike as int8" in grouped.held.stays_behind
    two_bit = export_profile(formats(*[("int2-g32", "int2-g32")] * 3), "vllm", prompt_tokens=50)
    assert parse_vllm(two_bit.text, 3).kv_cache_dtype == "int4_per_token_head" and "no 2-bit" in two_bit.held.stays_behind


def recipe(engine: str, **changes) -> EngineRecipe:
    fields = dict(engine=engine, kv_cache_dtype=ENGINE_SPACES[engine].dtype_of("native"), windows=("40", "full", "40"),
                  prompt_tokens=200, kept=0.47, ppl=2.5, kvtool_ppl=2.2, held_out_ppl=2.6, kvtool_held_out_ppl=2.3)
    return EngineRecipe(**{**fields, **changes})


def with_recipe(profile, engine_recipe):
    from kvtool.profiles import CalibrationInfo, PromptStats

    info = CalibrationInfo(dataset_hash="sha256:0", samples=4, prompt_tokens=PromptStats(150, 180.0, 210), engine=engine_recipe)
    return dataclasses.replace(profile, calibration=info)


def test_a_calibrated_engine_recipe_is_exported_as_measured(model, tmp_path, monkeypatch, capsys) -> None:
    profile = with_recipe(profile_with(model, 0.3), recipe("vllm", kv_cache_dtype="int8_per_token_head", skip_layers=("1",)))
    save_profile(profile, tmp_path / "p.yaml")  # the record validates and round-trips
    code, out, err = run(monkeypatch, capsys, "export", str(tmp_path / "p.yaml"), "--engine", "vllm")
    assert code == 0, err
    args = parse_vllm(out, 3)
    assert args.kv_cache_dtype == "int8_per_token_head" and args.kv_cache_dtype_skip_layers == ["1"]
    assert args.hf_overrides["sliding_window"] == 40 and args.hf_overrides["layer_types"][1] == "full_attention"
    assert "calibration PPL 2.2 against this recipe's 2.5" in out
    scaled = export_profile(profile, "vllm", prompt_tokens=400)
    assert scaled.held.windows == (80, None, 80)
    # Another engine's record is not this engine's recipe: the shares are mapped instead.
    assert export_profile(profile, "trtllm").held.measured is None


def test_the_json_holds_what_the_text_says(model, tmp_path, monkeypatch, capsys) -> None:
    save_profile(profile_with(model, [0.1, 0.25, 1.0]), tmp_path / "p.yaml")
    code, out, _ = run(monkeypatch, capsys, "export", str(tmp_path / "p.yaml"), "--engine", "vllm", "--prompt-tokens", "100", "--json")
    data = json.loads(out)
    assert code == 0 and data["engine"] == "vllm" and data["windows"] == [18, 18, None]
    assert vllm_parser().parse_args(data["argv"][1:]).hf_overrides == data["hf_overrides"]
    code, text, _ = run(monkeypatch, capsys, "export", str(tmp_path / "p.yaml"), "--engine", "vllm", "--prompt-tokens", "100")
    assert text.splitlines()[0] == data["command"] and f"# stays behind: {data['stays_behind']}" in text
    code, out, _ = run(monkeypatch, capsys, "export", str(tmp_path / "p.yaml"), "--engine", "trtllm", "--json")
    assert json.loads(out)["config"]["kv_cache_config"]["max_attention_window"][2] == json.loads(out)["config"]["max_seq_len"]


def test_bad_input_is_one_line(model, tmp_path, monkeypatch, capsys) -> None:
    path = tmp_path / "p.yaml"
    save_profile(profile_with(model, 0.3), path)
    for args, message in (
        (("--engine", "sglang"), "unknown engine 'sglang' (known: vllm, trtllm)"),
        (("--engine", "vllm", "--prompt-tokens", "0"), "--prompt-tokens must be at least 1"),
        (("--engine", "trtllm", "--max-seq-len", "4", "--prompt-tokens", "100"), "shorter than the longest window"),
    ):
        code, out, err = run(monkeypatch, capsys, "export", str(path), *args)
        assert code == 2 and out == "" and err.startswith("error: ") and message in err
        assert len(err.strip().splitlines()) == 1
    broken = tmp_path / "broken.yaml"
    broken.write_text(path.read_text().replace("kept_fraction: 0.3", "kept_fraction: 3"))
    code, out, err = run(monkeypatch, capsys, "export", str(broken), "--engine", "vllm")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    qwen3 = dataclasses.replace(profile_with(model, 0.3), model=dataclasses.replace(profile_with(model, 0.3).model, model_type="qwen3"))
    with pytest.raises(KvtoolError, match="ignores --hf-overrides layer_types"):
        export_profile(qwen3, "vllm")
    assert export_profile(qwen3, "trtllm").held.windows[0] is not None
    assert math.isclose(export_profile(profile_with(model, 1.0), "trtllm").held.kept_entries, 1.0)


def test_every_engine_has_a_space_and_an_exporter() -> None:
    assert set(ENGINES) == set(ENGINE_SPACES)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "kvtool" / "profiles" / "builtin").glob("*.yaml")), ids=lambda p: p.name)
def test_the_builtin_profiles_export_to_both_engines(path) -> None:
    from kvtool.runtime import load_profile

    profile = load_profile(path)
    layers = profile.model.num_layers
    vllm = export_profile(profile, "vllm")
    args = parse_vllm(vllm.text, layers)
    assert args.hf_overrides and len({w for w in vllm.held.windows if w is not None}) == 1
    assert "draft" in vllm.held.stays_behind
    trt = export_profile(profile, "trtllm", prompt_tokens=4096)
    windows = check_trtllm(trt.text, layers)["kv_cache_config"]["max_attention_window"]
    kinds = profile.model.layer_types
    for window, kind, layer in zip(windows, kinds, profile.layers):
        if kind == "sliding_attention":  # kvtool's window entries plus the token written
            assert window == (layer.window + 1 if layer.window is not None else profile.model.sliding_window)
        else:
            share = math.ceil(layer.ratio * 4096 - 1e-9)
            assert window == (share if share < 4096 else 8192)
