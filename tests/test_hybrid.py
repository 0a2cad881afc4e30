"""Hybrid models (sliding-window layers beside full ones, or only sliding ones): window-shaped layers,
the whole-cache budget, and the references they must match."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, DynamicCache, MistralConfig, MistralForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.profiles import whole_cache
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.memory import kv_bytes, kv_bytes_full
from kvtool.runtime.methods import method_profile
from tiny_models import GREEDY, VOCAB, left_pad, prompts, tiny_gemma3

NEW = 24
SLIDING = "sliding_attention"


def tiny_mistral(dtype=torch.float64, seed: int = 0) -> MistralForCausalLM:
    """Every layer slides (no layer_types: one `sliding_window` for all, as Mistral's configs say)."""
    torch.manual_seed(seed)
    cfg = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=10, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    model = MistralForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def with_windows(profile, window: int, sinks: int, ratio: float | None = None):
    """`profile` with every sliding layer window-shaped (`window` entries, `sinks` of them first
    tokens) and, where given, every full layer at `ratio`."""
    layers = [
        dataclasses.replace(layer, window=window, sinks=sinks, compress=False, ratio=1.0) if kind == SLIDING
        else (dataclasses.replace(layer, ratio=ratio) if ratio is not None else layer)
        for kind, layer in zip(profile.model.layer_types, profile.layers)
    ]
    return dataclasses.replace(profile, layers=tuple(layers))


def max_score_diff(a, b, row_a=slice(None), row_b=slice(None)) -> float:
    return max((x[row_a] - y[row_b]).abs().max().item() for x, y in zip(a.scores, b.scores))


@pytest.mark.parametrize("lengths", [[40], [40, 23, 31], [5]])
@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mistral], ids=["gemma3", "mistral"])
def test_native_window_equals_unmodified(build, lengths):
    """A sliding layer made a kvtool window of the model's own size (no sinks) is transformers' own."""
    model = build()
    native = model.config.sliding_window - 1
    inputs = left_pad(prompts(lengths))
    profile = with_windows(uniform_profile(model, 1.0), native, 0)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, profile) as handle:
            cache = handle.new_cache()
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
    assert all(isinstance(layer, CompressingLayer) for layer in cache.layers)
    assert torch.equal(ref.sequences, out.sequences)
    assert max_score_diff(ref, out) < 1e-9


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mistral], ids=["gemma3", "mistral"])
def test_budget_one_keeps_sliding_layers_native(build):
    profile = uniform_profile(build(), 1.0)
    assert all(layer.window is None for layer in profile.layers)


def _windowed_reference(model, ids: torch.Tensor, plans: dict[int, tuple[int, int]], fed: torch.Tensor) -> list[torch.Tensor]:
    """Logits, feeding `fed` [1, k] after the prompt, of a full (never trimmed) cache whose decode steps see, in each layer of
    `plans` {layer: (window, sinks)}, only the first `sinks` tokens and the last window - sinks
    before the new one: brute force, one unpadded sequence."""
    name = "kvtool-test-windowed"

    def windowed(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        kwargs.pop("sliding_window", None)
        plan = plans.get(module.layer_idx)
        if plan is not None and query.shape[2] == 1:
            window, sinks = plan
            n = key.shape[2]
            pos = torch.arange(n)
            allow = (pos < sinks) | (pos >= n - 1 - (window - sinks))
            return sdpa_attention_forward(module, query, key, value, allow[None, None, None, :], dropout, scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, sliding_window=None, **kwargs)

    AttentionInterface.register(name, windowed)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        cache = DynamicCache()  # plain layers: a sliding layer's sinks stay for the reference to read
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        out = [logits]
        for t in range(fed.shape[1]):
            token = fed[:, t : t + 1]
            pos = torch.tensor([[ids.shape[1] + t]])
            logits = model(input_ids=token, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    finally:
        model.set_attn_implementation(previous)
    return out


@pytest.mark.parametrize("window,sinks", [(4, 1), (5, 0), (3, 2)])
@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mistral], ids=["gemma3", "mistral"])
def test_shorter_window_equals_brute_force(build, window, sinks):
    model = build()
    ids = left_pad(prompts([30]))["input_ids"]
    profile = with_windows(uniform_profile(model, 1.0), window, sinks)
    plans = {i: (window, sinks) for i, kind in enumerate(profile.model.layer_types) if kind == SLIDING}
    with torch.no_grad():
        with attach(model, profile) as handle:
            cache = handle.new_cache()
            out = model.generate(
                input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, output_logits=True, **with_cache(model, cache), **GREEDY
            )
        ref = _windowed_reference(model, ids, plans, out.sequences[:, ids.shape[1] : -1])
    assert len(out.logits) == len(ref) == NEW
    assert max((a - b).abs().max().item() for a, b in zip(ref, out.logits)) < 1e-6
    for i in plans:
        assert cache.layers[i].kept.tolist() == [window]
        kept_positions = sorted(cache.layers[i].order[0][cache.layers[i].valid[0]].tolist())
        last = out.sequences.shape[1] - 2  # the last fed token's position (generation may stop at EOS)
        assert kept_positions == list(range(sinks)) + list(range(last - (window - sinks) + 1, last + 1))


