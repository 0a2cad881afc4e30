"""benchmarks/head_budgets.py, the AdaKV probe: its three allocations against a brute force, and its
masked attention against the model's own (all kept) and against eager attention (some dropped)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface

from benchmark_scripts import load_benchmark
from tiny_models import prompts, tiny_llama


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("head_budgets")


def test_allocations_match_a_brute_force(probe):
    g = torch.Generator().manual_seed(3)
    hkv, n, k, alpha = 3, 60, 20, 0.2
    score = torch.rand(hkv, n, generator=g, dtype=torch.float64)
    score[2] *= 5  # one head's scores run higher: AdaKV gives it more
    masks = probe.keep_masks(score, k, alpha)
    protected = set(range(probe.SINKS)) | set(range(n - probe.RECENT, n))
    ranked = [[math.inf if j in protected else float(score[h, j]) for j in range(n)] for h in range(hkv)]
    top = lambda values, count: set(sorted(range(len(values)), key=lambda j: -values[j])[:count])  # noqa: E731
    for h in range(hkv):
        assert set(masks["per-head"][h].nonzero().flatten().tolist()) == top(ranked[h], k)
    mean = [sum(ranked[h][j] for h in range(hkv)) / hkv for j in range(n)]
    for h in range(hkv):
        assert set(masks["shared"][h].nonzero().flatten().tolist()) == top(mean, k)
    floor = max(int(alpha * k), probe.SINKS + probe.RECENT)
    guaranteed = {(h, j) for h in range(hkv) for j in top(ranked[h], floor)}
    rest = sorted(((h, j) for h in range(hkv) for j in range(n) if (h, j) not in guaranteed), key=lambda p: -ranked[p[0]][p[1]])
    expected = guaranteed | set(rest[: hkv * k - len(guaranteed)])
    got = {(h, j) for h, j in masks["adakv"].nonzero().tolist()}
    assert got == expected and len(got) == hkv * k
    counts = masks["adakv"].sum(dim=1)
    assert int(counts[2]) > k and bool((counts >= floor).all())
    assert all(all(bool(m[h, j]) for h in range(hkv) for j in protected) for m in masks.values())


def test_the_unions_adakv_splits_the_layer_between_the_two_lists(probe):
    g = torch.Generator().manual_seed(5)
    hkv, n, k = 3, 300, 60
    scores = {"window": torch.rand(hkv, n, generator=g, dtype=torch.float64),
              "attention-sum": torch.rand(hkv, n, generator=g, dtype=torch.float64)}
    scores["window"][1] *= 4
    kept = probe.union_adakv(scores, k, 0.2)
    window = probe.keep_masks(scores["window"], k // 2, 0.2)["adakv"]
    assert bool((kept >= window).all()) and int(kept.sum()) == hkv * k
    for h in range(hkv):
        rest = [j for j in range(n) if not window[h, j]]
        top = sorted(rest, key=lambda j: -float(scores["attention-sum"][h, j]))[: k - k // 2]
        assert set(kept[h].nonzero().flatten().tolist()) == set(window[h].nonzero().flatten().tolist()) | set(top)
    assert int(kept[1].sum()) > k


def test_masked_attention_is_the_models_when_all_is_kept_and_eager_when_not(probe):
    model = tiny_llama(dtype=torch.float32)
    ids = prompts([14])[0][None]
    n = 10
    expected = model(ids).logits
    hooked = probe.Probe()
    AttentionInterface.register("head_budgets_test", hooked)
    model.set_attn_implementation("head_budgets_test")
    try:
        hooked.prompt_len = n
        hooked.mode = "score"
        model(ids[:, :n])
        assert set(hooked.scores) == set(range(len(model.model.layers)))
        hooked.mode = "mask"
        hooked.keep = {layer: torch.ones_like(s["window"], dtype=torch.bool) for layer, s in hooked.scores.items()}
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
        # Drop prompt column 3 in KV head 0 of every layer: rows up to n are unchanged, later ones move.
        for keep in hooked.keep.values():
            keep[0, 3] = False
        dropped = model(ids).logits
        torch.testing.assert_close(dropped[:, :n], expected[:, :n], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(dropped[:, n:], expected[:, n:], atol=1e-4)
        AttentionInterface.register("head_budgets_loop", loop_attention(n, dropped_head=0, dropped_column=3))
        model.set_attn_implementation("head_budgets_loop")
        reference = model(ids).logits
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(dropped, reference, rtol=1e-5, atol=1e-5)


def loop_attention(n: int, dropped_head: int, dropped_column: int):
    """Eager attention row by row and head by head, in float64: every query head of KV head
    `dropped_head` skips prompt column `dropped_column` from row n on."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        _, hq, rows, dim = query.shape
        group = hq // key.shape[1]
        out = torch.zeros(1, rows, hq, dim, dtype=torch.float64)
        for q in range(hq):
            h = q // group
            for i in range(rows):
                columns = [j for j in range(i + 1) if not (i >= n and h == dropped_head and j == dropped_column)]
                logits = torch.stack([query[0, q, i].double() @ key[0, h, j].double() * scaling for j in columns])
                weights = torch.softmax(logits, dim=0)
                out[0, i, q] = sum(w * value[0, h, j].double() for w, j in zip(weights, columns))
        return out.to(query.dtype), None

    return forward


def test_union_ranks_by_the_better_of_the_two_ranks(probe):
    scores = {"attention-sum": torch.tensor([[0.1, 0.9, 0.5, 0.3]]), "window": torch.tensor([[0.8, 0.2, 0.1, 0.4]])}
    # ranks as shares of 4: sums 0.25, 1, 0.75, 0.5; window 1, 0.5, 0.25, 0.75
    torch.testing.assert_close(probe.union(scores), torch.tensor([[1.0, 1.0, 0.75, 0.75]]))
