"""Quantized KV storage in the runtime: a layer that stores its kept entries at 8/4/2 bits attends
exactly as brute force over the dequantized entries would, a padded batch equals single runs, the
bytes it reports are the tensors it holds, and a byte budget keeps more entries at lower precision."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.profiles import read_profile, save_profile
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.memory import kv_bytes, kv_bytes_full
from kvtool.runtime.methods import method_profile
from kvtool.runtime.precision import KVStorage, at_storage, entries_for
from kvtool.runtime.storage import storage_format
from tiny_models import GREEDY, VOCAB, left_pad, prompts

NEW = 16
STORAGES = ["int8", "fp8", "int4", "int8/int4-g32", "int2-g32"]


def tiny_llama32(dtype=torch.float64, seed: int = 0) -> LlamaForCausalLM:
    """Tiny Llama with GQA and a head dim of 32 (the grouped formats need whole groups)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


class DequantizedLayer(DynamicLayer):
    """Brute force: transformers' own layer holding every entry quantized and dequantized at once,
    the prompt's forward attending to its own keys at full precision (as kvtool's does)."""

    def __init__(self, storage: KVStorage):
        super().__init__()
        self.formats = storage_format(storage.keys), storage_format(storage.values)

    def _round_trip(self, x, fmt):
        return fmt.decode(fmt.encode(x.to(torch.float64)), torch.float64).to(x.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        stored_k = self._round_trip(key_states, self.formats[0])
        stored_v = self._round_trip(value_states, self.formats[1])
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = stored_k, stored_v
            return key_states, value_states  # the prompt attends at full precision
        self.keys = torch.cat([self.keys, stored_k], dim=-2)
        self.values = torch.cat([self.values, stored_v], dim=-2)
        return self.keys, self.values


def dequantized_cache(model, storage: KVStorage) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    cache.layers = [DequantizedLayer(storage) for _ in cache.layers]
    return cache


@pytest.mark.parametrize("spec", STORAGES)
def test_every_entry_kept_attends_as_brute_force_over_dequantized_entries(spec):
    model = tiny_llama32()
    storage = KVStorage.parse(spec)
    profile = dataclasses.replace(uniform_profile(model, 1.0), layers=tuple(
        dataclasses.replace(layer, keys_format=storage.keys, values_format=storage.values)
        for layer in uniform_profile(model, 1.0).layers))
    inputs = left_pad(prompts([30, 19]))
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, dequantized_cache(model, storage)), **GREEDY)
        with attach(model, profile) as handle:
            cache = handle.new_cache()
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, out.scores)) < 1e-9
    layer = cache.layers[0]
    assert isinstance(layer, CompressingLayer) and layer.keys.dtype == torch.uint8  # stored rows, not floats


@pytest.mark.parametrize("spec", ["int8", "int8/int4-g32"])
def test_padded_batch_equals_single_runs_at_low_precision(spec):
    model = tiny_llama32()
    seqs = prompts([61, 37, 50])
    profile = method_profile("tova", model, 0.05, storage=KVStorage.parse(spec))
    assert all(0.05 < layer.ratio < 1 for layer in profile.layers)
    with torch.no_grad(), attach(model, profile) as handle:
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            alone = single.sequences[0, len(seq):]
            assert torch.equal(alone, batch.sequences[i, -NEW:][: len(alone)]), f"sequence {i}"


