"""Fixed slots (runtime/layer/fixed.py) over quantized entries: the stored byte rows of every format.

The eager fixed-slot step encodes the new token before it scatters it into its slot, moves byte
rows when it evicts, and lets attention and the rules read the entries decoded, as the eager steps
do. So for every format a tiny model's greedy decode through fixed slots is the eager decode with
the same storage: the same tokens, logits alike, the same slots holding the same entries. As in
tests/test_fixed_slots.py, a CPU has no CUDA graph; "fixed" runs the steps a graph would replay.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvtool.runtime import attach
from kvtool.runtime.graphed import Decoder
from kvtool.runtime.precision import KVStorage, with_storage
from kvtool.runtime.steps import prompt_forward
from test_fixed_slots import _decode, _HostReads, _prompt, _to_meta, recipe_profile
from test_kv_storage import tiny_llama32

STEPS = 20
FORMATS = ["int8", "fp8", "int4", "int4-g32", "int2-g32", "int8/int4-g32", "int8/native"]


@pytest.fixture(scope="module")
def model():
    model = tiny_llama32(dtype=torch.float64, seed=3)  # head dim 32: the grouped formats need whole groups
    with torch.no_grad():  # sharper attention, so the rules' choices differ between entries
        for layer, scale in zip(model.model.layers, (30.0, 8.0)):
            layer.self_attn.q_proj.weight.mul_(scale)
    return model


def stored_profile(model, recipe: str, spec: str):
    return with_storage(recipe_profile(model, recipe), KVStorage.parse(spec), model)


def decoded(layer, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's first `width` slots as attention reads them (a native half is its dtype's bytes), in float64."""
    keys, values = layer.storage.read(layer.keys[:, :, :width], layer.values[:, :, :width], layer.dtype, layer.head_dim)
    return keys.double(), values.double()


def assert_same_entries(a, b) -> None:
    """Two caches' layers hold the same entries in the same slots, with the same scores."""
    for x, y in zip(a.layers, b.layers):
        assert y.keys.dtype == y.values.dtype == torch.uint8  # byte rows (a native half: its floats' bytes)
        assert np.array_equal(x.kept, y.kept) and np.array_equal(x.tokens, y.tokens) and x.seen == y.seen
        width = min(x.keys.shape[2], y.keys.shape[2])  # eager buffers grow by GROWTH_SLOTS, fixed ones once
        assert not x.valid[:, width:].any() and not y.valid[:, width:].any()
        assert torch.equal(x.valid[:, :width], y.valid[:, :width])
        valid = x.valid[:, :width] if x.order.dim() == 2 else x.valid[:, None, :width]
        assert torch.equal(x.order[..., :width].masked_fill(~valid, -1), y.order[..., :width].masked_fill(~valid, -1))
        entries = x.valid[:, None, :width].expand(-1, x.keys.shape[1], -1)
        for p, q in zip(decoded(x, width), decoded(y, width)):
            torch.testing.assert_close(q[entries], p[entries])
        if x.score is not None:
            torch.testing.assert_close(
                y.score[..., :width].masked_fill(~valid, 0), x.score[..., :width].masked_fill(~valid, 0), rtol=1e-9, atol=1e-9
            )


@pytest.mark.parametrize("spec", FORMATS)
@pytest.mark.parametrize("lengths", [[40], [40, 27]], ids=["one row", "left-padded"])
def test_fixed_slots_over_stored_entries_decode_what_the_eager_steps_decode(model, spec: str, lengths: list[int]) -> None:
    profile = stored_profile(model, "shipped: heavy-hitter, per-head, union", spec)
    prompt = _prompt(lengths)
    eager_tokens, eager_logits, eager = _decode(model, profile, prompt, "eager", steps=STEPS)
    fixed_tokens, fixed_logits, fixed = _decode(model, profile, prompt, "fixed", steps=STEPS)
    assert torch.equal(eager_tokens, fixed_tokens)
    torch.testing.assert_close(fixed_logits, eager_logits, rtol=1e-9, atol=1e-9)
    assert_same_entries(eager, fixed)
    assert sum(int((layer.tokens - layer.kept).sum()) for layer in fixed.layers) > 0  # evictions moved byte rows


@pytest.mark.parametrize(
    "recipe", ["expected-attention, per-head", "fixed-point, shared", "tova, per-head", "prompt-only"],
)
def test_rules_that_read_stored_keys_choose_alike_through_fixed_slots(model, recipe: str) -> None:
    """Rules reading the decoded keys (expected attention), shared heads and other rules: the fixed
    step over int8 / int4-g32 rows is the eager one."""
    profile = stored_profile(model, recipe, "int8/int4-g32")
    prompt = _prompt([40, 27])
    eager_tokens, eager_logits, eager = _decode(model, profile, prompt, "eager", steps=STEPS)
    fixed_tokens, fixed_logits, fixed = _decode(model, profile, prompt, "fixed", steps=STEPS)
    assert torch.equal(eager_tokens, fixed_tokens)
    torch.testing.assert_close(fixed_logits, eager_logits, rtol=1e-9, atol=1e-9)
    assert_same_entries(eager, fixed)


@pytest.mark.parametrize("spec", ["int8", "fp8", "int4", "int8/int4-g32"])
def test_a_fixed_step_over_stored_entries_never_waits_for_the_device(model, spec: str) -> None:
    """Encoding the new token and decoding the slots read nothing on the host (the meta device
    stands in for a GPU, as in tests/test_fixed_slots.py)."""
    profile = stored_profile(model, "shipped: heavy-hitter, per-head, union", spec)
    prompt = _prompt([40, 27])
    meta_model = copy.deepcopy(model).to("meta")
    with torch.inference_mode(), attach(model, profile) as handle:
        cache = handle.new_cache()
        prompt_forward(model, prompt, cache)
        decoder = Decoder(model, cache, 8, "fixed")
    assert all(layer.keys.dtype == torch.uint8 for layer in cache.layers)
    decoder.model = meta_model
    with torch.no_grad(), attach(meta_model, profile):
        _to_meta(cache, meta_model)
        token = torch.zeros(2, 1, dtype=torch.long, device="meta")
        position = torch.zeros(2, 1, dtype=torch.long, device="meta")
        with _HostReads() as reads:
            for _ in range(3):
                decoder(token, position)
    assert reads.found == []