@pytest.mark.parametrize("scored", [False, True], ids=["recent", "scored"])
@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mistral], ids=["gemma3", "mistral"])
def test_padded_batch_equals_single_runs_with_windows(build, scored, monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module("kvtool.runtime.attach"), "SCORED_WINDOW_ROWS", 2)
    model = build()
    seqs = prompts([41, 17, 30])
    profile = with_windows(uniform_profile(model, 1.0), 4, 1, ratio=0.4)
    profile = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, scored=scored) if layer.window is not None else layer for layer in profile.layers))
    with torch.no_grad(), attach(model, profile) as handle:
        batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
        for i, seq in enumerate(seqs):
            single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
            alone = single.sequences[0, len(seq):]
            assert torch.equal(alone, batch.sequences[i, -NEW:][: len(alone)]), f"sequence {i}"
            assert max_score_diff(single, batch, 0, i) < 1e-9


def test_every_layer_holds_its_share_and_the_full_cache_is_counted_as_stored():
    model = tiny_gemma3()
    inputs = left_pad(prompts([60, 45]))
    profile = with_windows(uniform_profile(model, 1.0), 3, 1, ratio=0.25)
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        model.generate(**inputs, max_new_tokens=40, **with_cache(model, cache), **GREEDY)
        plain = DynamicCache(config=model.config)
        model.generate(**inputs, max_new_tokens=40, **with_cache(model, plain), **GREEDY)
    for i, layer in cache.compressing_layers().items():
        share = layer.plan.keep(layer.tokens)
        assert np.array_equal(layer.kept, share), f"layer {i}"
        if layer.plan.cap is not None:
            assert layer.kept.max() == 3
    # A sliding layer's full cache is its window - 1 entries, as transformers stores it.
    assert kv_bytes_full(cache) == kv_bytes(plain)