@pytest.mark.parametrize("spec", STORAGES)
def test_reported_bytes_are_the_stored_rows_and_stay_at_the_byte_budget(spec):
    model = tiny_llama32(torch.float32)
    storage = KVStorage.parse(spec)
    budget = 0.1
    profile = method_profile("tova", model, budget, storage=storage)
    entries = entries_for(budget, storage, model)
    assert all(layer.ratio == pytest.approx(entries) for layer in profile.layers) and profile.budget == budget
    n = 400
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        model.generate(**left_pad(prompts([n])), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
    keys_bytes = storage_format(storage.keys).bytes_per_entry(32, 4)
    values_bytes = storage_format(storage.values).bytes_per_entry(32, 4)
    for layer in cache.layers:
        slots = layer.keys.shape[2]
        assert layer.keys.shape[3] == keys_bytes and layer.values.shape[3] == values_bytes
        assert layer.physical_bytes() == sum(
            t.numel() * t.element_size() for t in (layer.keys, layer.values, layer.valid, layer.order, layer.frozen,
                                                   layer.score, layer.image, layer.attention, layer._prompt_rank)
            if t is not None)
        held, tokens = int(layer.kept.max()), int(layer.tokens.max())
        assert held == pytest.approx(entries * tokens, abs=1) and slots >= held
    full = kv_bytes_full(cache)
    assert full == 2 * 2 * 2 * tokens * 32 * 4  # layers x (K, V) x KV heads x tokens x D x float32
    kv = sum(2 * int(layer.kept.max()) * (keys_bytes + values_bytes) for layer in cache.layers)
    assert kv / full == pytest.approx(budget, rel=0.05)
    assert kv_bytes(cache) >= kv


def test_lower_precision_keeps_more_entries_at_the_same_bytes():
    model = tiny_llama32(torch.float32)
    shares = {spec: method_profile("tova", model, 0.1, storage=KVStorage.parse(spec)).layers[0].ratio
              for spec in ("native", "int8", "int4", "int2-g32")}
    assert shares["native"] == pytest.approx(0.1)
    assert shares["native"] < shares["int8"] < shares["int4"] < shares["int2-g32"]
    assert shares["int8"] == pytest.approx(0.1 * 128 / 36)  # 32 floats = 128 bytes against 32 + 4


def test_a_profile_records_its_formats_and_an_old_one_reads_native(tmp_path):
    model = tiny_llama32(torch.float32)
    plain = uniform_profile(model, 0.2)
    stored = at_storage(plain, KVStorage.parse("int8/int4-g32"), model)
    save_profile(stored, tmp_path / "p.yaml")
    text = (tmp_path / "p.yaml").read_text()
    assert "keys_format: int8" in text and "values_format: int4-g32" in text
    again = read_profile(tmp_path / "p.yaml")
    assert again.layers == stored.layers and again.budget == 0.2
    save_profile(plain, tmp_path / "old.yaml")
    assert "format" not in (tmp_path / "old.yaml").read_text()
    assert all(layer.keys_format == "native" for layer in read_profile(tmp_path / "old.yaml").layers)


def test_bad_formats_are_one_line_errors():
    with pytest.raises(KvtoolError, match="--kv-format takes"):
        KVStorage.parse("int3")
    from tiny_models import tiny_llama  # head dim 16: no whole group of 32
    model = tiny_llama(torch.float32)
    with pytest.raises(KvtoolError, match="32"):
        at_storage(uniform_profile(model, 0.2), KVStorage.parse("int4-g32"), model)


def test_the_profile_format_names_are_the_runtime_formats():
    from kvtool.profiles.schema import KV_FORMATS
    from kvtool.runtime.storage import FORMATS

    assert set(KV_FORMATS) == set(FORMATS)


@pytest.mark.parametrize("spec", ["int8", "fp8"])
def test_folded_scales_give_the_decoded_entries_attention(spec):
    """A folding storage's decode step reads codes and scales (`read_scaled`): codes x scale is the
    decoded entry bit for bit, and attention with the scales folded into scores and probabilities is
    attention over the decoded entries (masked slots and per-head probabilities included)."""
    from kvtool.runtime.importance import decode_attention_with_scores
    from kvtool.runtime.layer.stored import EntryStorage

    torch.manual_seed(0)
    storage = EntryStorage(spec, spec)
    assert storage.folds and not EntryStorage("int8", "int4-g32").folds and not EntryStorage().folds
    keys, values, query = torch.randn(2, 3, 40, 32) * 3, torch.randn(2, 3, 40, 32), torch.randn(2, 6, 1, 32)
    rows = storage.write(keys, values)
    decoded_keys, decoded_values = storage.read(*rows, torch.float32, 32)
    key_codes, key_scale, value_codes, value_scale = storage.read_scaled(*rows, torch.float32, 32, torch.float32)
    assert torch.equal(key_codes * key_scale[..., None], decoded_keys)
    assert torch.equal(value_codes * value_scale[..., None], decoded_values)
    mask = (torch.arange(40) < torch.tensor([[40], [27]]))[:, None, None, :]
    for per_head in (False, True):
        want, want_p = decode_attention_with_scores(query, decoded_keys, decoded_values, mask, 32**-0.5, per_head)
        got, got_p = decode_attention_with_scores(
            query, key_codes, value_codes, mask, 32**-0.5, per_head, key_scale=key_scale, value_scale=value_scale
        )
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5) and torch.allclose(got_p, want_p, atol=1e-6)
        assert torch.all(got_p[1][..., 27:] == 0) if per_head else torch.all(got_p[1, 27:] == 0)
