"""kernels/triton_step.py: the shipped recipe's fixed-slot decode step in four Triton kernels.

Run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), in float32, against the eager
fixed-slot step in float64 (which tests/test_fixed_slots.py checks against the eager steps): the same
tokens, logits within float32 rounding, and every layer's entries, counters and scores alike after
20 steps with an eviction in most of them, over native entries and over int8 / fp8 byte rows (the
loads of kernels/stored_loads.py checked byte by byte against torch's decoding). benchmarks/cuda_check.py
repeats the native comparison on a GPU with the step captured as a CUDA graph.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from kvtool.runtime import uniform_profile  # noqa: E402
from kvtool.runtime.kernels import step_compile, stored_loads, triton_scores, triton_step  # noqa: E402
from kvtool.runtime.precision import KVStorage, with_storage  # noqa: E402
from kvtool.runtime.settings import use_settings  # noqa: E402
from test_fixed_slots import RECIPES, _decode, _prompt  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

SHIPPED = RECIPES["shipped: heavy-hitter, per-head, union"]
STEPS = 20


@pytest.fixture(scope="module")
def models():
    model = tiny_llama(dtype=torch.float64, layers=3, seed=3)
    with torch.no_grad():  # sharper attention, so the victims differ clearly between entries
        for layer, scale in zip(model.model.layers, (30.0, 8.0, 1.0)):
            layer.self_attn.q_proj.weight.mul_(scale)
    return model, copy.deepcopy(model).float()


@pytest.fixture()
def fused(monkeypatch):
    """The fused step on, in the interpreter; the list of its calls."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    step = triton_step.decode_step

    def counted(*args, **kwargs):
        calls.append(args[3]["keys"].shape)
        return step(*args, **kwargs)

    monkeypatch.setattr(triton_step, "decode_step", counted)
    with use_settings(fused_decode_step=True):
        yield calls


@pytest.mark.parametrize(
    "lengths, programs, split_gains",
    [([40, 27], triton_step.TARGET_PROGRAMS, True), ([40], 1, True), ([80, 60], triton_step.TARGET_PROGRAMS, True),
     ([40, 27], triton_step.TARGET_PROGRAMS, False)],
    ids=["left-padded, many splits of one block", "one row, one split of several blocks",
         "victims in later splits", "victim search in one program"],
)
def test_the_fused_step_decodes_what_the_eager_step_decodes(models, fused, monkeypatch, lengths, programs, split_gains) -> None:
    monkeypatch.setattr(triton_step, "TARGET_PROGRAMS", programs)
    model, single = models
    profile = uniform_profile(model, 0.3, SHIPPED)
    prompt = _prompt(lengths)
    eager_tokens, eager_logits, eager = _decode(model, profile, prompt, "fixed", steps=STEPS)
    calls_before = len(fused)
    with use_settings(split_victim_search=split_gains):
        tokens, logits, cache = _decode(single, profile, prompt, "fixed", steps=STEPS)
    assert len(fused) - calls_before == STEPS * 3  # every step of every layer went through the kernels
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits.double(), eager_logits, rtol=1e-5, atol=1e-5)
    assert _same_state(eager, cache) > 0


def _same_state(eager, cache) -> int:
    """The caches' layers hold the same entries (as attention reads them), counters and scores;
    returns the entries the eager one evicted."""
    evicted = 0
    for a, b in zip(eager.layers, cache.layers):
        assert np.array_equal(a.kept, b.kept) and np.array_equal(a.tokens, b.tokens) and a.seen == b.seen
        assert torch.equal(a.valid, b.valid)  # the same slots hold entries: the same victims, moved alike
        valid = a.valid[:, None, :]
        assert torch.equal(a.order.masked_fill(~valid, -1), b.order.masked_fill(~valid, -1))
        keys = a.valid[:, None, :].expand(-1, a.keys.shape[1], -1)
        for x, y in zip(a.storage.read(a.keys, a.values, a.dtype, a.head_dim), b.storage.read(b.keys, b.values, b.dtype, b.head_dim)):
            torch.testing.assert_close(y[keys].double(), x[keys].double(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            b.score.double().masked_fill(~valid, 0), a.score.masked_fill(~valid, 0), rtol=1e-5, atol=1e-5
        )
        evicted += int((a.tokens - a.kept).sum())
    return evicted


@pytest.mark.parametrize("spec", ["int8", "fp8", "int8/native", "native/fp8"])
def test_the_fused_step_over_stored_rows_decodes_what_the_eager_step_decodes(models, fused, spec: str) -> None:
    """Keys and values stored as int8 / fp8 byte rows (either alone): the kernels read the codes and
    scales, the new token goes in as the row `storage.write` gives, and the step is the eager one's."""
    model, single = models
    profile = with_storage(uniform_profile(model, 0.3, SHIPPED), KVStorage.parse(spec), model)
    prompt = _prompt([40, 27])
    eager_tokens, eager_logits, eager = _decode(model, profile, prompt, "fixed", steps=STEPS)
    calls_before = len(fused)
    tokens, logits, cache = _decode(single, profile, prompt, "fixed", steps=STEPS)
    assert len(fused) - calls_before == STEPS * 3
    assert all(layer.keys.dtype == torch.uint8 for layer in cache.layers)
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits.double(), eager_logits, rtol=1e-5, atol=1e-5)
    assert _same_state(eager, cache) > 0


