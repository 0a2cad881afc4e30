"""Causal attention of one unpadded sequence in blocks of query rows, with the column sums.

Per block of query rows: one GEMM for the scores (query heads grouped under their KV head, so keys
are never repeated), softmax, one GEMM for the output, and the block's probabilities summed into the
column totals while they are still in cache.

Every block's scores go into one buffer made once per call, and the softmax overwrites them in
place: a fresh tensor of several MiB per block (two, with the probabilities) costs its pages anew,
which took about as long as the block's score GEMM (on a 2-core CPU, a block's score GEMM took
3.1-3.4 ms into a fresh tensor and 1.9 ms into one already touched; one layer at 4096 keys 297 ms
against 335 ms with fresh tensors).
"""

from __future__ import annotations

import torch

from kvtool.runtime.importance.logits import cap_, sink_view, softmax_
from kvtool.runtime.importance.scores import NO_EXTRAS, accumulation_dtype


def causal_blocks(query, keys, values, scaling, request=NO_EXTRAS, *, rows: int, first_row: int = 0):
    """Causal attention of one unpadded sequence of m keys: [Hq, n_q, Dv] output, [m] importance, and
    the [Hkv, m] per-head column sums and window sums when `request` asks for them (else None).

    The n_q queries are the sequence's last rows: all m of them in a prompt pass, a draft's rows
    over a held prompt otherwise (runtime.held), whose sums then cover those rows alone.
    `rows` per block (`block_size.block_rows` gives the tuned size); `first_row` skips the blocks
    before it, which only block-size tuning does (its timing of the widest rows; the results are
    then partial)."""
    n_heads, n_q, head_dim = query.shape
    n_kv_heads, m = keys.shape[0], keys.shape[1]
    offset = m - n_q  # sequence row of the first query
    groups = n_heads // n_kv_heads
    q = (query * scaling).view(n_kv_heads, groups, n_q, head_dim)
    k_t = keys.transpose(1, 2)  # [Hkv, D, m]
    out = query.new_empty(n_kv_heads, groups, n_q, values.shape[-1])
    total = torch.zeros(m, dtype=query.dtype, device=query.device)
    heads = torch.zeros(n_kv_heads, m, dtype=query.dtype, device=query.device) if request.heads else None
    window = torch.zeros(n_kv_heads, m, dtype=query.dtype, device=query.device) if request.window else None
    first_window_row = m - min(request.window, m)
    sink = sink_view(scaling, (n_kv_heads, groups, 1, 1), query.dtype, query.device)  # logits.py
    future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu(1)
    # Outputs written in place take no part in autograd: a caller that differentiates gets fresh tensors.
    reuse = not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, keys, values)))
    buffer = query.new_empty(n_kv_heads * groups * min(rows, n_q) * m) if reuse else None  # the widest block's scores
    for r0 in range(max(first_row, offset), m, rows):
        r1 = min(m, r0 + rows)
        c = r1 - r0
        q_block = q[:, :, r0 - offset : r1 - offset].reshape(n_kv_heads, groups * c, head_dim)
        into = None if buffer is None else buffer[: n_kv_heads * groups * c * r1].view(n_kv_heads, groups * c, r1)
        scores = cap_(torch.bmm(q_block, k_t[:, :, :r1], out=into), scaling)
        # Only the block's own diagonal square holds future positions.
        scores.view(n_kv_heads, groups, c, r1)[..., r0:r1].masked_fill_(future[:c, :c], float("-inf"))
        if sink is None:
            probs = torch.softmax(scores, dim=-1, out=into)
        else:
            probs = softmax_(scores.view(n_kv_heads, groups, c, r1), sink).view(n_kv_heads, groups * c, r1)
        out[:, :, r0 - offset : r1 - offset] = torch.bmm(probs, values[:, :r1]).view(n_kv_heads, groups, c, -1)
        if heads is None:
            total[:r1] += probs.sum(dim=(0, 1))
        else:
            per_head = probs.sum(dim=1)  # [Hkv, r1]
            heads[:, :r1] += per_head
            total[:r1] += per_head.sum(dim=0)
        if window is not None and r1 > first_window_row:
            # The window is the sequence's last rows: only the last block(s) reach this.
            lo = max(first_window_row, r0) - r0
            window[:, :r1] += probs.view(n_kv_heads, groups, c, r1)[:, :, lo:].sum(dim=(1, 2))
    acc = accumulation_dtype(query.dtype)
    heads = None if heads is None else heads.to(acc) / groups
    window = None if window is None else window.to(acc) / groups
    return out.view(n_heads, n_q, -1), total.to(acc) / n_heads, heads, window
