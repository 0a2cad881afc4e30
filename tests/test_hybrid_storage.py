"""Quantized storage on a hybrid model: the whole cache's budget counted in bytes, windows included.

A tiny Gemma 3 whose sliding layers hold 32 entries (window 33), in float64: an int8 entry of 16
values costs 40 of 256 bytes, so the same bytes keep about 6x the entries, and windows of a few
entries at the model's own precision become longer int8 windows."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from kvtool.models.forward import with_cache
from kvtool.profiles import whole_cache
from kvtool.profiles.entry_bytes import entry_share
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.memory import kv_bytes, kv_bytes_full
from kvtool.runtime.precision import NATIVE, KVStorage, at_storage, storage_of
from cli_runner import run
from conftest import make_word_tokenizer
from tiny_models import GREEDY, VOCAB, left_pad, prompts

SLIDING = "sliding_attention"
TOKENS = 64  # the profiles' reference length: the prompt the byte count is checked at
BUDGET = 0.12
INT8 = KVStorage.parse("int8")
NEW = 16


def tiny_gemma3_wide(dtype=torch.float64, seed: int = 0, vocab: int = VOCAB, head_dim: int = 16,
                     kv_heads: int = 1) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1024,
        sliding_window=33, layer_types=[SLIDING, "full_attention", SLIDING, "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = Gemma3ForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def native_split(model, budget: float = BUDGET, window: int = 8):
    """The whole cache at `budget` and TOKENS tokens: windows of `window` entries, one ratio in the full layers."""
    base = uniform_profile(model, 1.0)
    base = dataclasses.replace(base, method=dataclasses.replace(base.method, ratios="uniform"))
    split = whole_cache.with_windows(base, budget, window, tokens=TOKENS)
    return dataclasses.replace(split, method=uniform_profile(model, 1.0).method)


def stored_entry_bytes(cache) -> int:
    """The kept keys' and values' bytes as stored (a slot's validity, position and score left out:
    a few bytes a slot, as much as an int8 entry of 16 values here), transformers' layers whole."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, CompressingLayer):
            row = layer.keys.shape[-1] * layer.keys.element_size() + layer.values.shape[-1] * layer.values.element_size()
            total += int(layer.kept.sum()) * layer.keys.shape[1] * row
        else:
            total += kv_bytes(type("One", (), {"layers": [layer]})())
    return total


def test_int8_keeps_the_budgets_bytes_with_longer_windows_and_more_global_entries():
    model = tiny_gemma3_wide()
    native = native_split(model)
    stored = at_storage(native, INT8, model)
    share = entry_share("int8", "int8", 16, 8)
    assert share == 40 / 256
    assert stored.budget == BUDGET and stored.budget_tokens == TOKENS and stored.native_bytes == 8
    assert storage_of(stored) == INT8
    windows = {layer.window for kind, layer in zip(stored.model.layer_types, stored.layers) if kind == SLIDING}
    assert len(windows) == 1 and 8 < windows.pop() <= 32
    full = [layer.ratio for layer in stored.layers if layer.compress]
    assert min(full) > max(layer.ratio for layer in native.layers if layer.compress)
    assert all((layer.keys_format, layer.values_format) == ("int8", "int8")
               for layer in stored.layers if layer.compress or layer.window is not None)
    # The profile's count: each layer's kept entries at its entry's bytes, over the full cache's.
    rows = {kind: [0.0, 0] for kind in ("sliding_attention", "full_attention")}
    for kind, layer in zip(stored.model.layer_types, stored.layers):
        rows[kind][0] += whole_cache.kept(layer, kind, TOKENS, stored.model) * share
        rows[kind][1] += whole_cache.stored(kind, TOKENS, stored.model)
    assert whole_cache.shares(stored)["all"] == pytest.approx(sum(r[0] for r in rows.values()) / sum(r[1] for r in rows.values()))
    assert whole_cache.shares(stored)["all"] == pytest.approx(BUDGET, abs=0.01)
    # The cache's count after a prompt of TOKENS tokens: the same bytes.
    ids = prompts([TOKENS])[0][None]
    with torch.no_grad(), attach(model, stored) as handle:
        cache = handle.new_cache()
        model(input_ids=ids, **with_cache(model, cache), use_cache=True)
    assert all(isinstance(cache.layers[i], CompressingLayer) and cache.layers[i].storage.names == ("int8", "int8")
               for i in range(4))
    held = stored_entry_bytes(cache)
    assert held / kv_bytes_full(cache) == pytest.approx(whole_cache.shares(stored)["all"], rel=1e-12)
    assert held / kv_bytes_full(cache) == pytest.approx(BUDGET, abs=0.01)
    slots = sum(layer.keys.shape[0] * layer.keys.shape[2] for layer in cache.layers)
    # Beside the entries, at most 16 bytes of bookkeeping a slot, and until the first new token the
    # compressed prompt's ranks (8 bytes a slot).
    assert held <= kv_bytes(cache) <= held + (16 + 8) * slots


def test_windows_grown_past_the_models_own_give_the_rest_to_the_global_layers():
    """At a budget whose int8 windows would pass the model's own window, the windows stay transformers'
    (native, counted at native bytes) where the global layers can pay, or narrow until they can."""
    model = tiny_gemma3_wide()
    stored = at_storage(native_split(model, 0.4, 16), INT8, model)
    for kind, layer in zip(stored.model.layer_types, stored.layers):
        if kind == SLIDING:
            assert layer.window is None or layer.window <= 32
            if layer.window is None:
                assert (layer.keys_format, layer.values_format) == ("native", "native")
    assert whole_cache.shares(stored)["all"] <= 0.4 + 0.01


