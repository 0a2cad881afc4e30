"""The prompt phase a few rows at a time (runtime/row_groups.py): each row decodes what the batch run gives it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvtool.errors import KvtoolError
from kvtool.profiles import Draft, MethodSettings
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.graphed import Decoder
from kvtool.runtime.draft import prepare
from kvtool.runtime.row_groups import rows_at_once
from kvtool.runtime.steps import Prompt
from tiny_models import left_pad, prompts, tiny_llama

SHIPPED = MethodSettings(eviction="heavy-hitter", heads="per-head", scorer="union", window=4, pool=3)


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(dtype=torch.float64, layers=3, seed=4)
    with torch.no_grad():
        for layer, scale in zip(model.model.layers, (30.0, 8.0, 1.0)):
            layer.self_attn.q_proj.weight.mul_(scale)
    return model


def _run(model, make_cache, prompt: Prompt, draft, rows, mode: str = "eager", steps: int = 16):
    with torch.inference_mode():
        ready = prepare(model, prompt, make_cache, draft, rows=rows)
        decoder = Decoder(model, ready.cache, steps, mode)
        logits, tokens = ready.first_logits, []
        for step in range(steps):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            logits = decoder(token, prompt.next_positions + step)
        decoder.close()
    return torch.cat(tokens, dim=1), ready


@pytest.mark.parametrize("draft", [None, Draft(4, rounds=2, verify=True)], ids=["no draft", "verified draft"])
@pytest.mark.parametrize("rows", [1, 2])
def test_rows_at_a_time_decode_what_the_batch_decodes(model, draft, rows: int) -> None:
    prompt = Prompt.of(left_pad(prompts([41, 30, 36], seed=6)))
    with attach(model, uniform_profile(model, 0.3, SHIPPED)) as handle:
        want, whole = _run(model, handle.bare_cache, prompt, draft, prompt.input_ids.shape[0])
        got, grouped = _run(model, handle.bare_cache, prompt, draft, rows)
        fixed, _ = _run(model, handle.bare_cache, prompt, draft, rows, mode="fixed")
    assert torch.equal(got, want) and torch.equal(fixed, want)
    torch.testing.assert_close(grouped.first_logits, whole.first_logits)
    if draft is not None:
        assert torch.equal(grouped.prefix.tokens, whole.prefix.tokens) and torch.equal(grouped.prefix.lengths, whole.prefix.lengths)
    for a, b in zip(whole.cache.layers, grouped.cache.layers):
        assert np.array_equal(a.kept, b.kept) and a.seen == b.seen


def test_a_plain_cache_joins_its_rows(model) -> None:
    prompt = Prompt.of(left_pad(prompts([41, 30, 36], seed=6)))

    def make():
        return DynamicCache(config=model.config)

    want, whole = _run(model, make, prompt, None, None)
    got, grouped = _run(model, make, prompt, None, 2)
    assert torch.equal(got, want)
    for a, b in zip(whole.cache.layers, grouped.cache.layers):
        torch.testing.assert_close(a.keys, b.keys)


def test_rows_at_a_time_refuse_what_they_cannot_split(model) -> None:
    prompt = Prompt.of(left_pad(prompts([20, 12], seed=6)))
    with attach(model, uniform_profile(model, 0.3, SHIPPED)) as handle:
        with pytest.raises(KvtoolError, match="at least 1"):
            prepare(model, prompt, handle.bare_cache, None, rows=0)
        pixels = Prompt(prompt.input_ids, prompt.attention_mask, prompt.position_ids, extras={"pixel_values": torch.zeros(2, 3)})
        with pytest.raises(KvtoolError, match="image inputs"):
            prepare(model, pixels, handle.bare_cache, None, rows=1)


@pytest.mark.parametrize(
    ("batch", "kept", "want"),
    [(1, 0.2, 1), (2, 0.2, 1), (3, 0.2, 2), (4, 0.2, 2), (8, 0.2, 4), (8, 0.5, 4), (4, 0.7, 1), (5, 0.6, 2)],
)
def test_a_draft_on_a_cpu_splits_the_batch_so_the_held_prompt_fits_under_the_full_cache(model, batch, kept, want) -> None:
    with attach(model, uniform_profile(model, kept, SHIPPED)) as handle:
        cache = handle.bare_cache()
        rows = rows_at_once(batch, Draft(4), cache, model)
        assert rows == want
        groups = -(-batch // rows)
        # The largest group's held prompt beside every row's compressed cache, in rows' worth of a
        # full cache: within the batch's own (a single row cannot be split).
        assert rows + kept * batch <= batch or rows == 1
        if groups > 1:  # no more groups than that takes: one fewer would not fit
            assert -(-batch // (groups - 1)) + kept * batch > batch
        assert rows_at_once(batch, None, cache, model) == batch  # nothing held: all at once
        assert rows_at_once(batch, Draft(4), cache, model, extras=True) == batch


def _shipped_with(model, ratios: list[float], storage: tuple[str, str] | None):
    """The shipped rules at per-layer `ratios`, every layer stored as `storage` (None: native)."""
    import dataclasses

    base = uniform_profile(model, 1.0, SHIPPED)
    keys, values = storage or ("native", "native")
    return dataclasses.replace(base, native_bytes=model.dtype.itemsize, layers=tuple(
        dataclasses.replace(layer, ratio=r, keys_format=keys, values_format=values) for layer, r in zip(base.layers, ratios)
    ))


@pytest.mark.parametrize(
    ("ratios", "storage", "want"),
    [([0.2, 1.0, 0.2], None, 2), ([1.0] * 3, None, 1), ([0.2] * 3, None, 2), ([0.2, 1.0, 0.2], ("int8", "int8"), 2),
     ([1.0] * 3, ("int8", "int4"), 2)],
    ids=["one-whole", "all-whole", "none-whole", "one-whole-int8", "all-whole-int8/int4"],
)
def test_a_layer_that_keeps_everything_counts_its_bytes_and_its_rows_join(model, ratios, storage, want) -> None:
    """A layer at ratio 1.0 (every entry kept, native or quantized) joins the other groups' rows;
    the groups are sized by the bytes the layers keep, and each row decodes what the batch gives it."""
    profile = _shipped_with(model, ratios, storage)
    prompt = Prompt.of(left_pad(prompts([30, 26, 33, 28], seed=2)))
    draft = Draft(4, rounds=2, verify=True)
    with attach(model, profile) as handle:
        assert rows_at_once(4, Draft(4), handle.bare_cache(), model) == want
        whole_tokens, whole = _run(model, handle.bare_cache, prompt, draft, 4)
        for rows in sorted({1, 2, want}):
            tokens, grouped = _run(model, handle.bare_cache, prompt, draft, rows)
            assert torch.equal(tokens, whole_tokens)
            torch.testing.assert_close(grouped.first_logits, whole.first_logits)
            for a, b in zip(whole.cache.layers, grouped.cache.layers):
                assert np.array_equal(a.kept, b.kept) and a.seen == b.seen and a.packed == b.packed
                assert a.storage.names == b.storage.names and a.keys.dtype == b.keys.dtype


def test_held_prompts_in_host_memory_run_the_batch_at_once(model, monkeypatch) -> None:
    from kvtool.runtime.layer import held_prompt

    monkeypatch.setattr(held_prompt, "held_on_host", lambda device: True)
    with attach(model, uniform_profile(model, 0.2, SHIPPED)) as handle:
        assert rows_at_once(4, Draft(4), handle.bare_cache(), model) == 4


def test_the_default_prompt_phase_with_a_draft_is_the_batch_run_rows_at_a_time(model, monkeypatch) -> None:
    """`prepare` without `rows` splits a CPU batch with a draft (`rows_at_once`) and gives each row
    what the whole batch at once gives it."""
    from kvtool.runtime import draft as drafting

    prompt = Prompt.of(left_pad(prompts([41, 30, 36, 33], seed=7)))
    seen = []
    original = drafting._prepare
    monkeypatch.setattr(drafting, "_prepare", lambda model, prompt, *rest: seen.append(prompt.input_ids.shape[0]) or original(model, prompt, *rest))
    with attach(model, uniform_profile(model, 0.3, SHIPPED)) as handle:
        want, whole = _run(model, handle.bare_cache, prompt, Draft(4, rounds=2, verify=True), 4)
        got, default = _run(model, handle.bare_cache, prompt, Draft(4, rounds=2, verify=True), None)
    assert seen == [4, 2, 2]
    assert torch.equal(got, want) and torch.equal(default.prefix.tokens, whole.prefix.tokens)
    for a, b in zip(whole.cache.layers, default.cache.layers):
        assert np.array_equal(a.kept, b.kept)


@pytest.mark.parametrize("whole_int8", [False, True], ids=["uniform-0.2", "half-the-layers-whole-at-int8"])
def test_the_default_prompt_phase_with_a_draft_holds_no_more_tensor_memory_than_the_full_cache(whole_int8) -> None:
    """What a prompt phase has allocated at its most (`bench.peak.track_tensor_peak`, exact bytes):
    a draft's held prompt beside the compressed cache is above the full cache's for the whole batch
    at once, and the default's row groups bring it under; so do they for a calibrated-precision
    profile whose layers keep every entry at 8 bits."""
    from kvtool.bench.peak import track_tensor_peak
    from kvtool.runtime.steps import prompt_forward

    model = tiny_llama(dtype=torch.float32, layers=6, seed=3)
    prompt = Prompt.of(left_pad(prompts([160, 150, 170, 165], seed=8)))
    cpu = torch.device("cpu")
    profile = (_shipped_with(model, [0.2, 1.0] * 3, ("int8", "int8")) if whole_int8
               else uniform_profile(model, 0.2, SHIPPED))
    peaks = {}
    with torch.inference_mode():
        with track_tensor_peak(cpu) as full:
            prompt_forward(model, prompt, DynamicCache(config=model.config))
        with attach(model, profile) as handle:
            for rows in (4, None):
                with track_tensor_peak(cpu) as peak:
                    ready = prepare(model, prompt, handle.bare_cache, Draft(8, rounds=2, verify=True), rows=rows)
                peaks[rows] = peak.bytes
                del ready
            assert rows_at_once(4, Draft(8), handle.bare_cache(), model) == 2
    assert peaks[None] <= full.bytes < peaks[4]


def test_the_tensor_peak_counts_what_a_block_holds_at_its_most() -> None:
    from kvtool.bench.peak import track_tensor_peak

    before = torch.empty(1 << 20)  # made before the block: the block's count never sees it freed
    with track_tensor_peak(torch.device("cpu")) as peak:
        a = torch.empty(1 << 20)  # 4 MiB
        b = torch.empty(2 << 20)
        del a
        c = torch.empty(1 << 19)
        del before
        d = torch.empty(2 << 20)
        del c
    assert peak.bytes == (8 + 2 + 8) << 20  # b, c and d at once
    del b, d
