"""`kvtool calibrate --engine`: the engine emulation against independent computations (the full
pass's own NLL with nothing windowed, transformers' own sliding-window layers for the windows, a
brute-force softmax for quantized keys and values), the search's budget, and the recorded recipe."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import make_word_tokenizer
from kvtool.calibration.config import CalibrateConfig
from kvtool.calibration.engine import ENGINE_SPACES, calibrate_for_engine, calibration_states, candidates, search_engine_recipe
from kvtool.calibration.engine_emulation import (
    FP8_TENSOR, Servable, _EngineAttention, emulated_ppl, fake_quantized, kept_share, reference_rows,
)
from kvtool.calibration.passes import full_ppl
from kvtool.calibration.runner import calibrate
from kvtool.data import Record
from kvtool.errors import KvtoolError
from kvtool.models import LoadedModel, prepare_tokenizer
from kvtool.profiles import fingerprint_of, read_profile
from kvtool.profiles.schema import ENGINES
from tiny_models import tiny_llama

WORDS = "the cat dog sat on mat and it ran away to house big small red blue green one two three yes no".split()
FAST = {"reference_tokens": 6, "candidates": (0, 8), "search": None, "samples": 4, "seed": 1, "batch_size": 2, "draft": None}


def word_prompts(count: int, seed: int = 0) -> list[Record]:
    rng = random.Random(seed)
    return [Record(prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 50))), where=f"t{i}") for i in range(count)]


def loaded(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=prepare_tokenizer(make_word_tokenizer()), name="tiny", source="test")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    model = tiny_llama(dtype=torch.float64, layers=3, seed=3)
    with torch.no_grad():  # sharper attention, so windows cost something measurable
        for layer, scale in zip(model.model.layers, (30.0, 8.0, 1.0)):
            layer.self_attn.q_proj.weight.mul_(scale)
    return loaded(model)


@pytest.fixture(scope="module")
def states(tiny):
    config = dataclasses.replace(CalibrateConfig(), **FAST).checked()
    choosing, _ = calibration_states(tiny, config, word_prompts(6), lambda *_: None)
    return choosing


def test_nothing_windowed_at_native_precision_is_the_full_cache(tiny, states) -> None:
    got = emulated_ppl(tiny.model, Servable((None, None, None)), reference_rows(states))
    assert got == pytest.approx(full_ppl(states).ppl(), rel=1e-9)


def test_windows_are_transformers_own_sliding_layers() -> None:
    """A window on layer 1 is what Qwen2 computes with layer 1 a sliding layer of that window
    (what vLLM's --hf-overrides layer_types makes of it), prompt and answer alike."""
    window, kinds = 5, ["full_attention", "sliding_attention", "full_attention"]
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    full = Qwen2ForCausalLM(Qwen2Config(**base)).double().eval()
    sliding = Qwen2ForCausalLM(Qwen2Config(**base, use_sliding_window=True, sliding_window=window, layer_types=kinds)).double().eval()
    sliding.load_state_dict(full.state_dict())
    sliding.set_attn_implementation("sdpa")  # eager takes its softmax in float32
    g = torch.Generator().manual_seed(2)
    rows = [(torch.randint(3, 97, (n,), generator=g), torch.randint(3, 97, (m,), generator=g)) for n, m in ((17, 6), (9, 4))]
    means = []
    with torch.no_grad():
        for ids, ref in rows:
            logits = sliding(input_ids=torch.cat([ids, ref[:-1]])[None]).logits[0, len(ids) - 1:]
            means.append(float(-torch.log_softmax(logits, -1).gather(1, ref[:, None]).mean()))
    expected = math.exp(sum(means) / len(means))
    assert emulated_ppl(full, Servable((None, window, None)), rows) == pytest.approx(expected, rel=1e-9)
    assert emulated_ppl(full, Servable((None, None, None)), rows) != pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", FP8_TENSOR])
def test_quantized_keys_and_values_are_attended_as_stored(fmt) -> None:
    g = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 4, 7, 16, generator=g, dtype=torch.float64) for _ in range(3))
    key, value = key[:, :2], value[:, :2]
    module = type("M", (), {"layer_idx": 0})()
    out, _ = _EngineAttention({0: 3}, {0: fmt})(module, query, key, value, None, scaling=0.25)
    k, v = fake_quantized(key, fmt).repeat_interleave(2, 1), fake_quantized(value, fmt).repeat_interleave(2, 1)
    for row in range(7):
        cols = [c for c in range(7) if row - 3 < c <= row]
        weights = torch.softmax((query[0, :, row, None, :] * k[0, :, cols]).sum(-1) * 0.25, -1)  # [heads, cols]
        expected = (weights[..., None] * v[0, :, cols]).sum(1)
        torch.testing.assert_close(out[0, row], expected, rtol=1e-9, atol=1e-9)
    assert not torch.equal(fake_quantized(key, fmt), key)


