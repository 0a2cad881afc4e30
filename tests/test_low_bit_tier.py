"""benchmarks/low_bit_tier.py, the two-tier probe: equal bytes in every arm, tiers by rank, and its
attention against a row-by-row float64 brute force over the entries each tier's format reads back."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface

from benchmark_scripts import load_benchmark
from kvtool.runtime.storage import FORMATS
from tiny_models import prompts, tiny_llama


@pytest.fixture(scope="module")
def tier():
    return load_benchmark("low_bit_tier")


@pytest.mark.parametrize("budget", [0.2, 0.1])
def test_every_arm_spends_the_same_bytes(tier, budget):
    dim = 64
    for name, tiers in tier.arms(budget, dim, 2).items():
        spent = sum(share * FORMATS[fmt].bytes_per_entry(dim, 2) for fmt, share in tiers)
        assert spent == pytest.approx(budget * 2 * dim), name
    plan = tier.arms(0.2, dim, 2)
    assert plan["int8"] == [("int8", pytest.approx(0.2 * 128 / 68))]
    assert [fmt for fmt, _ in plan["int8+int2 @ 0.5"]] == ["int8", "int2-g32"]


def test_tiers_follow_the_rank_with_the_protected_columns_first(tier):
    g = torch.Generator().manual_seed(7)
    hkv, n = 3, 50
    score = torch.rand(hkv, n, generator=g, dtype=torch.float64)
    tiers = [("int8", 0.3), ("int2-g32", 0.4)]
    codes = tier.tier_codes(score, tiers)
    budgets = load_benchmark("head_budgets")  # the protected columns are its
    protected = set(range(budgets.SINKS)) | set(range(n - budgets.RECENT, n))
    for h in range(hkv):
        order = sorted(range(n), key=lambda j: (j not in protected, -float(score[h, j])))
        first, second = math.floor(0.3 * n), math.floor(0.4 * n)
        assert [int(codes[h, j]) for j in order] == [1] * first + [2] * second + [0] * (n - first - second)


def test_tier_attention_matches_a_brute_force(tier):
    model = tiny_llama(dtype=torch.float32)
    ids = prompts([14])[0][None]
    n = 10
    probe = tier.TierProbe()
    AttentionInterface.register("low_bit_tier_test", probe)
    model.set_attn_implementation("low_bit_tier_test")
    try:
        probe.prompt_len = n
        probe.mode = "score"
        model(ids[:, :n])
        hkv = next(iter(probe.scores.values()))["window"].shape[0]
        g = torch.Generator().manual_seed(1)
        probe.codes = {layer: torch.randint(0, 3, (hkv, n), generator=g) for layer in probe.scores}
        probe.formats = ["int8", "int4"]  # the tiny model's head dim, 16, has no group of 32
        probe.mode = "tiers"
        got = model(ids).logits
        AttentionInterface.register("low_bit_tier_loop", loop_attention(n, probe.codes, probe.formats))
        model.set_attn_implementation("low_bit_tier_loop")
        expected = model(ids).logits
        model.set_attn_implementation("sdpa")
        plain = model(ids).logits
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:, :n], plain[:, :n], rtol=1e-5, atol=1e-5)  # the prompt's rows read it exactly
    assert not torch.allclose(got[:, n:], plain[:, n:], atol=1e-3)


def loop_attention(n: int, codes: dict[int, torch.Tensor], formats: list[str]):
    """Row by row and head by head in float64: rows before n see the exact prompt; later rows see
    prompt entry j of KV head h in format formats[code - 1] (none where the code is 0) and every
    later column at int8."""

    def read(name: str, x: torch.Tensor) -> torch.Tensor:
        fmt = FORMATS[name]
        return fmt.decode(fmt.encode(x[None]), x.dtype)[0].double()

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        _, hq, rows, dim = query.shape
        group = hq // key.shape[1]
        layer = codes[module.layer_idx]
        out = torch.zeros(1, rows, hq, dim, dtype=torch.float64)
        for q in range(hq):
            h = q // group
            for i in range(rows):
                keys, values = [], []
                for j in range(i + 1):
                    if i < n:
                        k, v = key[0, h, j].double(), value[0, h, j].double()
                    elif j >= n:
                        k, v = read("int8", key[0, h, j]), read("int8", value[0, h, j])
                    elif layer[h, j] == 0:
                        continue
                    else:
                        name = formats[int(layer[h, j]) - 1]
                        k, v = read(name, key[0, h, j]), read(name, value[0, h, j])
                    keys.append(k)
                    values.append(v)
                weights = torch.softmax(torch.stack([query[0, q, i].double() @ k * scaling for k in keys]), dim=0)
                out[0, i, q] = sum(w * v for w, v in zip(weights, values))
        return out.to(query.dtype), None

    return forward