def test_global_layers_decode_as_masked_full_attention():
    """The full-attention layers of a hybrid model, compressed, equal full attention masked to the
    entries they keep (the check that found no fault behind Gemma 3's large PPL ratios)."""
    model = tiny_gemma3()
    ids = left_pad(prompts([50]))["input_ids"]
    profile = method_profile("tova", model, 1.0)
    profile = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, ratio=0.3) if layer.compress else layer for layer in profile.layers))
    name = "kvtool-test-kept"
    allowed: dict[int, list[int]] = {}

    def kept_only(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        if not module.is_sliding and module.layer_idx in allowed and query.shape[2] == 1:
            allow = torch.zeros(key.shape[2], dtype=torch.bool)
            allow[allowed[module.layer_idx]] = True
            allow[-1] = True
            return sdpa_attention_forward(module, query, key, value, allow[None, None, None, :], dropout, scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, **kwargs)

    AttentionInterface.register(name, kept_only)
    AttentionMaskInterface.register(name, sdpa_mask)
    worst = 0.0
    with torch.no_grad():
        handle = attach(model, profile)
        cache = handle.new_cache()
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
        handle.detach()
        model.set_attn_implementation(name)
        reference = DynamicCache(config=model.config)
        model(input_ids=ids, cache=reference, use_cache=True)
        for t in range(20):
            token = torch.tensor([[int(logits.argmax())]])
            pos = torch.tensor([[ids.shape[1] + t]])
            for i, layer in cache.compressing_layers().items():
                allowed[i] = layer.order[0][layer.valid[0]].tolist()
            model.set_attn_implementation(name)
            expected = model(input_ids=token, position_ids=pos, cache=reference, use_cache=True).logits[0, -1]
            handle = attach(model, profile)
            logits = model(input_ids=token, position_ids=pos, cache=cache, use_cache=True).logits[0, -1]
            handle.detach()
            worst = max(worst, (logits - expected).abs().max().item())
    assert worst < 1e-6


def test_uniform_hybrid_profile_keeps_the_budget_of_the_whole_cache():
    model = tiny_gemma3()
    profile = uniform_profile(model, 0.5)
    assert profile.budget_tokens == whole_cache.DEFAULT_BUDGET_TOKENS
    shares = whole_cache.shares(profile)
    assert abs(shares["all"] - 0.5) < 0.01  # windows are whole entries


def test_whole_cache_split_solves_the_full_layers_and_refuses_below_the_floor():
    model = tiny_mistral()
    base = uniform_profile(model, 1.0)
    assert whole_cache.is_hybrid(base.model) and base.model.sliding_window == 10
    gemma = uniform_profile(tiny_gemma3(), 1.0)
    gemma = dataclasses.replace(gemma, method=dataclasses.replace(gemma.method, ratios="uniform"))
    split = whole_cache.with_windows(gemma, 0.3, 3, tokens=100, sinks=1)
    assert split.budget_tokens == 100
    # 2 sliding layers keep 3 of 7; 2 full layers keep R of 100: (6 + 200 R) / 214 = 0.3
    ratio = next(layer.ratio for layer in split.layers if layer.compress)
    assert abs(ratio - (0.3 * 214 - 6) / 200) < 1e-9
    assert abs(whole_cache.shares(split)["all"] - 0.3) < 0.01
    with pytest.raises(KvtoolError) as err:
        whole_cache.with_windows(gemma, 0.001, 3, tokens=100, sinks=1)
    assert "\n" not in str(err.value) and "floor" in str(err.value)
    # The floor: sliding layers at their smallest window (2: a quarter of their own 7, at least 2),
    # full layers at 2%.
    assert abs(whole_cache.floor(gemma.model, 100) - (2 * 2 + 2 * 2) / 214) < 1e-12


def test_a_hybrid_profile_rebudgets_the_whole_cache():
    """Another budget keeps the calibrated split in proportion: windows scaled, full layers solved."""
    from kvtool.profiles.whole_cache import rebudget

    gemma = uniform_profile(tiny_gemma3(), 1.0)
    gemma = dataclasses.replace(gemma, method=dataclasses.replace(gemma.method, ratios="uniform"))
    at_03 = whole_cache.with_windows(gemma, 0.3, 4, tokens=100, sinks=1)
    at_05, _ = rebudget(at_03, 0.5)
    assert at_05.budget == 0.5 and at_05.budget_tokens == 100
    assert whole_cache.profile_window(at_05) is None  # 4 * 0.5 / 0.3 -> 7, the model's own
    assert abs(whole_cache.shares(at_05)["all"] - 0.5) < 0.01
    at_01, _ = rebudget(at_03, 0.12)
    assert whole_cache.profile_window(at_01) == 2 and abs(whole_cache.shares(at_01)["all"] - 0.12) < 0.01


@contextlib.contextmanager
def _attention(model, name: str, function):
    """`model` runs `function` as its attention (and sdpa's masks) inside the block."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _prompt_queries_and_keys(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """Every sliding layer's prompt queries and keys (after rotary) and its scaling, from one plain forward."""
    seen = {}

    def capture(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        if getattr(module, "is_sliding", True):  # Mistral's layers all slide and say nothing
            seen[module.layer_idx] = (query.clone(), key.clone(), scaling)
        return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, **kwargs)

    with _attention(model, "kvtool-test-capture", capture):
        model(input_ids=ids, use_cache=False)
    return seen


def _scored_window_positions(query, key, scaling, span: int, window: int, sinks: int, rows: int, pool: int) -> list[int]:
    """Brute force of a scored window's prompt choice, one unpadded sequence: the first `sinks`
    positions, the last `rows`, and the rest of `window` by the attention the last `rows` rows give
    (softmax under the model's sliding mask, averaged over every query head, max-pooled over `pool`
    positions before the last `rows`), among the last `span - 1` positions only; ties to the earlier."""
    n = key.shape[2]
    q = query[0].double()
    k = key[0].double().repeat_interleave(q.shape[0] // key.shape[1], dim=0)
    score = torch.zeros(n, dtype=torch.float64)
    for r in range(n - rows, n):
        logits = torch.einsum("hd,hnd->hn", q[:, r], k) * scaling
        allowed = torch.tensor([r - span < c <= r for c in range(n)])
        score += torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).mean(dim=0)
    pooled = score.clone()
    for c in range(n - rows):
        lo, hi = max(0, c - pool // 2), min(n - rows, c + pool // 2 + 1)
        pooled[c] = score[lo:hi].max()
    fixed = set(range(sinks)) | set(range(n - rows, n))
    candidates = [c for c in range(n - (span - 1), n) if c not in fixed]
    candidates.sort(key=lambda c: (-pooled[c].item(), c))
    return sorted(fixed | set(candidates[: window - len(fixed)]))


def _kept_reference(model, ids: torch.Tensor, kept: dict[int, list[int]], window: int, sinks: int, fed: torch.Tensor) -> list[torch.Tensor]:
    """Logits, feeding `fed` [1, k] after the prompt, of a full cache whose decode steps see, in each
    layer of `kept`, the prompt positions it lists, then each new token; once more than `window` are
    held, the one leaving the model's window goes, else the one (after the first `sinks`) the new
    token attended least, averaged over the query heads: brute force, one unpadded sequence."""
    held = {i: list(positions) for i, positions in kept.items()}
    span = model.config.sliding_window

    def restricted(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        kwargs.pop("sliding_window", None)
        positions = held.get(module.layer_idx)
        if positions is not None and query.shape[2] == 1:
            new = key.shape[2] - 1
            positions.append(new)
            allow = torch.zeros(key.shape[2], dtype=torch.bool)
            allow[positions] = True
            out = sdpa_attention_forward(module, query, key, value, allow[None, None, None, :], dropout, scaling, **kwargs)
            if len(positions) > window:
                candidates = positions[sinks:]
                leaving = [p for p in candidates if p <= new - (span - 1)]
                if leaving:
                    positions.remove(leaving[0])
                else:
                    k = key[0].double().repeat_interleave(query.shape[1] // key.shape[1], dim=0)[:, positions]
                    probs = torch.softmax(torch.einsum("hd,hnd->hn", query[0, :, 0].double(), k) * scaling, dim=-1).mean(dim=0)
                    received = {p: probs[j].item() for j, p in enumerate(positions)}
                    positions.remove(min(candidates, key=lambda p: received[p]))
            return out
        return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, **kwargs)

    with _attention(model, "kvtool-test-kept-window", restricted):
        cache = DynamicCache()  # plain layers keep every entry for the reference to choose from
        out = [model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]]
        for t in range(fed.shape[1]):
            pos = torch.tensor([[ids.shape[1] + t]])
            out.append(model(input_ids=fed[:, t : t + 1], position_ids=pos, cache=cache, use_cache=True).logits[:, -1])
    return out


@pytest.mark.parametrize("window,sinks,rows,pool", [(5, 1, 1, 3), (4, 0, 2, 1), (6, 2, 1, 1)])
@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mistral], ids=["gemma3", "mistral"])
def test_scored_window_equals_brute_force(build, window, sinks, rows, pool, monkeypatch):
    """A scored window keeps its sinks, the last rows and the top-scored rest of the model's own window,
    then drops what each new token attended least (or what leaves the model's window): logits equal
    attention masked to that brute-force choice."""
    import importlib

    attach_module = importlib.import_module("kvtool.runtime.attach")
    monkeypatch.setattr(attach_module, "SCORED_WINDOW_ROWS", rows)
    monkeypatch.setattr(attach_module, "SCORED_WINDOW_POOL", pool)
    model = build()
    span = model.config.sliding_window
    ids = left_pad(prompts([30]))["input_ids"]
    profile = with_windows(uniform_profile(model, 1.0), window, sinks)
    profile = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, scored=True) if layer.window is not None else layer for layer in profile.layers))
    with torch.no_grad():
        captured = _prompt_queries_and_keys(model, ids)
        kept = {i: _scored_window_positions(q, k, s, span, window, sinks, rows, pool) for i, (q, k, s) in captured.items()}
        recent = list(range(sinks)) + list(range(30 - (window - sinks), 30))
        assert any(positions != recent for positions in kept.values()), "the case must score differently from a recent window"
        with attach(model, profile) as handle:
            cache = handle.new_cache()
            model(input_ids=ids, **with_cache(model, cache), use_cache=True)
            for i in kept:
                layer = cache.layers[i]
                assert sorted(layer.order[0][layer.valid[0]].tolist()) == kept[i], f"layer {i}"
            out = model.generate(
                input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, output_logits=True,
                **with_cache(model, handle.new_cache()), **GREEDY,
            )
        ref = _kept_reference(model, ids, kept, window, sinks, out.sequences[:, ids.shape[1] : -1])
    assert max((a - b).abs().max().item() for a, b in zip(ref, out.logits)) < 1e-6


