"""Query-aware scoring, per-head selection, TOVA and prompt-only eviction, against brute-force references.

References are written from methods.md with plain loops in float64: attention maps from explicit
softmaxes (kernel tests) or from the model's eager attention weights (end-to-end tests), per-head
top-k by sorting, max-pooling by a loop, and a hand-written Llama decoding step over each layer's
and each KV head's own entries, with the eviction rules applied to plain Python lists.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvtool.errors import KvtoolError
from kvtool.runtime import KvtoolCache, attach, uniform_profile
from kvtool.runtime.attach import layer_plans
from kvtool.runtime.eviction import EntryView, evict_rule
from kvtool.runtime.eviction.tova import Tova
from kvtool.runtime.importance import (
    PromptScores,
    ScoreRequest,
    WindowScorer,
    attention_with_importance,
    attention_with_scores,
    decode_attention_with_scores,
)
from kvtool.runtime.importance.block_size import block_rows
from kvtool.runtime.layer import GROWTH_SLOTS, LayerPlan
from kvtool.runtime.merge import merge_rule
from kvtool.runtime.selection import select_rule
from kvtool.models.forward import with_cache
from kvtool.models.queries import future_rotations, output_grams
from kvtool.runtime.importance import LayerQueries
from test_expected_attention import brute_force as brute_force_expected
from test_expected_attention import brute_force_triattention
from tiny_models import GREEDY, left_pad, profile_with, prompts, tiny_llama

HEADS, KV_HEADS, DIM, SCALE = 4, 2, 8, 0.3
GROUPS = HEADS // KV_HEADS


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


# ----- the fused prompt pass: window and per-head sums -------------------------------------------


def causal_probs(q, k, b: int, h: int, start: int) -> torch.Tensor:
    """Brute-force causal attention map [m, m] of query head h over sequence b's real tokens."""
    scores = q[b, h, start:] @ k[b, h // GROUPS, start:].T * SCALE
    future = torch.ones_like(scores, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def brute_force_scores(q, k, starts: list[int], window: int) -> PromptScores:
    bsz, _, n, _ = q.shape
    importance = torch.zeros(bsz, n, dtype=torch.float64)
    heads = torch.zeros(bsz, KV_HEADS, n, dtype=torch.float64)
    last_rows = torch.zeros(bsz, KV_HEADS, n, dtype=torch.float64)
    for b, start in enumerate(starts):
        for h in range(HEADS):
            probs = causal_probs(q.double(), k.double(), b, h, start)
            importance[b, start:] += probs.sum(dim=0) / HEADS
            heads[b, h // GROUPS, start:] += probs.sum(dim=0) / GROUPS
            last_rows[b, h // GROUPS, start:] += probs[-window:].sum(dim=0) / GROUPS
    return PromptScores(importance, heads, last_rows)


def brute_force_pool(raw: list[float], window: int, pool: int) -> list[float]:
    """Max over the `pool` neighbours of every column before the last `window`, inside those columns."""
    m = len(raw)
    edge = max(0, m - window)
    return [
        max(raw[max(0, j - pool // 2) : min(edge, j + pool // 2 + 1)]) if j < edge else raw[j]
        for j in range(m)
    ]


def brute_force_union(asked: list[float], read: list[float], window_share: float = 0.5) -> list[float]:
    """The better of a column's two ranks (1/n = lowest score, 1 = top; ties by position); with a
    window share f, a column's places below the top of each list over that list's share, the
    smaller one ranking it (as a score: higher is better)."""
    def share(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda t: (values[t], t))
        out = [0.0] * len(values)
        for rank, t in enumerate(order):
            out[t] = (rank + 1) / len(values)
        return out

    if window_share == 0.5:
        return [max(a, b) for a, b in zip(share(asked), share(read))]

    def below_top(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=lambda t: (-values[t], -t))  # ties: the later column ranks higher
        out = [0] * len(values)
        for place, t in enumerate(order):
            out[t] = place
        return out

    return [
        -min(a / window_share, b / (1.0 - window_share)) for a, b in zip(below_top(asked), below_top(read))
    ]


def random_prompt(real: list[int], dtype=torch.float64):
    n = max(real)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(len(real), HEADS, n, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(len(real), KV_HEADS, n, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(len(real), KV_HEADS, n, DIM, generator=g, dtype=torch.float64)
    starts = [n - m for m in real]
    columns = torch.arange(n)
    token_valid = columns[None, :] >= torch.tensor(starts)[:, None]
    mask = (token_valid[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()).contiguous()
    for b, start in enumerate(starts):
        # What padded positions of an earlier layer may hold: none of it may reach a real row.
        q[b, :, :start] = k[b, :, :start] = v[b, :, :start] = float("nan")
    return q.to(dtype), k.to(dtype), v.to(dtype), mask, starts, token_valid


REAL = [600, 563, 300, 40]  # several 256-row blocks, left padding, one prompt shorter than some windows


@pytest.mark.parametrize("window", [1, 16, 300])
@pytest.mark.parametrize("path", ["cpu-blocks", "portable-chunks"])
def test_window_and_head_sums_match_brute_force(window, path, monkeypatch):
    from kvtool.runtime.importance import chunked, cpu_path

    if path == "portable-chunks":
        monkeypatch.setattr(cpu_path, "applies", lambda query: False)
        monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", len(REAL) * HEADS * max(REAL) * 100)  # 100-row chunks
    assert block_rows(HEADS, max(REAL)) < max(REAL)  # the longest prompt spans several row blocks
    q, k, v, mask, starts, _ = random_prompt(REAL)
    want = brute_force_scores(q, k, starts, window)

    plain_out, plain_importance = attention_with_importance(q, k, v, mask, SCALE)
    out, scores = attention_with_scores(q, k, v, mask, SCALE, ScoreRequest(window=window))
    # Asking for the window changes nothing else, bit for bit.
    assert torch.equal(out, plain_out) and torch.equal(scores.importance, plain_importance)
    assert scores.heads is None
    assert torch.allclose(scores.window, want.window, atol=1e-10, rtol=0)

    out, scores = attention_with_scores(q, k, v, mask, SCALE, ScoreRequest(heads=True, window=window))
    assert torch.equal(out, plain_out)
    assert torch.allclose(scores.importance, want.importance, atol=1e-10, rtol=0)
    assert torch.allclose(scores.heads, want.heads, atol=1e-10, rtol=0)
    assert torch.allclose(scores.window, want.window, atol=1e-10, rtol=0)
    assert torch.allclose(scores.heads.mean(dim=1), scores.importance, atol=1e-12, rtol=0)
    for b, (start, m) in enumerate(zip(starts, REAL)):
        assert torch.all(scores.window[b, :, :start] == 0) and torch.all(scores.heads[b, :, :start] == 0)
        # Each window row spreads probability 1 per query head: the window sums total min(w, m) per head.
        assert torch.allclose(scores.window[b].sum(dim=-1), torch.full((KV_HEADS,), float(min(window, m)), dtype=torch.float64))


def test_window_sums_in_float32_stay_close():
    q, k, v, mask, starts, _ = random_prompt(REAL, dtype=torch.float32)
    want = brute_force_scores(q, k, starts, 16)
    _, scores = attention_with_scores(q, k, v, mask, SCALE, ScoreRequest(heads=True, window=16))
    assert scores.window.dtype == torch.float32
    assert torch.allclose(scores.window.double(), want.window, atol=1e-4, rtol=0)
    assert torch.allclose(scores.heads.double(), want.heads, atol=1e-3, rtol=0)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("pool", [1, 7])
@pytest.mark.parametrize("window", [1, 16])
def test_window_scorer_pools_real_columns_before_the_window(window, pool, per_head):
    q, k, v, mask, starts, token_valid = random_prompt(REAL)
    _, scores = attention_with_scores(q, k, v, mask, SCALE, ScoreRequest(window=window))
    got = WindowScorer(window=window, pool=pool).score(scores, token_valid, per_head)
    raw = brute_force_scores(q, k, starts, window).window  # [B, Hkv, n]
    if not per_head:
        raw = raw.mean(dim=1, keepdim=True)  # averaged over all query heads
    assert got.shape == ((len(REAL), KV_HEADS, max(REAL)) if per_head else (len(REAL), max(REAL)))
    got = got if per_head else got[:, None]
    for b, start in enumerate(starts):
        assert torch.all(got[b, :, :start] == 0)
        for h in range(raw.shape[1]):
            want = brute_force_pool(raw[b, h, start:].tolist(), window, pool)
            assert torch.allclose(got[b, h, start:], torch.tensor(want, dtype=torch.float64), atol=1e-10, rtol=0)


def test_decode_scores_per_head_match_brute_force():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, HEADS, 1, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(2, KV_HEADS, 9, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(2, KV_HEADS, 9, DIM, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 3] = False
    out, shared = decode_attention_with_scores(q, k, v, mask, SCALE)
    out_h, per_head = decode_attention_with_scores(q, k, v, mask, SCALE, per_head=True)
    assert torch.equal(out, out_h)
    for b in range(2):
        for kv in range(KV_HEADS):
            rows = [torch.softmax((q[b, h, 0] @ k[b, kv].T * SCALE).masked_fill(~mask[b, 0, 0], float("-inf")), -1)
                    for h in range(kv * GROUPS, (kv + 1) * GROUPS)]
            assert torch.allclose(per_head[b, kv], torch.stack(rows).mean(0), atol=1e-14)
    assert torch.allclose(per_head.mean(dim=1), shared, atol=1e-14)


@pytest.mark.parametrize("slots", [9, 640, 700], ids=["short", "chunked", "not a whole number of chunks"])
def test_the_gpu_decode_path_matches_the_float32_one(monkeypatch, slots: int):
    """The path a half-precision model takes on a GPU (products straight into float32, the values'
    product in chunks of slots), run here on float32 inputs through its CPU stand-in: the same
    attention and probabilities as the float32 path, up to summation order."""
    from kvtool.runtime.importance import decode as decode_module

    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, HEADS, 1, DIM, generator=g)
    k = torch.randn(2, KV_HEADS, slots, DIM, generator=g)
    v = torch.randn(2, KV_HEADS, slots, DIM, generator=g)
    mask = torch.rand(2, 1, 1, slots, generator=g) > 0.3
    want = decode_attention_with_scores(q, k, v, mask, SCALE, per_head=True)
    taken = []
    monkeypatch.setattr(decode_module, "_mixed", lambda tensor, acc: taken.append(tensor.shape) or True)
    chunked = []
    real = decode_module._bmm
    monkeypatch.setattr(decode_module, "_bmm", lambda a, b, acc: chunked.append(a.shape) or real(a, b, acc))
    got = decode_attention_with_scores(q, k, v, mask, SCALE, per_head=True)
    assert len(taken) == 2  # both products took the GPU path
    assert (chunked[1][2] == slots // decode_module.SLOT_CHUNK) == (slots == 640)  # chunked only when whole
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----- rule units -----------------------------------------------------------------------------


def test_tova_victim_is_the_least_attended_unfrozen_entry():
    valid = torch.tensor([[True, True, True, True, True, False], [True, True, True, False, False, False]])
    attention = torch.tensor([[0.01, 0.3, 0.2, 0.05, 0.44, 0.0], [0.001, 0.002, 0.997, 0.0, 0.0, 0.0]])
    frozen = torch.tensor([[True, False, False, False, False, False], [True, True, True, False, False, False]])
    share = np.array([4, 2])
    entries = EntryView(valid, torch.zeros(2, 6, dtype=torch.long), frozen, seen=6, share=share, attention=attention)
    # row 0: slot 0 is a sink (lowest, but frozen), so slot 3; row 1: only sinks left, so the lowest of them
    assert Tova().victim(entries).tolist() == [3, 0]
    # Per head: each KV head ranks by its own attention; validity stays per row.
    per_head = torch.stack([attention, attention.flip(-1)], dim=1)  # [B, 2, S]
    entries = EntryView(
        valid, torch.zeros(2, 2, 6, dtype=torch.long), frozen[:, None].expand(2, 2, 6), seen=6, share=share, attention=per_head
    )
    want = []
    for b in range(2):
        row = []
        for h in range(2):
            candidates = [s for s in range(6) if valid[b, s] and not frozen[b, s]] or [s for s in range(6) if valid[b, s]]
            row.append(min(candidates, key=lambda s: (per_head[b, h, s].item(), s)))
        want.append(row)
    assert Tova().victim(entries).tolist() == want


def test_bad_plans_fail_clearly():
    base = dict(ratio=0.5, merge=merge_rule("none"), sink_tokens=2, recent_window=3, truncation_distance=4)
    for bad, message in [
        (dict(heads="each"), "head mode"),
        (dict(scorer="snap"), "scorer"),
        (dict(scorer="window", window=0), "observation window"),
        (dict(scorer="window", pool=4), "pooling kernel"),
    ]:
        with pytest.raises(KvtoolError, match=message) as info:
            LayerPlan(**base, **bad)
        assert "\n" not in str(info.value)
    LayerPlan(**base, scorer="window", window=1, pool=1, heads="per-head")  # valid


# ----- end to end: a hand-written reference over each head's own entries --------------------------

SINK, RECENT, DIST = 2, 3, 4
RATIOS = [0.3, 0.5, 0.2]


def rules_plans(profile, **changes) -> list:
    """`profile`'s plans with `changes`; `queries` (a dict by layer, from `random_queries`) goes to each layer."""
    evict = changes.pop("evict", None)
    if evict is not None:
        changes["evict"] = evict_rule(evict)
    queries = changes.pop("queries", {})
    return [
        None if p is None else dataclasses.replace(p, **changes, queries=queries.get(i))
        for i, p in enumerate(layer_plans(profile))
    ]


def recipe_profile(model, ratios=RATIOS, merge="none"):
    return profile_with(model, ratios, merge=merge, sink_tokens=SINK, recent_window=RECENT, truncation_distance=DIST)


def eager_maps(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the [Hq, n, n] attention map of one unpadded sequence."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return [att[0] for att in out.attentions]


def reference_scores(
    att: torch.Tensor, scorer: str, window: int, pool: int, window_share: float = 0.5, draft: int = 0
) -> torch.Tensor:
    """[Hkv, n] per-head scores (averaged over each KV head's query heads), pooled like the runtime.
    `att` is [Hq, rows, n]: with a draft, its last `draft` rows read the prompt too and join the window."""
    hq, _, n = att.shape
    total = att.sum(dim=1).view(hq // GROUPS, GROUPS, n).mean(dim=1)
    if scorer == "attention-sum":
        return total
    raw = att[:, -(window + draft):].sum(dim=1).view(hq // GROUPS, GROUPS, n).mean(dim=1)
    pooled = [brute_force_pool(row.tolist(), window, pool) for row in raw]
    if scorer == "union":
        pooled = [brute_force_union(a, b.tolist(), window_share) for a, b in zip(pooled, total)]
    return torch.tensor(pooled, dtype=torch.float64)


def brute_force_anchors(score: list[float], keep: int, recent: int) -> list[int]:
    n = len(score)
    protected = list(range(min(SINK, keep)))
    tail = [t for t in range(n - 1, n - 1 - recent, -1) if t not in protected]
    protected += tail[: keep - len(protected)]
    rest = sorted((t for t in range(n) if t not in protected), key=lambda t: (-score[t], t))
    return sorted(protected + rest[: keep - len(protected)])


def nearest_buckets(anchors: list[int], n: int) -> dict[int, list[int]]:
    groups = {a: [] for a in anchors}
    for t in range(n):
        left = max((a for a in anchors if a <= t), default=None)
        right = min((a for a in anchors if a >= t), default=None)
        groups[right if left is None or (right is not None and right - t < t - left) else left].append(t)
    return groups


def reference_step(model, layers, token: int, position: int) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """One Llama decoding step over explicit entries: `layers[l][h]` lists KV head h's entries as dicts.

    Appends the new token's entry to every head and returns the logits and, per layer and KV head,
    the probabilities the new token gave that head's entries (averaged over its query heads).
    """
    inner = model.model
    hidden = inner.embed_tokens(torch.tensor([[token]]))
    cos, sin = inner.rotary_emb(hidden, torch.tensor([[position]]))
    received = []
    for layer, heads in zip(inner.layers, layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outputs, per_head = [], []
        for kv, entries in enumerate(heads):
            entries.append(dict(pos=position, k=k[0, kv, 0], v=v[0, kv, 0], frozen=False, score=0.0))
            keys = torch.stack([e["k"] for e in entries])
            values = torch.stack([e["v"] for e in entries])
            probs = torch.softmax(q[0, kv * GROUPS : (kv + 1) * GROUPS, 0] @ keys.T * attn.scaling, dim=-1)
            outputs.append(probs @ values)
            per_head.append(probs.mean(dim=0))
        hidden = hidden + attn.o_proj(torch.cat(outputs).reshape(1, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        received.append(per_head)
    return model.lm_head(inner.norm(hidden))[0, -1], received


def reference_evict(
    heads: list[list[dict]], received: list[torch.Tensor], rule: str, share: int, seen: int, per_head: bool, queries=None
):
    """Drop one entry per head from a layer over its share, as methods.md defines each rule."""
    if len(heads[0]) <= share or rule == "prompt-only":
        return
    if rule == "tova" and not per_head:
        mean = torch.stack(received).mean(dim=0)  # averaged over every query head of the layer
        received = [mean] * len(heads)
    if rule == "expected-attention":  # ranked as `tova` ranks the new token's attention
        keys = torch.stack([torch.stack([e["k"] for e in entries]) for entries in heads])[None]
        values = torch.stack([torch.stack([e["v"] for e in entries]) for entries in heads])[None]
        valid = torch.ones(1, keys.shape[2], dtype=torch.bool)
        score = brute_force_expected(
            keys, values, valid, queries.mean, queries.cov, queries.rotation, queries.future, starts=[seen]
        )[0]
        received = list(score if per_head else score.mean(dim=0, keepdim=True).expand_as(score))
        rule = "tova"
    if rule == "triattention":  # likewise, by TriAttention's score from the next token's position
        keys = torch.stack([torch.stack([e["k"] for e in entries]) for entries in heads])[None]
        valid = torch.ones(1, keys.shape[2], dtype=torch.bool)
        score = brute_force_triattention(keys, valid, queries.mean, queries.pair_norm, queries.rotation, starts=[seen])[0]
        received = list(score if per_head else score.mean(dim=0, keepdim=True).expand_as(score))
        rule = "tova"
    for kv, entries in enumerate(heads):
        if rule == "fixed-point":
            victim = next(i for i, e in enumerate(entries) if not e["frozen"])  # oldest after the frozen prefix
        elif rule == "tova":
            candidates = [i for i, e in enumerate(entries) if not e["frozen"]] or list(range(len(entries)))
            victim = min(candidates, key=lambda i: (received[kv][i].item(), i))
        else:  # heavy-hitter: lowest accumulated attention outside the newest half of the share
            old = [i for i, e in enumerate(entries) if e["pos"] < seen - share // 2] or list(range(len(entries)))
            victim = min(old, key=lambda i: (entries[i]["score"], i))
        entries.pop(victim)


CASES = {
    # name: (heads, scorer, window, pool, merge, eviction)
    "per-head-sum-fixed-point": ("per-head", "attention-sum", 1, 1, "none", "fixed-point"),
    "per-head-window-tova": ("per-head", "window", 4, 3, "none", "tova"),
    "per-head-window-h2o-position": ("per-head", "window", 6, 7, "position", "heavy-hitter"),
    "per-head-sum-tova-position": ("per-head", "attention-sum", 1, 1, "position", "tova"),
    "shared-tova-prefill-tova": ("shared", "window", 1, 1, "none", "tova"),
    "shared-window-prompt-only": ("shared", "window", 8, 7, "none", "prompt-only"),
    # A recent share protects ceil(share * keep) recent tokens when that is more than the window.
    "shared-window-h2o-share-half": ("shared", "window", 4, 3, "none", "heavy-hitter", 0.5),
    "per-head-sum-fixed-point-share": ("per-head", "attention-sum", 1, 1, "position", "fixed-point", 0.3),
    "per-head-union-tova": ("per-head", "union", 4, 3, "none", "tova"),
    "shared-union-h2o-position": ("shared", "union", 6, 7, "position", "heavy-hitter"),
    "shared-union-fixed-point-share": ("shared", "union", 1, 1, "none", "fixed-point", 0.4),
    # The union with more room for the window's list (its 7th field), or less.
    "per-head-union70-tova": ("per-head", "union", 4, 3, "none", "tova", 0.0, 0.7),
    "shared-union85-h2o-share": ("shared", "union", 6, 7, "none", "heavy-hitter", 0.25, 0.85),
    "shared-union30-tova-position": ("shared", "union", 4, 3, "position", "tova", 0.0, 0.3),
    # H2O seeded by the observation window (pooled as the window scorer pools it), whatever the scorer.
    "per-head-window-h2o-window": ("per-head", "window", 4, 3, "none", "heavy-hitter-window"),
    "shared-union-h2o-window-position": ("shared", "union", 6, 7, "position", "heavy-hitter-window"),
    "per-head-sum-h2o-window": ("per-head", "attention-sum", 5, 3, "none", "heavy-hitter-window"),
    # Expected Attention from (random) calibrated query statistics, against the float64 brute force.
    "per-head-expected-tova": ("per-head", "expected-attention", 1, 1, "none", "tova"),
    "shared-expected-fixed-point-position": ("shared", "expected-attention", 1, 1, "position", "fixed-point", 0.3),
    # ... weighted by what each query head writes through the output projection.
    "per-head-output-tova": ("per-head", "expected-output", 1, 1, "none", "tova"),
    "shared-output-h2o": ("shared", "expected-output", 1, 1, "none", "heavy-hitter", 0.25),
    # Expected Attention while generating, from the entries' true positions.
    "per-head-window-expected": ("per-head", "window", 4, 3, "none", "expected-attention"),
    "shared-expected-expected-position": ("shared", "expected-attention", 1, 1, "position", "expected-attention"),
    # TriAttention's distance-aware score, for the prompt and while generating.
    "per-head-tri-tova": ("per-head", "triattention", 1, 1, "none", "tova"),
    "shared-tri-h2o-share": ("shared", "triattention", 1, 1, "none", "heavy-hitter", 0.25),
    "per-head-union-triattention": ("per-head", "union", 4, 3, "none", "triattention"),
    "shared-tri-triattention-position": ("shared", "triattention", 1, 1, "position", "triattention"),
}


def random_queries(model, seed: int = 5) -> dict[int, LayerQueries]:
    """Query statistics for every layer of `model`: random means, random positive semi-definite covariances."""
    g = torch.Generator().manual_seed(seed)
    rotations, grams = future_rotations(model), output_grams(model)
    out = {}
    for index, rotation in rotations.items():
        root = torch.randn(HEADS, model.config.head_dim, model.config.head_dim, generator=g, dtype=torch.float64)
        mean = 2 * torch.randn(HEADS, model.config.head_dim, generator=g, dtype=torch.float64)
        half = model.config.head_dim // 2
        pair_norm = torch.hypot(mean[:, :half], mean[:, half:]) + torch.rand(HEADS, half, generator=g, dtype=torch.float64)
        out[index] = LayerQueries(
            mean, root @ root.transpose(-1, -2) / 4, rotation, future=7, output=grams[index], pair_norm=pair_norm
        )
    return out


@pytest.mark.parametrize("draft", [0, 5], ids=["prompt", "draft"])
@pytest.mark.parametrize("case", list(CASES))
def test_compressed_decoding_matches_per_head_reference(case, draft):
    """With a draft (`KvtoolCache.set_draft`), the prompt forward runs over the prompt and `draft`
    more tokens: every score counts their rows too (the window grows by them), only prompt columns
    are candidates, and decoding continues from the prompt's end."""
    heads_mode, scorer, window, pool, merge, rule, *extra = CASES[case]
    share = extra[0] if extra else 0.0
    window_share = extra[1] if len(extra) > 1 else 0.5
    per_head = heads_mode == "per-head"
    model = tiny_llama()
    ids = prompts([30])[0][None]
    n = ids.shape[1]
    profile = recipe_profile(model, merge=merge)
    plans = rules_plans(
        profile, heads=heads_mode, scorer=scorer, window=window, pool=pool, evict=rule, recent_share=share,
        window_share=window_share,
    )
    queries = random_queries(model)
    plans = [dataclasses.replace(p, queries=queries[i]) for i, p in enumerate(plans)]
    steps = torch.randint(3, 97, (44,), generator=torch.Generator().manual_seed(7)).tolist()
    recent = max(RECENT, window) if scorer in ("window", "union") else RECENT

    drafted = torch.randint(3, 97, (1, draft), generator=torch.Generator().manual_seed(11))
    rows = window + draft  # the observation window's rows

    with torch.no_grad():
        maps = [m[:, :, :n] for m in eager_maps(model, torch.cat([ids, drafted], dim=1))]  # [Hq, n + draft, n]
        full = KvtoolCache(model.config, [None] * len(RATIOS))
        model(input_ids=ids, **with_cache(model, full))
        layers = []
        for index, ratio in enumerate(RATIOS):
            keep = math.ceil(ratio * n - 1e-9)
            recent_here = max(recent, math.ceil(share * keep)) if share else recent
            if scorer in ("expected-attention", "expected-output"):
                q = queries[index]
                valid = torch.ones(1, n, dtype=torch.bool)
                out_proj = model.model.layers[index].self_attn.o_proj.weight if scorer == "expected-output" else None
                score = brute_force_expected(
                    full.layers[index].keys, full.layers[index].values, valid, q.mean, q.cov, q.rotation, q.future, out_proj
                )[0]
            elif scorer == "triattention":
                q = queries[index]
                score = brute_force_triattention(full.layers[index].keys, torch.ones(1, n, dtype=torch.bool), q.mean, q.pair_norm, q.rotation)[0]
            else:
                score = reference_scores(maps[index], scorer, window, pool, window_share, draft)
            h2o_score = maps[index].sum(dim=1).view(KV_HEADS, GROUPS, n).mean(dim=1)
            if not per_head:
                score = score.mean(dim=0, keepdim=True).expand(KV_HEADS, n)
                if scorer in ("window", "union"):  # shared layers pool the head-averaged score
                    raw = maps[index][:, -rows:].sum(dim=1).mean(dim=0)
                    pooled = brute_force_pool(raw.tolist(), window, pool)
                    if scorer == "union":
                        pooled = brute_force_union(pooled, maps[index].sum(dim=1).mean(dim=0).tolist(), window_share)
                    score = torch.tensor(pooled)[None].expand(KV_HEADS, n)
                h2o_score = h2o_score.mean(dim=0, keepdim=True).expand(KV_HEADS, n)
            if rule == "heavy-hitter-window":  # the question's attention, pooled, starts the sums
                raw = maps[index][:, -rows:].sum(dim=1)
                raw = raw.view(KV_HEADS, GROUPS, n).mean(dim=1) if per_head else raw.mean(dim=0, keepdim=True)
                pooled = torch.tensor([brute_force_pool(row.tolist(), window, pool) for row in raw])
                h2o_score = pooled.expand(KV_HEADS, n)
            frozen = max(keep - DIST, min(SINK, keep)) if rule == "fixed-point" else min(SINK, keep)
            kv = full.layers[index]
            heads = []
            for h in range(KV_HEADS):
                anchors = brute_force_anchors(score[h].tolist(), keep, recent_here)
                buckets = nearest_buckets(anchors, n) if merge == "position" else {a: [a] for a in anchors}
                heads.append([
                    dict(pos=a, k=kv.keys[0, h, members].mean(0), v=kv.values[0, h, members].mean(0),
                         frozen=rank < frozen, score=h2o_score[h, a].item())
                    for rank, (a, members) in enumerate(buckets.items())
                ])
            layers.append(heads)

        with attach(model, profile):
            cache = KvtoolCache(model.config, plans)
            cache.set_draft(draft)
            model(input_ids=torch.cat([ids, drafted], dim=1), **with_cache(model, cache))
            assert cache.get_seq_length() == n
            for step, token in enumerate([*steps, None]):  # check the state after `step` new tokens, then feed one
                seen = n + step
                for index, ratio in enumerate(RATIOS):
                    layer = cache.layers[index]
                    assert layer.per_head == per_head
                    expected = math.ceil(ratio * seen - 1e-9) if rule != "prompt-only" else math.ceil(ratio * n - 1e-9) + step
                    assert int(layer.kept[0]) == expected == len(layers[index][0]), f"step {step} layer {index}"
                    for h in range(KV_HEADS):
                        order = layer.order[0, h] if per_head else layer.order[0]
                        assert sorted(order[layer.valid[0]].tolist()) == [e["pos"] for e in layers[index][h]], (step, index, h)
                if token is None:
                    break
                got = model(input_ids=torch.tensor([[token]]), **with_cache(model, cache)).logits[0, -1]
                want, received = reference_step(model, layers, token, position=seen)
                assert (got - want).abs().max().item() < 1e-6, f"step {step}"
                for index, ratio in enumerate(RATIOS):
                    heads = layers[index]
                    for kv, entries in enumerate(heads):
                        share_probs = received[index][kv] if per_head else torch.stack(received[index]).mean(0)
                        for e, p in zip(entries, share_probs.tolist()):
                            e["score"] += p
                    reference_evict(
                        heads, received[index], rule, math.ceil(ratio * (seen + 1) - 1e-9), seen + 1, per_head, queries[index]
                    )
        grown = math.ceil(0.5 * n) + len(steps) if rule == "prompt-only" else math.ceil(0.5 * (n + len(steps)))
        assert max(int(layer.keys.shape[2]) for layer in cache.layers) <= grown + GROWTH_SLOTS


# ----- batches, budgets, exactness --------------------------------------------------------------

BATCH_CASES = {
    "per-head-window-tova": dict(heads="per-head", scorer="window", window=8, pool=7, evict="tova"),
    "shared-window-tova": dict(heads="shared", scorer="window", window=16, pool=1, evict="tova"),
    "per-head-sum-h2o": dict(heads="per-head", evict="heavy-hitter"),
    "per-head-sum-sliding": dict(heads="per-head", evict="sliding"),
    "per-head-window-prompt-only": dict(heads="per-head", scorer="window", window=4, pool=7, evict="prompt-only"),
    "per-head-window-tova-share": dict(heads="per-head", scorer="window", window=4, pool=3, evict="tova", recent_share=0.4),
    "shared-sum-h2o-share": dict(evict="heavy-hitter", recent_share=0.5),
    "per-head-union-tova": dict(heads="per-head", scorer="union", window=8, pool=7, evict="tova"),
    "shared-union-fixed-point": dict(scorer="union", window=4, pool=3),
    "per-head-union70-tova": dict(heads="per-head", scorer="union", window=8, pool=7, evict="tova", window_share=0.7),
    "shared-union85-h2o": dict(scorer="union", window=4, pool=3, evict="heavy-hitter", window_share=0.85),
    "per-head-union-h2o-window": dict(heads="per-head", scorer="union", window=8, pool=7, evict="heavy-hitter-window"),
    "shared-sum-h2o-window": dict(window=4, pool=3, evict="heavy-hitter-window"),
    "per-head-expected-tova": dict(heads="per-head", scorer="expected-attention", evict="tova", queries=True),
    "shared-expected-fixed-point": dict(scorer="expected-attention", queries=True),
    "per-head-output-tova": dict(heads="per-head", scorer="expected-output", evict="tova", queries=True),
    "per-head-union-expected": dict(heads="per-head", scorer="union", window=8, pool=7, evict="expected-attention", queries=True),
    "shared-expected-expected": dict(scorer="expected-attention", evict="expected-attention", queries=True),
    "per-head-tri-tova": dict(heads="per-head", scorer="triattention", evict="tova", queries=True),
    "shared-tri-triattention": dict(scorer="triattention", evict="triattention", queries=True),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_padded_batch_equals_single_runs(llama, case):
    seqs = prompts([61, 37, 50], seed=3)
    profile = recipe_profile(llama, merge="position" if case == "per-head-sum-sliding" else "none")
    changes = dict(BATCH_CASES[case])
    if changes.get("queries"):
        changes["queries"] = random_queries(llama)
    plans = rules_plans(profile, **changes)
    new = 20
    with torch.no_grad(), attach(llama, profile):
        batch = llama.generate(**left_pad(seqs), max_new_tokens=new, **with_cache(llama, KvtoolCache(llama.config, plans)), **GREEDY)
        for i, seq in enumerate(seqs):
            single = llama.generate(**left_pad([seq]), max_new_tokens=new, **with_cache(llama, KvtoolCache(llama.config, plans)), **GREEDY)
            alone = single.sequences[0, len(seq):]
            assert torch.equal(alone, batch.sequences[i, -new:][: len(alone)]), f"sequence {i}"
            diff = max((a[0] - b[i]).abs().max().item() for a, b in zip(single.scores, batch.scores))
            assert diff < 1e-6


def step_through(model, cache, seqs, steps):
    """Prompt forward plus `steps` greedy tokens by hand; yields the cache after every forward."""
    inputs = left_pad(seqs)
    mask = inputs["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(**inputs, position_ids=positions, **with_cache(model, cache), use_cache=True)
    yield cache
    position = mask.sum(1, keepdim=True)
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(len(seqs), 1)], dim=1)
        out = model(input_ids=token, attention_mask=mask, position_ids=position, **with_cache(model, cache), use_cache=True)
        position = position + 1
        yield cache


@pytest.mark.parametrize("heads", ["shared", "per-head"])
@pytest.mark.parametrize("rule", ["tova", "heavy-hitter", "fixed-point", "prompt-only"])
def test_budget_held_step_by_step(llama, heads, rule):
    seqs = prompts([45, 30], seed=4)
    profile = recipe_profile(llama)
    plans = rules_plans(profile, heads=heads, scorer="window", window=4, pool=7, evict=rule)
    prompt_keep = {i: np.ceil(RATIOS[i] * np.array([45, 30]) - 1e-9) for i in range(len(RATIOS))}
    with torch.no_grad(), attach(llama, profile):
        for step, cache in enumerate(step_through(llama, KvtoolCache(llama.config, plans), seqs, 48)):
            for index, layer in cache.compressing_layers().items():
                assert layer.tokens.tolist() == [45 + step, 30 + step]
                share = np.ceil(RATIOS[index] * layer.tokens - 1e-9)
                want = share if rule != "prompt-only" else prompt_keep[index] + step  # prompt-only grows by one per token
                assert layer.kept.tolist() == want.tolist() == layer.valid.sum(1).tolist()
                # Packed: each row's entries fill its first `kept` slots (the new token goes to slot
                # `kept`, an evicted slot takes the row's last entry), whatever the rule.
                first_slots = torch.arange(layer.valid.shape[1])[None, :] < torch.as_tensor(layer.kept)[:, None]
                assert layer.packed and torch.equal(layer.valid, first_slots)
                order = layer.order if heads == "per-head" else layer.order[:, None]
                for b in range(len(seqs)):
                    first = layer.seen - int(layer.tokens[b])  # left padding: real columns are the last ones
                    for h in range(order.shape[1]):
                        kept = order[b, h][layer.valid[b]].tolist()
                        assert len(set(kept)) == len(kept) and min(kept) >= first  # distinct real entries
                        if rule != "heavy-hitter":  # H2O keeps no sinks, only the recent half
                            assert set(range(first, first + SINK)) <= set(kept)  # sinks never dropped
                if rule != "prompt-only":
                    assert layer.keys.shape[2] <= int(share.max()) + GROWTH_SLOTS


def test_per_head_selection_in_a_padded_batch_is_each_heads_top_k(llama, monkeypatch):
    from kvtool.runtime.importance import block_size

    monkeypatch.setattr(block_size, "BLOCK_ELEMENTS", 1)  # 16-row blocks: every prompt spans several
    seqs = prompts([61, 37, 50], seed=9)
    profile = recipe_profile(llama)
    plans = rules_plans(profile, heads="per-head", scorer="window", window=6, pool=7)
    with torch.no_grad(), attach(llama, profile):
        cache = KvtoolCache(llama.config, plans)
        llama(**left_pad(seqs), **with_cache(llama, cache))
    width = max(len(s) for s in seqs)
    differ = 0
    for b, seq in enumerate(seqs):
        maps = eager_maps(llama, seq[None])
        for index, ratio in enumerate(RATIOS):
            layer = cache.layers[index]
            keep = math.ceil(ratio * len(seq) - 1e-9)
            score = reference_scores(maps[index], "window", 6, 7)
            for h in range(KV_HEADS):
                kept = sorted(c - (width - len(seq)) for c in layer.order[b, h][layer.valid[b]].tolist())
                assert kept == brute_force_anchors(score[h].tolist(), keep, max(RECENT, 6)), (b, index, h)
            differ += not torch.equal(layer.order[b, 0][layer.valid[b]], layer.order[b, 1][layer.valid[b]])
    assert differ >= 6  # the heads really keep different entries: per-head is not shared here


@pytest.mark.parametrize("merge", ["position", "similarity-avg", "similarity-pivot", "similarity-weighted"])
def test_per_head_merging_rebuilds_the_shared_cache_when_heads_choose_alike(llama, merge):
    """`recent` keeps the same positions in every head, so merging each head on its own must give the
    shared layer's entries: per-head selection hands every merge mode one head at a time correctly."""
    seqs = prompts([45, 30], seed=12)
    profile = recipe_profile(llama, merge=merge)
    caches = {}
    with torch.no_grad(), attach(llama, profile):
        for heads in ("shared", "per-head"):
            caches[heads] = KvtoolCache(llama.config, rules_plans(profile, heads=heads, select=select_rule("recent")))
            llama(**left_pad(seqs), **with_cache(llama, caches[heads]))
    for shared, per_head in zip(caches["shared"].layers, caches["per-head"].layers):
        assert per_head.per_head and torch.equal(shared.valid, per_head.valid)
        assert torch.equal(per_head.order, shared.order[:, None].expand_as(per_head.order))
        valid = shared.valid[:, None, :, None]
        assert torch.allclose(per_head.keys * valid, shared.keys * valid, atol=1e-12, rtol=0)
        assert torch.allclose(per_head.values * valid, shared.values * valid, atol=1e-12, rtol=0)


@pytest.mark.parametrize("budget", [1.0, 0.999])
def test_keeping_everything_equals_the_full_cache(llama, budget):
    """Budget 1.0 is sdpa itself; 0.999 runs the fused pass, per-head selection and tova, yet keeps every
    entry of these prompts (ceil(0.999 T) = T below 1000 tokens): both must match the full cache."""
    seqs = prompts([300, 263, 40], seed=2)
    inputs = left_pad(seqs)
    profile = uniform_profile(llama, budget)
    plans = rules_plans(profile, heads="per-head", scorer="window", window=16, pool=7, evict="tova")
    with torch.no_grad():
        full = llama.generate(**inputs, max_new_tokens=8, **GREEDY)
        with attach(llama, profile):
            cache = KvtoolCache(llama.config, plans)
            out = llama.generate(**inputs, max_new_tokens=8, **with_cache(llama, cache), **GREEDY)
    assert torch.equal(full.sequences, out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(full.scores, out.scores))
    assert diff < (1e-6 if budget == 1.0 else 1e-10)
    for layer in cache.layers:
        assert layer.per_head == (budget < 1.0)
        assert layer.kept.tolist() == [len(s) + 7 for s in seqs]


def test_recorded_scores_are_what_selection_ranked(llama):
    """Calibration can read the chosen scorer's score: `prompt_score` is recorded next to the importance."""
    seqs = prompts([40, 25], seed=6)
    profile = uniform_profile(llama, 1.0)
    plans = rules_plans(profile, heads="per-head", scorer="window", window=4, pool=3, record_importance=True)
    with torch.no_grad(), attach(llama, profile):
        cache = KvtoolCache(llama.config, plans)
        llama(**left_pad(seqs), **with_cache(llama, cache))
    for layer in cache.layers:
        assert layer.prompt_score.shape == (2, KV_HEADS, 40)
        assert layer.prompt_scores.window is not None and layer.prompt_importance is layer.prompt_scores.importance
        want = WindowScorer(window=4, pool=3).score(layer.prompt_scores, layer.prompt_valid, True)
        assert torch.equal(layer.prompt_score, want)
