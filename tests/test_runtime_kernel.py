"""The fused CPU prompt kernel (`attention_with_importance`) against a brute-force float64 reference.

Prompts are longer than the kernel's 256-row blocks and left-padded, so every sequence is cut to
its real tokens and scored in several row blocks. The reference is a plain loop over sequences and
query heads: softmax of the masked scores, their product with the values, their column sums.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.importance import ScoreRequest, attention_importance, attention_with_importance, attention_with_scores
from kvtool.runtime.importance.block_size import block_rows
from kvtool.models.forward import with_cache
from tiny_models import GREEDY, left_pad, prompts, tiny_llama

HEADS, KV_HEADS, DIM, SCALE = 4, 2, 8, 0.3


def reference(q, k, v, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, n, Hq, D] (zero on padded rows) and importance [B, n] (zero on padding), in float64."""
    q, k, v = q.double(), k.double(), v.double()
    bsz, _, n, _ = q.shape
    out = torch.zeros(bsz, n, HEADS, DIM, dtype=torch.float64)
    received = torch.zeros(bsz, n, dtype=torch.float64)
    for b, start in enumerate(starts):
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            scores = q[b, h, start:] @ k[b, kv, start:].T * SCALE
            future = torch.ones_like(scores, dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            out[b, start:, h] = probs @ v[b, kv, start:]
            received[b, start:] += probs.sum(dim=0) / HEADS
    return out, received


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("real", [[600], [600, 563, 300, 40]], ids=["unpadded", "left-padded"])
def test_fused_kernel_matches_brute_force_over_several_row_blocks(dtype, real):
    n = max(real)
    assert block_rows(HEADS, n) < n  # the longest prompt spans several row blocks
    g = torch.Generator().manual_seed(11)
    q = torch.randn(len(real), HEADS, n, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(len(real), KV_HEADS, n, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(len(real), KV_HEADS, n, DIM, generator=g, dtype=torch.float64)
    starts = [n - m for m in real]
    mask = None
    if starts != [0]:
        columns = torch.arange(n)
        real_columns = columns[None, :] >= torch.tensor(starts)[:, None]  # [B, n]
        mask = (real_columns[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()).contiguous()
        for b, start in enumerate(starts):
            # What padded positions of an earlier layer may hold: none of it may reach a real row.
            q[b, :, :start] = k[b, :, :start] = v[b, :, :start] = float("nan")
    want_out, want_importance = reference(q, k, v, starts)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    out, received = attention_with_importance(q, k, v, mask, SCALE)
    alone = attention_importance(q, k, mask, SCALE)

    exact = dtype == torch.float64
    assert (out.dtype, received.dtype) == (dtype, dtype)
    assert torch.allclose(out.double(), want_out, atol=1e-12 if exact else 1e-5, rtol=0)
    assert torch.allclose(received.double(), want_importance, atol=1e-10 if exact else 1e-3, rtol=0)
    assert torch.equal(alone, received)
    for b, start in enumerate(starts):
        assert torch.all(out[b, :start] == 0) and torch.all(received[b, :start] == 0)
        # Every real query row spreads probability 1 over the keys: the column sums total the rows.
        assert received[b].sum().item() == pytest.approx(real[b], rel=1e-6)


def _held_rows_case(real: list[int], rows: int = 70):
    """A draft's rows over a held prompt (runtime.held): the last `rows` of the positions as queries,
    the whole prompt and the rows as keys; the inputs and the brute-force output and column sums."""
    n = max(real) + rows
    g = torch.Generator().manual_seed(12)
    q = torch.randn(len(real), HEADS, n, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(len(real), KV_HEADS, n, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(len(real), KV_HEADS, n, DIM, generator=g, dtype=torch.float64)
    starts = [n - rows - m for m in real]
    columns = torch.arange(n)
    real_columns = columns[None, :] >= torch.tensor(starts)[:, None]
    mask = (real_columns[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril())[:, :, -rows:].contiguous()
    for b, start in enumerate(starts):
        q[b, :, :start] = k[b, :, :start] = v[b, :, :start] = float("nan")
    want_out, _ = reference(q, k, v, starts)
    want_sums = torch.zeros(len(real), n, dtype=torch.float64)
    for b, start in enumerate(starts):
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            scores = q[b, h, -rows:] @ k[b, kv, start:].T * SCALE
            scores[:, -rows:] = scores[:, -rows:].masked_fill(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
            want_sums[b, start:] += torch.softmax(scores, dim=-1).sum(dim=0) / HEADS
    return q, k, v, mask, want_out, want_sums


@pytest.mark.parametrize("real", [[600], [600, 563, 300, 40]], ids=["unpadded", "left-padded"])
def test_rows_over_a_held_prompt_take_the_cpu_path_and_match_brute_force(real, monkeypatch):
    """The CPU path scores a draft's rows alone, one sequence at a time, and equals the full pass's
    last rows and those rows' column sums."""
    rows = 70
    q, k, v, mask, want_out, want_sums = _held_rows_case(real, rows)
    from kvtool.runtime.importance import chunked

    monkeypatch.setattr(chunked, "chunked_scores", lambda *a, **k: pytest.fail("took the portable path"))
    out, scores = attention_with_scores(q[:, :, -rows:], k, v, mask, SCALE, ScoreRequest(heads=True))
    assert out.shape == (len(real), rows, HEADS, DIM)
    assert torch.allclose(out, want_out[:, -rows:], atol=1e-12, rtol=0)
    assert torch.allclose(scores.importance, want_sums, atol=1e-12, rtol=0)
    assert torch.allclose(scores.heads.mean(dim=1), want_sums, atol=1e-12, rtol=0)
    assert scores.importance.sum().item() == pytest.approx(rows * len(real))


@pytest.mark.parametrize("chunk", ["gpu", "rows of 3"])
@pytest.mark.parametrize("real", [[600], [600, 563, 300, 40]], ids=["unpadded", "left-padded"])
def test_rows_over_a_held_prompt_on_the_portable_path_match_brute_force(real, chunk):
    """What a GPU runs for a draft's rows (the Triton kernels are square): the portable path, in one
    chunk of a GPU's size or in many, each group of query heads as one matrix against its KV head."""
    from kvtool.runtime.importance import chunked

    rows = 70
    q, k, v, mask, want_out, want_sums = _held_rows_case(real, rows)
    elements = chunked.GPU_CHUNK_ELEMENTS if chunk == "gpu" else 3 * len(real) * HEADS * k.shape[2]
    out, scores = chunked.chunked_scores(q[:, :, -rows:], k, v, mask, SCALE, elements, ScoreRequest(heads=True, window=8))
    assert torch.allclose(out, want_out[:, -rows:], atol=1e-12, rtol=0)
    assert torch.allclose(scores.importance, want_sums, atol=1e-12, rtol=0)
    assert torch.allclose(scores.heads.mean(dim=1), want_sums, atol=1e-12, rtol=0)
    # The window is the last 8 rows: the column sums of those rows alone.
    _, last = chunked.chunked_scores(q[:, :, -8:], k, v, mask[:, :, -8:], SCALE, elements, ScoreRequest(heads=True))
    assert torch.allclose(scores.window, last.heads, atol=1e-12, rtol=0)


def test_keep_everything_through_the_fused_path_equals_the_full_cache(monkeypatch):
    """Budget 1.0 takes sdpa (bit for bit); a ratio just under 1 takes the fused kernel, yet keeps
    every entry of these prompts (ceil(0.999 n) = n below 1000 tokens): generation must then match
    the full cache up to rounding, through several row blocks and left padding."""
    import kvtool.runtime.attention as attention

    model = tiny_llama(layers=2)
    seqs = prompts([300, 263])
    inputs = left_pad(seqs)
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return attention_with_scores(*args)

    monkeypatch.setattr(attention, "attention_with_scores", counted)
    with torch.no_grad():
        full = model.generate(**inputs, max_new_tokens=8, **GREEDY)
        with attach(model, uniform_profile(model, 0.999)) as handle:
            cache = handle.new_cache()
            kept_all = model.generate(**inputs, max_new_tokens=8, **with_cache(model, cache), **GREEDY)
    assert len(calls) == len(model.model.layers)  # every layer's prompt went through the fused kernel
    assert all(block_rows(shape[1], 263) < 263 for shape in calls)
    for layer in cache.layers:
        # nothing dropped: the last generated token is never fed back, so 7 joined each prompt
        assert layer.kept.tolist() == layer.tokens.tolist() == [len(s) + 7 for s in seqs]
    assert torch.equal(full.sequences, kept_all.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(full.scores, kept_all.scores)) < 1e-10


def test_block_size_is_measured_once_per_shape_and_can_be_fixed(monkeypatch):
    """Long prompts time every candidate block size on their own last rows and keep the fastest;
    an explicit size (module constant or KVTOOL_BLOCK_ELEMENTS) skips the measurement."""
    from kvtool.runtime.importance import block_size
    from kvtool.runtime.importance.causal_blocks import causal_blocks

    monkeypatch.setattr(block_size, "_TUNED", {})
    monkeypatch.setattr(block_size, "BLOCK_ELEMENTS", None)
    monkeypatch.delenv("KVTOOL_BLOCK_ELEMENTS", raising=False)
    torch.manual_seed(0)
    m = block_size.TUNE_MIN_KEYS + 10
    probe = (torch.randn(6, m, 8), torch.randn(2, m, 8), torch.randn(2, m, 8))
    assert block_size.block_rows(6, 100, probe) == block_size.rows_for(block_size.DEFAULT_BLOCK_ELEMENTS, 6, 100)
    assert block_size.block_tuning() == []  # short prompts are not worth a measurement
    rows = block_size.block_rows(6, m, probe)
    [tuning] = block_size.block_tuning()
    assert tuning.keys == m and tuning.chosen == min(tuning.seconds, key=tuning.seconds.get)
    assert rows == block_size.rows_for(tuning.chosen, 6, m) and tuning.spread >= 1.0
    # Distinct row counts only, each from a candidate.
    timed = [block_size.rows_for(e, 6, m) for e in tuning.seconds]
    assert len(set(timed)) == len(timed) and set(tuning.seconds) <= set(block_size.BLOCK_CANDIDATES)
    block_size.block_rows(6, m + 5, probe)  # same shape class: measured already
    assert len(block_size.block_tuning()) == 1
    monkeypatch.setenv("KVTOOL_BLOCK_ELEMENTS", str(2**20))
    assert block_size.block_rows(6, 4 * m, probe) == block_size.rows_for(2**20, 6, 4 * m)
    assert len(block_size.block_tuning()) == 1
    # Whatever the block size, the attention output is the same and the column sums agree to rounding.
    q, k, v = (t.double() for t in probe)
    outs = [causal_blocks(q, k, v, 0.3, rows=rows) for rows in (16, 100, 256)]
    for out, total, _, _ in outs[1:]:
        assert torch.allclose(out, outs[0][0], atol=1e-12) and torch.allclose(total, outs[0][1], atol=1e-12)


@pytest.mark.parametrize("queries", [300, 40], ids=["prompt pass", "rows over a held prompt"])
def test_blocks_written_into_one_buffer_equal_fresh_tensors_per_block(queries):
    """Inference writes every block's scores into one buffer and takes the softmax in place; with
    inputs that need gradients each block gets fresh tensors. Both give the same bits, blocks of
    every width included (the causal blocks grow, the last is partial)."""
    from kvtool.runtime.importance.causal_blocks import causal_blocks

    g = torch.Generator().manual_seed(13)
    m = 300
    q = torch.randn(HEADS, queries, DIM, generator=g)
    k, v = torch.randn(KV_HEADS, m, DIM, generator=g), torch.randn(KV_HEADS, m, DIM, generator=g)
    request = ScoreRequest(heads=True, window=20)
    reused = causal_blocks(q, k, v, SCALE, request, rows=33)
    fresh = causal_blocks(q.requires_grad_(), k, v, SCALE, request, rows=33)
    assert fresh[0].requires_grad  # the path that keeps autograd ran
    for a, b in zip(reused, fresh):
        assert torch.equal(a, b.detach())
    with torch.no_grad():  # no gradients wanted: the buffer again, the same bits
        assert all(torch.equal(a, b) for a, b in zip(reused, causal_blocks(q, k, v, SCALE, request, rows=33)))