def test_a_scored_full_attention_layer_is_refused():
    model = tiny_gemma3()
    profile = uniform_profile(model, 1.0)
    profile = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, scored=kind != SLIDING) for kind, layer in zip(profile.model.layer_types, profile.layers)))
    with pytest.raises(KvtoolError, match="only a sliding layer given a window of its own can keep scored entries"):
        attach(model, profile)


def test_scored_windows_survive_the_file_and_rebudgeting(tmp_path):
    """`scored` is written only where true (older files stay as they were), read back, and kept when a
    profile is re-budgeted; a window grown to the model's own is transformers' layer again, unscored."""
    from kvtool.profiles import read_profile, save_profile

    model = tiny_gemma3()
    base = uniform_profile(model, 1.0)
    base = dataclasses.replace(base, method=dataclasses.replace(base.method, ratios="uniform"))
    plain = whole_cache.with_windows(base, 0.5, 4, tokens=64)
    scored = whole_cache.with_windows(base, 0.5, 4, tokens=64, scored=True)
    save_profile(plain, tmp_path / "plain.yaml")
    save_profile(scored, tmp_path / "scored.yaml")
    assert "scored" not in (tmp_path / "plain.yaml").read_text()
    again = read_profile(tmp_path / "scored.yaml")
    assert [layer.scored for layer in again.layers] == [kind == SLIDING for kind in again.model.layer_types]
    wider, _ = whole_cache.rebudget(again, 0.6)
    assert all(layer.scored for layer in wider.layers if layer.window is not None)
    whole, _ = whole_cache.rebudget(again, 1.0)
    assert all(layer.window is None and not layer.scored for layer in whole.layers)
