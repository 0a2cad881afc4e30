"""KV-cache storage formats against float64 references written out plainly here, one loop per vector.

The references take the scale and zero a format stored (float32, or the model's dtype for grouped
formats) and redo the codes in float64; `check_params` separately holds those stored numbers to the
float64 formulas within their dtype's rounding. Where a value sits within float rounding of a
rounding tie, float32 and float64 may pick different neighbours: there the format may take either.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool.runtime.storage import FORMATS, GroupedIntFormat, Stored, storage_format
from kvtool.runtime.storage.base import pack, unpack
from kvtool.runtime.storage.int4 import Int4Format

QUANTIZED = [name for name in FORMATS if name != "native"]
D = 64


def e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Every finite float8 e4m3fn value from its bit fields (bias 7, no infinities, S.1111.111 is NaN);
    -0 is left out, as it duplicates +0."""
    values, mantissas = [], []
    for code in range(256):
        sign, exponent, mantissa = (-1.0 if code & 0x80 else 1.0), (code >> 3) & 15, code & 7
        if code == 0x80 or (exponent == 15 and mantissa == 7):
            continue
        magnitude = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values.append(sign * magnitude)
        mantissas.append(mantissa)
    return np.array(values), np.array(mantissas)


E4M3, E4M3_MANTISSA = e4m3_table()


def nearest_e4m3(t: float) -> tuple[float, float, bool]:
    distance = np.abs(E4M3 - t)
    order = np.lexsort((E4M3_MANTISSA % 2, distance))  # nearest first, even mantissa first on a tie
    best, second = E4M3[order[0]], E4M3[order[1]]
    return best, second, abs(distance[order[1]] - distance[order[0]]) < 1e-6 * max(abs(t), 2.0**-9)


def rounded(t: float, low: float, high: float, half_up: bool = False) -> tuple[float, float, bool]:
    """round(t) clamped to [low, high], the other neighbour, and whether t is within rounding of a tie."""
    q = np.floor(t + 0.5) if half_up else np.round(t)
    other = q - 1 if t < q else q + 1
    return float(np.clip(q, low, high)), float(np.clip(other, low, high)), abs(t - np.floor(t) - 0.5) < 1e-4


def stored_params(name: str, stored: Stored) -> tuple[np.ndarray, np.ndarray | None]:
    """The stored scale and zero as float64, one row per vector."""
    if name == "int4":
        scale, zero = Int4Format.scale_and_zero(stored)
    else:
        scale, zero = stored.scale, stored.zero
    rows = stored.payload[..., 0].numel()
    return scale.double().reshape(rows, -1).numpy(), None if zero is None else zero.double().reshape(rows, -1).numpy()


def check_params(name: str, v: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, eps: float) -> None:
    """The stored parameters are the float64 formulas, within the storage dtype's rounding (`eps`)."""
    if name in ("int8", "fp8"):
        exact = np.abs(v).max() / (127 if name == "int8" else 448)
        assert abs(scale[0] - exact) <= 2**-23 * exact
    elif name == "int4":
        exact = (max(v.max(), 0) - min(v.min(), 0)) / 15
        assert exact * (1 - 2**-23) <= scale[0] <= exact * (1 + 2**-18) + 1e-44
        assert zero[0] == rounded(-min(v.min(), 0) / scale[0], 0, 15, half_up=True)[0] if scale[0] else zero[0] == 0
    else:
        fmt = FORMATS[name]
        for g in range(len(scale)):
            group = v[g * fmt.group:(g + 1) * fmt.group]
            assert group.min() - 2 * eps * abs(group.min()) <= zero[g] <= group.min()
            span = (group.max() - zero[g]) / (2**fmt.bits - 1)
            assert span * (1 - 2**-23) <= scale[g] <= span * (1 + 2 * eps) + 2**-24  # 2**-24: fp16's subnormal step


def reference_vector(name: str, v: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, got: np.ndarray):
    """Float64 dequantized `v` from the stored parameters; `got` is taken only at a tie, checked there."""
    out, bound = np.empty_like(v), np.empty_like(v)
    slack = 1e-6 * max(np.abs(v).max(), 1e-30)  # float32 rounding of the decode's products and sums
    for i, x in enumerate(v):
        if name == "int8":
            s = scale[0]
            q, other, tie = rounded(x / s if s else 0.0, -127, 127)
            value, alt, bound[i] = q * s, other * s, s / 2
        elif name == "fp8":
            s = scale[0]
            e, other, tie = nearest_e4m3(float(np.clip(x / s, -448, 448)) if s else 0.0)
            value, alt, bound[i] = e * s, other * s, s * max(2.0**-4 * abs(x / s if s else 0.0), 2.0**-10)
        elif name == "int4":
            s, zp = scale[0], zero[0]
            q, other, tie = rounded(x / s + zp if s else zp, 0, 15, half_up=True)
            value, alt, bound[i] = (q - zp) * s, (other - zp) * s, s / 2
        else:
            g = i // FORMATS[name].group
            s, z, top = scale[g], zero[g], 2 ** FORMATS[name].bits - 1
            q, other, tie = rounded((x - z) / s if s else 0.0, 0, top)
            value, alt, bound[i] = q * s + z, other * s + z, s / 2
        assert abs(got[i] - value) <= slack or (tie and abs(got[i] - alt) <= slack), (name, i, x, got[i], value)
        out[i] = value if abs(got[i] - value) <= slack else alt
    return out, bound