@pytest.mark.parametrize("spec", ["int4", "int8/int4"])
def test_formats_the_kernels_do_not_read_keep_the_eager_step(models, fused, spec: str) -> None:
    _, single = models
    profile = with_storage(uniform_profile(single, 0.3, SHIPPED), KVStorage.parse(spec), single)
    prompt = _prompt([40, 27])
    calls_before = len(fused)
    tokens, logits, _ = _decode(single, profile, prompt, "fixed", steps=STEPS)
    assert len(fused) == calls_before
    with use_settings(fused_decode_step=False):
        plain_tokens, plain_logits, _ = _decode(single, profile, prompt, "fixed", steps=STEPS)
    assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits)


def _read_rows(Rows, Entries, W, D: tl.constexpr, BLOCK: tl.constexpr, FORMAT: tl.constexpr):
    """Row r of `Rows` [R, W] bytes (D codes, then a float32 scale), decoded into Entries[r]."""
    r = tl.program_id(0)
    dims = tl.arange(0, BLOCK)
    ok = dims < D
    row = Rows + r * W
    scale = stored_loads.scale(row + D, 1, tl.full([], 1, tl.int1), FORMAT)
    tl.store(Entries + r * D + dims, stored_loads.codes(row + dims, ok, FORMAT).to(tl.float32) * scale, mask=ok)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_kernels_decode_every_code_and_scale_as_torch_does(monkeypatch, fmt: str) -> None:
    """Every byte as a code (fp8: all but its two NaNs, which the format never stores) and scales
    of every magnitude, decoded by `stored_loads` in the interpreter, against torch's decoding of
    the same bytes (`Int8Format.decode` / `Fp8Format.decode`: code x scale in float32), bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    codes = torch.arange(256, dtype=torch.uint8)
    if fmt == "fp8":
        codes = codes[(codes & 0x7F) != 0x7F]
    dim = 16
    codes = torch.cat([codes, codes[: -len(codes) % dim]]).view(-1, dim)
    g = torch.Generator().manual_seed(0)
    scales = torch.randn(len(codes), generator=g) * torch.logspace(-40, 30, len(codes))
    rows = torch.cat([codes, scales[:, None].view(torch.uint8)], dim=1).contiguous()
    entries = torch.empty(len(codes), dim)
    (kernel,) = triton_scores.wrapped(_read_rows)
    kernel[(len(codes),)](rows, entries, rows.shape[1], D=dim, BLOCK=dim, FORMAT=stored_loads.FORMATS[fmt])
    expected = codes.view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn).float() * scales[:, None]
    assert torch.equal(entries.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("recipe", ["tova, per-head", "fixed-point, shared", "prompt-only"])
def test_layers_the_kernels_do_not_cover_keep_the_eager_step(models, fused, recipe: str) -> None:
    """Other rules and shared heads step as before, with `fused_decode_step` on."""
    _, single = models
    profile = uniform_profile(single, 0.3, RECIPES[recipe])
    prompt = _prompt([40, 27])
    calls_before = len(fused)
    tokens, logits, _ = _decode(single, profile, prompt, "fixed", steps=STEPS)
    assert len(fused) == calls_before
    with use_settings(fused_decode_step=False):
        plain_tokens, plain_logits, _ = _decode(single, profile, prompt, "fixed", steps=STEPS)
    assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits)


@pytest.mark.parametrize("formats", [("native", "native"), ("int8", "int8"), ("fp8", "native")], ids="/".join)
def test_the_kernels_compile_for_an_h100(formats) -> None:
    """The interpreter runs what the compiler may refuse: each kernel compiles for sm_90 in bfloat16
    at Llama-3.1-8B's head dim and group (Triton ships ptxas, no GPU needed), without spilling,
    over native entries and over stored rows."""
    report = step_compile.compile_report(torch.bfloat16, head_dim=128, groups=4, arch=90, formats=formats)
    assert set(report) == {"partials", "finish", "gains", "place"}
    for name, usage in report.items():
        assert usage.get("stack_bytes") == 0, (name, usage)