def test_every_candidate_fits_the_budget_and_vllm_has_one_window(tiny) -> None:
    fingerprint = fingerprint_of(tiny.model)
    for engine, space in ENGINE_SPACES.items():
        found = candidates(space, 0.3, fingerprint, 8, 40, order=[2, 1, 0], ratios=[0.1, 0.3, 0.5])
        assert found
        for servable in found:
            assert kept_share(servable, fingerprint, 8, 40) <= 0.3 + 1e-9
            assert servable.fmt in space.dtypes
            sizes = {w for w in servable.windows if w is not None}
            if space.one_window:
                assert len(sizes) <= 1
            if not space.skip_layers:
                assert servable.skip == ()
        assert any(len({w for w in s.windows if w is not None}) > 1 for s in found) == (engine == "trtllm")
    assert tuple(ENGINE_SPACES) == ENGINES


def test_the_search_picks_its_lowest_ppl_within_the_budget(tiny, states) -> None:
    shipped = calibrate(tiny, 0.3, data=word_prompts(6), **FAST).profile
    choice = search_engine_recipe(tiny.model, "vllm", 0.3, shipped, states[:1], states[1:])
    assert choice.tried[choice.servable] == min(choice.tried.values())
    recipe = choice.recipe
    assert recipe.engine == "vllm" and recipe.kept <= 0.3 and len(recipe.windows) == 3
    assert recipe.ppl == pytest.approx(choice.tried[choice.servable], abs=1e-4)
    assert recipe.held_out_ppl is not None and recipe.kvtool_held_out_ppl is not None
    with pytest.raises(KvtoolError, match="no vllm-servable cache fits"):
        search_engine_recipe(tiny.model, "vllm", 0.001, shipped, states[:1])


def test_calibrate_for_an_engine_records_its_recipe(tiny, tmp_path) -> None:
    out = tmp_path / "p.yaml"
    config = dataclasses.replace(CalibrateConfig(), **FAST)
    run = calibrate_for_engine(tiny, 0.3, "trtllm", data=word_prompts(6), out=out, config=config)
    recorded = read_profile(out).calibration.engine
    assert recorded == run.choice.recipe and recorded.engine == "trtllm"
    assert recorded.kv_cache_dtype in ENGINE_SPACES["trtllm"].dtypes.values()
    assert run.ppl_full <= recorded.ppl + 1e-9  # a window never helps the full cache's own references
    with pytest.raises(KvtoolError, match="unknown engine"):
        calibrate_for_engine(tiny, 0.3, "sglang", data=word_prompts(6), out=tmp_path / "q.yaml", config=config)
    assert not (tmp_path / "q.yaml").exists()


def test_the_cli_calibrates_for_an_engine_and_exports_what_it_measured(tiny_llama_dir, tmp_path, monkeypatch, capsys) -> None:
    import json

    from cli_runner import run

    data = tmp_path / "words.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": r.prompt}) for r in word_prompts(4)) + "\n")
    out = tmp_path / "p.yaml"
    base = ("calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "4", "--papers", "--draft", "none",
            "--reference-tokens", "6", "--data", str(data), "--out")
    code, stdout, stderr = run(monkeypatch, capsys, *base, str(out), "--engine", "vllm")
    assert code == 0, stderr
    recipe = read_profile(out).calibration.engine
    assert recipe.engine == "vllm" and f"PPL {recipe.ppl:.3f} against kvtool's {recipe.kvtool_ppl:.3f}" in stdout
    code, exported, stderr = run(monkeypatch, capsys, "export", str(out), "--engine", "vllm")
    assert code == 0 and exported.startswith("vllm serve ") and f"this recipe's {recipe.ppl:g}" in exported
    code, stdout, stderr = run(monkeypatch, capsys, *base, str(tmp_path / "q.yaml"), "--engine", "sglang")
    assert code == 2 and stderr.strip() == "error: unknown engine 'sglang' (known: vllm, trtllm)"
    assert not (tmp_path / "q.yaml").exists()


def test_a_hybrid_models_own_sliding_layers_keep_their_window() -> None:
    """Gemma 3's sliding layers, given no window of the engine's, are the model's own: the emulation
    with nothing changed is the model's own forward."""
    from tiny_models import tiny_gemma3

    model = tiny_gemma3()
    g = torch.Generator().manual_seed(3)
    rows = [(torch.randint(3, 97, (20,), generator=g), torch.randint(3, 97, (5,), generator=g))]
    with torch.no_grad():
        ids, ref = rows[0]
        logits = model(input_ids=torch.cat([ids, ref[:-1]])[None]).logits[0, len(ids) - 1:]
    expected = math.exp(float(-torch.log_softmax(logits, -1).gather(1, ref[:, None]).mean()))
    assert emulated_ppl(model, Servable((None,) * 4), rows) == pytest.approx(expected, rel=1e-9)
    assert emulated_ppl(model, Servable((None, 6, None, None)), rows) != pytest.approx(expected, rel=1e-6)