def reference_decode(name: str, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(format's float32 decode, float64 reference, per-element error bound), one row per vector."""
    stored = FORMATS[name].encode(x)
    got = FORMATS[name].decode(stored, torch.float32).double().reshape(-1, x.shape[-1]).numpy()
    xs = x.double().reshape(-1, x.shape[-1]).numpy()
    scale, zero = stored_params(name, stored)
    eps = torch.finfo(x.dtype).eps if name.endswith("-g32") and x.dtype != torch.float32 else 2**-24
    ref, bound = np.empty_like(xs), np.empty_like(xs)
    for row in range(xs.shape[0]):
        row_zero = None if zero is None else zero[row]
        check_params(name, xs[row], scale[row], row_zero, eps)
        ref[row], bound[row] = reference_vector(name, xs[row], scale[row], row_zero, got[row])
    return got, ref, bound


def sample(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, magnitude: float = 1.0, seed: int = 0):
    """Gaussian vectors of varied size, with one-signed, constant, all-zero and negative-zero rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = x * 10 ** torch.empty(*shape[:-1], 1, dtype=torch.float64).uniform_(-2, 2, generator=g) * magnitude
    flat = x.view(-1, shape[-1])
    flat[0], flat[1], flat[2], flat[3] = 0.0, -0.0, flat[3].abs(), -flat[4].abs()
    flat[5] = flat[5, 0]
    flat[6, 7] *= 50  # an outlier
    top = 0.9 * torch.finfo(dtype).max  # large magnitudes go up to near the dtype's largest value
    return x.clamp(-top, top).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_matches_the_float64_reference_and_its_error_bound(name, dtype):
    for magnitude in (1.0, 30.0 if dtype == torch.float16 else 1e30):
        x = sample((2, 3, 5, D), dtype, magnitude)
        got, ref, bound = reference_decode(name, x)
        xs = x.double().reshape(ref.shape).numpy()
        assert np.all(np.abs(xs - got) <= bound * (1 + 1e-5) + 1e-6 * np.abs(xs).max(-1, keepdims=True))
        assert np.all(got[:2] == 0)
        in_dtype = FORMATS[name].decode(FORMATS[name].encode(x), dtype)
        assert in_dtype.dtype == dtype and torch.equal(in_dtype, torch.from_numpy(got).view(x.shape).to(dtype))


@pytest.mark.parametrize("name", QUANTIZED)
def test_encoding_a_decoded_tensor_again_changes_it_only_by_float_rounding(name):
    fmt, x = FORMATS[name], sample((4, 7, D), seed=1)
    once = fmt.decode(fmt.encode(x), torch.float32)
    twice = fmt.decode(fmt.encode(once), torch.float32)
    assert torch.all((twice - once).abs() <= 1e-5 * x.abs().amax(-1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_is_bit_for_bit(dtype):
    x = sample((3, 4, D), dtype)
    x.view(-1)[:5] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).tiny / 4])
    back = FORMATS["native"].decode(FORMATS["native"].encode(x), dtype)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(back.view(ints), x.view(ints))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_stored_bytes_are_the_tensors_and_bytes_per_entry(name, dtype):
    fmt, x = FORMATS[name], sample((2, 3, 5, 128), dtype)
    stored = fmt.encode(x)
    widths = {"int4": 64, "int4-g32": 64, "int2-g32": 32, "int8": 128, "fp8": 128, "native": 128}
    assert stored.payload.shape == (2, 3, 5, widths[name])
    assert stored.nbytes() == sum(t.numel() * t.element_size() for t in stored.tensors())
    assert stored.nbytes() == fmt.bytes_per_entry(128, x.element_size()) * 30


def test_codes_pack_lowest_bits_first_as_vllm_packs_int4():
    assert pack(torch.tensor([1, 2, 3, 4]), 4).tolist() == [0x21, 0x43]
    assert pack(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    codes = torch.randint(0, 16, (3, D), generator=torch.Generator().manual_seed(7))
    assert torch.equal(unpack(pack(codes, 4), 4), codes.to(torch.uint8))


def test_bytes_per_entry_for_common_head_dims():
    expected = {  # (D, native bytes) -> bytes
        "native": [128, 256, 256, 512], "int8": [68, 68, 132, 132], "fp8": [68, 68, 132, 132],
        "int4": [36, 36, 68, 68], "int4-g32": [40, 48, 80, 96], "int2-g32": [24, 32, 48, 64],
    }
    for name, sizes in expected.items():
        if name in FORMATS:
            got = [FORMATS[name].bytes_per_entry(d, b) for d in (64, 128) for b in (2, 4)]
            assert got == sizes, name


@pytest.mark.parametrize("name", list(FORMATS))
def test_indexing_gathering_growing_and_putting_match_the_decoded_tensor(name):
    fmt = FORMATS[name]
    x, y = sample((2, 3, 6, D), seed=2), sample((2, 3, 2, D), seed=3)
    stored, full = fmt.encode(x.clone()), fmt.decode(fmt.encode(x.clone()), torch.float32)
    part = fmt.decode(fmt.encode(y), torch.float32)
    index = torch.tensor([4, 1])

    def dec(s: Stored) -> torch.Tensor:
        return fmt.decode(s, torch.float32)

    assert torch.equal(dec(stored[1]), full[1]) and torch.equal(dec(stored[:, 1:, ::2]), full[:, 1:, ::2])
    assert torch.equal(dec(stored[..., 2]), full[..., 2, :])
    for dim in (2, -1):
        assert torch.equal(dec(stored.index_select(dim, index)), full.index_select(2, index))
        assert torch.equal(dec(Stored.cat([stored, fmt.encode(y)], dim)), torch.cat([full, part], 2))
    assert torch.equal(dec(stored.to("cpu")), full)
    stored.put(2, index, fmt.encode(y))
    assert torch.equal(dec(stored), full.index_copy(2, index, part))
    stored[:, :, 0:2] = fmt.encode(y)
    assert torch.equal(dec(stored)[:, :, :2], part)


def brute_force_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        for i in range(q.shape[1]):
            scores = [float(q[h, i] @ k[h, j]) / np.sqrt(q.shape[-1]) for j in range(k.shape[1])]
            weights = np.exp(np.array(scores) - max(scores))
            out[h, i] = sum(w * v[h, j] for j, w in enumerate(weights)) / weights.sum()
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_attention_over_decoded_entries_matches_float64_attention_over_the_reference(name):
    fmt = FORMATS[name]
    q, k, v = (torch.randn(2, n, D, generator=torch.Generator().manual_seed(s)) for s, n in ((4, 3), (5, 16), (6, 16)))
    k_hat, v_hat = fmt.decode(fmt.encode(k), torch.float32), fmt.decode(fmt.encode(v), torch.float32)
    out = torch.softmax(q @ k_hat.transpose(-1, -2) / D**0.5, -1) @ v_hat
    if name == "native":
        k_ref, v_ref = k.double().numpy(), v.double().numpy()
    else:
        k_ref, v_ref = (reference_decode(name, t)[1].reshape(t.shape) for t in (k, v))
    np.testing.assert_allclose(out.double().numpy(), brute_force_attention(q.double().numpy(), k_ref, v_ref), atol=2e-6)


@pytest.mark.parametrize("name", list(FORMATS))
def test_zero_vectors_decode_to_zeros(name):
    for x in (torch.zeros(3, D), torch.full((3, D), -0.0), torch.zeros(2, 3, D, dtype=torch.bfloat16)):
        back = FORMATS[name].decode(FORMATS[name].encode(x), torch.float32)
        assert not back.isnan().any() and torch.equal(back, torch.zeros_like(back))


def test_head_dims_a_format_cannot_store_are_refused_in_one_line():
    cases = ((GroupedIntFormat(4, 32), 72, "32"), (FORMATS["int2-g32"], 48, "32"), (FORMATS["int4"], 63, ""))
    for fmt, head_dim, group in cases:
        for call in (lambda: fmt.check(head_dim), lambda: fmt.encode(torch.randn(2, head_dim)),
                     lambda: fmt.bytes_per_entry(head_dim, 2)):
            with pytest.raises(ValueError, match=f"D={head_dim}") as raised:
                call()
            assert group in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="known: native"):
        storage_format("int3")


@pytest.mark.parametrize("name", list(FORMATS))
def test_strided_views_encode_like_their_contiguous_copies(name):
    fmt = FORMATS[name]
    views = (sample((2, 12, D), seed=8)[:, ::2], sample((2, 6, D), seed=9).transpose(0, 1),
             sample((2, 6, 2 * D), seed=10)[..., ::2])
    for x in views:
        assert not x.is_contiguous()
        copy = x.contiguous()
        assert torch.equal(fmt.decode(fmt.encode(x), torch.float32), fmt.decode(fmt.encode(copy), torch.float32))
