"""LOOK-M's merging by key similarity: matching, the three combining rules, padding, a loop reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvtool.runtime.merge import MERGE_RULES, merge_rule
from kvtool.runtime.merge.similarity import kept_columns, match_by_similarity
from kvtool.runtime.selection import Selection, select_tokens

MODES = ["similarity-avg", "similarity-pivot", "similarity-weighted"]


def selection_of(columns: list[list[int]], width: int | None = None) -> Selection:
    """Kept columns per row (sorted); shorter rows get unused slots pointing at column 0."""
    width = width or max(len(c) for c in columns)
    index = torch.zeros(len(columns), width, dtype=torch.long)
    valid = torch.zeros(len(columns), width, dtype=torch.bool)
    for b, cols in enumerate(columns):
        index[b, : len(cols)] = torch.tensor(cols)
        valid[b, : len(cols)] = True
    return Selection(index=index, valid=valid)


def one_hot_values(bsz: int, heads: int, n: int) -> torch.Tensor:
    """Value of entry j is the unit vector e_j: a merged value row is the weight of every entry."""
    return torch.eye(n, dtype=torch.float64).expand(bsz, heads, n, n).clone()


# ----- hand-computed cases -------------------------------------------------------------------

# Five entries, two kept (0 and 1). Entries 2 and 4 are closest to key 0, entry 3 to key 1.
KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.2], [0.1, 3.0], [3.0, 1.0]], dtype=torch.float64)[None, None]
S2, S3, S4 = 2 / math.sqrt(4.04), 3 / math.sqrt(9.01), 3 / math.sqrt(10.0)
EXPECTED_WEIGHTS = {
    # rows: anchors (entries 0 and 1); columns: weight of entries 0..4
    "similarity-avg": [[1 / 3, 0, 1 / 3, 0, 1 / 3], [0, 1 / 2, 0, 1 / 2, 0]],
    # k_c' = (k_c + sum_e (k_e + k_c)/2) / (1 + L): two matches -> 2/3 anchor, 1/6 each; one -> 3/4, 1/4
    "similarity-pivot": [[2 / 3, 0, 1 / 6, 0, 1 / 6], [0, 3 / 4, 0, 1 / 4, 0]],
    "similarity-weighted": [
        [1 / (1 + S2 + S4), 0, S2 / (1 + S2 + S4), 0, S4 / (1 + S2 + S4)],
        [0, 1 / (1 + S3), 0, S3 / (1 + S3), 0],
    ],
}


def test_matching_by_cosine_similarity():
    selection = selection_of([[0, 1]])
    slot, similarity = match_by_similarity(KEYS, selection, torch.ones(1, 5, dtype=torch.bool))
    assert slot[0, 0].tolist() == [2, 2, 0, 1, 0]  # kept entries point at "none" (K = 2)
    assert torch.allclose(similarity[0, 0], torch.tensor([0, 0, S2, S3, S4], dtype=torch.float64))


@pytest.mark.parametrize("mode", MODES)
def test_hand_computed_case(mode):
    selection = selection_of([[0, 1]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    keys, values = merge_rule(mode).merge(KEYS, one_hot_values(1, 1, 5), selection, valid, torch.ones(1, 5))
    weights = torch.tensor(EXPECTED_WEIGHTS[mode], dtype=torch.float64)
    assert torch.allclose(values[0, 0], weights, atol=1e-12)
    assert torch.allclose(keys[0, 0], weights @ KEYS[0, 0], atol=1e-12)  # values follow the keys


def test_weighted_negative_similarity_gets_zero_weight():
    keys = torch.tensor([[1.0, 0.0], [-1.0, -0.1], [2.0, 0.5]], dtype=torch.float64)[None, None]
    selection = selection_of([[0]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    _, values = merge_rule("similarity-weighted").merge(keys, one_hot_values(1, 1, 3), selection, valid, torch.ones(1, 3))
    s2 = 2 / math.sqrt(4.25)
    assert torch.allclose(values[0, 0, 0], torch.tensor([1, 0, s2], dtype=torch.float64) / (1 + s2))
    # The other modes still count entry 1 (plain mean: 1/3 each).
    _, avg = merge_rule("similarity-avg").merge(keys, one_hot_values(1, 1, 3), selection, valid, torch.ones(1, 3))
    assert torch.allclose(avg[0, 0, 0], torch.full((3,), 1 / 3, dtype=torch.float64))


def test_unmatched_anchor_is_unchanged_and_full_selection_is_identity():
    keys = torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    selection = selection_of([list(range(6))])
    valid = torch.ones(1, 6, dtype=torch.bool)
    for mode in MODES:
        k, v = merge_rule(mode).merge(keys, values, selection, valid, torch.ones(1, 6))
        assert torch.equal(k, keys) and torch.equal(v, values)


# ----- invariants on random inputs -----------------------------------------------------------


def random_case(seed: int, *, pad: list[int], n: int = 16, heads: int = 3, dim: int = 8, keep: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    bsz = len(pad)
    keys = torch.randn(bsz, heads, n, dim, generator=g, dtype=torch.float64)
    valid = torch.ones(bsz, n, dtype=torch.bool)
    for b, p in enumerate(pad):
        valid[b, :p] = False
    importance = torch.rand(bsz, n, generator=g, dtype=torch.float64)
    tokens = valid.sum(1).numpy()
    keep = np.array(keep) if keep is not None else np.ceil(0.3 * tokens).astype(np.int64)
    selection = select_tokens(importance, valid, keep, sink_tokens=1, recent_window=2)
    return keys, valid, importance, selection


@pytest.mark.parametrize("mode", MODES)
def test_every_entry_lands_once_and_weights_sum_to_one(mode):
    n, heads = 16, 3
    keys, valid, importance, selection = random_case(3, pad=[0, 5], n=n, heads=heads)
    values = one_hot_values(2, heads, n)
    _, merged = merge_rule(mode).merge(keys, values, selection, valid, importance)
    kept = kept_columns(selection, n)
    for b in range(2):
        slots = selection.valid[b]
        weights = merged[b][:, slots]  # [H, K_b, n]: weight of every entry in every kept entry
        assert torch.allclose(weights.sum(-1), torch.ones_like(weights.sum(-1)), atol=1e-12)
        assert (weights >= 0).all()
        lands = (weights > 0).sum(1)  # [H, n]: in how many kept entries each entry appears
        assert (lands[:, ~valid[b]] == 0).all()  # padding never takes part
        assert (lands[:, kept[b]] == 1).all()  # each kept entry only in its own slot ...
        own = weights[:, torch.arange(int(slots.sum())), selection.index[b][slots]]
        assert (own > 0).all()
        evicted = valid[b] & ~kept[b]
        if mode == "similarity-weighted":  # a negative best similarity drops the entry (weight 0)
            assert (lands[:, evicted] <= 1).all()
        else:
            assert (lands[:, evicted] == 1).all()  # ... and each evicted entry in exactly one


def test_kept_and_evicted_are_disjoint():
    n = 16
    keys, valid, _, selection = random_case(4, pad=[0, 3, 7], n=n)
    slot, similarity = match_by_similarity(keys, selection, valid)
    kept = kept_columns(selection, n)
    width = selection.index.shape[1]
    evicted = valid & ~kept
    assert not (kept & evicted).any()
    assert (kept.sum(1).numpy() == selection.valid.sum(1).numpy()).all()
    assert ((slot < width) == evicted[:, None, :]).all()  # exactly the evicted entries are matched
    matched = slot.clamp(max=width - 1)
    assert selection.valid.gather(1, matched.flatten(1)).view_as(slot)[slot < width].all()  # only to used slots
    assert (similarity[slot == width] == 0).all()


def reference_merge(keys, values, selection, valid, mode):
    """Loop-by-loop LOOK-M merge, straight from the definitions."""
    bsz, heads, n, _ = keys.shape
    out_k = torch.zeros(bsz, heads, selection.index.shape[1], keys.shape[-1], dtype=keys.dtype)
    out_v = torch.zeros(bsz, heads, selection.index.shape[1], values.shape[-1], dtype=values.dtype)
    for b in range(bsz):
        slots = [j for j in range(selection.index.shape[1]) if selection.valid[b, j]]
        anchors = [int(selection.index[b, j]) for j in slots]
        for h in range(heads):
            matched = {j: [] for j in slots}
            for e in range(n):
                if not valid[b, e] or e in anchors:
                    continue
                sims = [float(F.cosine_similarity(keys[b, h, e], keys[b, h, a], dim=0)) for a in anchors]
                best = max(range(len(sims)), key=lambda i: (sims[i], -i))
                matched[slots[best]].append((e, sims[best]))
            for j, a in zip(slots, anchors):
                for states, out in ((keys, out_k), (values, out_v)):
                    items = matched[j]
                    if mode == "similarity-avg":
                        acc = states[b, h, a] + sum((states[b, h, e] for e, _ in items), torch.zeros_like(states[b, h, a]))
                        out[b, h, j] = acc / (1 + len(items))
                    elif mode == "similarity-pivot":
                        pivots = sum(((states[b, h, e] + states[b, h, a]) / 2 for e, _ in items), torch.zeros_like(states[b, h, a]))
                        out[b, h, j] = (states[b, h, a] + pivots) / (1 + len(items))
                    else:
                        w = [max(s, 0.0) for _, s in items]
                        acc = states[b, h, a] + sum((wi * states[b, h, e] for wi, (e, _) in zip(w, items)), torch.zeros_like(states[b, h, a]))
                        out[b, h, j] = acc / (1 + sum(w))
    return out_k, out_v


@pytest.mark.parametrize("mode", MODES)
def test_matches_loop_reference(mode, monkeypatch):
    import kvtool.runtime.merge.similarity as similarity

    monkeypatch.setattr(similarity, "CHUNK_ELEMENTS", 50)  # several row blocks
    keys, valid, importance, selection = random_case(5, pad=[0, 4], n=14, heads=2, dim=6)
    values = torch.randn(2, 2, 14, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    got_k, got_v = merge_rule(mode).merge(keys, values, selection, valid, importance)
    want_k, want_v = reference_merge(keys, values, selection, valid, mode)
    used = selection.valid[:, None, :, None]
    assert torch.allclose(got_k * used, want_k * used, atol=1e-12)
    assert torch.allclose(got_v * used, want_v * used, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_padded_rows_do_not_leak(mode):
    """A left-padded row merges exactly like the same sequence alone, whatever the padding holds."""
    n, pad = 15, 6
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(1, 2, n - pad, 4, generator=g, dtype=torch.float64)
    values = torch.randn(1, 2, n - pad, 4, generator=g, dtype=torch.float64)
    importance = torch.rand(1, n - pad, generator=g, dtype=torch.float64)
    keep = np.array([4])
    alone_valid = torch.ones(1, n - pad, dtype=torch.bool)
    alone_sel = select_tokens(importance, alone_valid, keep, sink_tokens=1, recent_window=1)
    alone = merge_rule(mode).merge(keys, values, alone_sel, alone_valid, importance)
    for garbage in (1e3, float("nan")):
        filler = torch.full((1, 2, pad, 4), garbage, dtype=torch.float64)
        padded_keys = torch.cat([filler, keys], dim=2)
        padded_values = torch.cat([filler, values], dim=2)
        valid = torch.cat([torch.zeros(1, pad, dtype=torch.bool), alone_valid], dim=1)
        padded_imp = torch.cat([torch.full((1, pad), 5.0, dtype=torch.float64), importance], dim=1)
        sel = select_tokens(padded_imp, valid, keep, sink_tokens=1, recent_window=1)
        assert torch.equal(sel.index - pad, alone_sel.index)
        merged = merge_rule(mode).merge(padded_keys, padded_values, sel, valid, padded_imp)
        for got, want in zip(merged, alone):
            assert torch.allclose(got, want, atol=1e-12), garbage


def test_registered_by_name():
    for mode in MODES:
        assert MERGE_RULES[mode].name == mode