def test_the_floor_counts_bytes_and_mixed_formats_solve_by_bytes():
    """Below the native floor int8 still pays for the smallest split; full layers in different formats
    (a hand-made profile) are solved on their bytes' mean, the whole cache still at the budget."""
    from kvtool.errors import KvtoolError

    model = tiny_gemma3_wide()
    native = native_split(model)
    least = whole_cache.floor(native.model, TOKENS)
    with pytest.raises(KvtoolError, match="floor"):
        whole_cache.rebudget(native, least / 2)
    low = at_storage(native, INT8, model, budget=least / 2)
    assert whole_cache.shares(low)["all"] == pytest.approx(least / 2, abs=0.01)
    assert whole_cache.shares(low)["all"] <= least / 2 + 1e-9
    stored = at_storage(native, INT8, model)
    mixed = dataclasses.replace(stored, method=dataclasses.replace(stored.method, ratios="uniform"), layers=tuple(
        dataclasses.replace(layer, keys_format="int4", values_format="int4") if i == 3 else layer
        for i, layer in enumerate(stored.layers)))
    again, _ = whole_cache.rebudget(mixed, 0.1)
    assert [(layer.keys_format, layer.window is not None) for layer in again.layers] == \
        [("int8", True), ("int8", False), ("int8", True), ("int4", False)]
    assert whole_cache.shares(again)["all"] == pytest.approx(0.1, abs=0.01)
    assert whole_cache.shares(again)["all"] <= 0.1 + 0.005


def test_native_storage_is_the_profile_itself_and_int8_comes_back():
    model = tiny_gemma3_wide()
    native = native_split(model)
    assert at_storage(native, NATIVE, model) is native and at_storage(native, None, model) is native
    back = at_storage(at_storage(native, INT8, model), NATIVE, model)
    assert storage_of(back) == NATIVE and back.native_bytes is None
    assert whole_cache.shares(back)["all"] == pytest.approx(BUDGET, abs=0.01)
    whole = uniform_profile(model, 1.0)
    assert at_storage(whole, NATIVE, model) is whole
    inputs = left_pad(prompts([40, 23]))
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, at_storage(whole, NATIVE, model)) as handle:
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)


@pytest.mark.parametrize("scored", [False, True], ids=["recent", "scored"])
def test_int8_windows_padded_batch_equals_single_rows(scored):
    model = tiny_gemma3_wide()
    native = native_split(model)
    native = dataclasses.replace(native, layers=tuple(
        dataclasses.replace(layer, scored=scored) if layer.window is not None else layer for layer in native.layers))
    stored = at_storage(native, INT8, model)
    assert all(layer.scored == scored for layer in stored.layers if layer.window is not None)
    seqs = prompts([70, 37, 55])
    with torch.no_grad(), attach(model, stored) as handle:
        cache = handle.new_cache()
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
        assert cache.layers[0].storage.names == ("int8", "int8") and cache.layers[0].plan.cap == stored.layers[0].window
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            alone = single.sequences[0, len(seq):]
            assert torch.equal(alone, batch.sequences[i, -NEW:][: len(alone)]), f"sequence {i}"
            assert max((a[0] - b[i]).abs().max().item() for a, b in zip(single.scores, batch.scores)) < 1e-9


def test_eval_with_int8_on_a_hybrid_reports_the_budgets_bytes(tmp_path, monkeypatch, capsys):
    """`kvtool eval --kv-format int8` on a hybrid profile held at its prompts' length: the measured
    share of the cache's bytes is near the budget (heads of 64 values, so a slot's few bytes of
    bookkeeping stay small beside its entries)."""
    from kvtool.profiles import save_profile

    directory = tmp_path / "gemma3"
    tokenizer = make_word_tokenizer()
    model = tiny_gemma3_wide(torch.float32, vocab=len(tokenizer), head_dim=64, kv_heads=2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    words = " ".join(["the cat sat on the mat and the dog ran to the park"] * 8)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": words, "kind": "document"}) + "\n" for _ in range(2)))
    tokens = len(tokenizer(words).input_ids)
    base = uniform_profile(model, 1.0)
    base = dataclasses.replace(base, method=dataclasses.replace(base.method, ratios="uniform", draft=None))
    save_profile(whole_cache.with_windows(base, 0.2, 8, tokens=tokens), tmp_path / "profile.yaml")
    fractions = {}
    for spec in ("native", "int8"):
        out = tmp_path / f"{spec}.json"
        code, _, stderr = run(monkeypatch, capsys, "eval", str(directory), "--data", str(data), "--budgets", "0.2",
                              "--methods", "kvtool", "--profile", str(tmp_path / "profile.yaml"), "--max-new-tokens", "2",
                              "--kv-format", spec, "--json", str(out))
        assert code == 0, stderr
        fractions[spec] = json.loads(out.read_text())["results"][0]["kv_fraction"]
    # eval counts physical bytes (slot bookkeeping and spare slots too), so only near the budget here.
    assert fractions["int8"] == pytest.approx(0.2, abs=0.05)
    assert fractions["int8"] <= fractions["native"]
