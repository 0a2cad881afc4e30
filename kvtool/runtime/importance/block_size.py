"""The CPU path's block size: query rows per block, measured once per prompt shape (or fixed)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from kvtool.runtime.importance.causal_blocks import causal_blocks
from kvtool.runtime.importance.scores import NO_EXTRAS


# Score elements per row block. The best size depends on the CPU's caches and cores (the fastest
# size on one 2-core machine was much slower on another of the same kind), so it is measured: the first long prompt of each shape
# times every candidate on its own last rows and keeps the fastest (`block_tuning()` tells what
# was measured). An int here (or KVTOOL_BLOCK_ELEMENTS) fixes the size instead. Read when a call
# starts, like CHUNK_ELEMENTS. The block size changes only the order of the column sums' additions.
# The largest candidate bounds what a block holds: its scores, which the softmax overwrites, one
# float32 buffer of up to 16 MiB. 2**24 (then two tensors of 64 MiB each) put a one-row prompt phase
# at 4096 tokens 1.23x the full cache's tensor peak (`kvtool bench smollm2 --budget 0.2 --prompt-tokens
# 4096 --batch 1 --new-tokens 32 --repeat 1`: 0.373 against 0.304 GB), and of 13 benchmark runs on a
# 2-core CPU 12 chose 2**20 or 2**21 anyway.
BLOCK_ELEMENTS: int | None = None
DEFAULT_BLOCK_ELEMENTS = 2**22
BLOCK_CANDIDATES = (2**20, 2**21, 2**22)
# Shorter prompts take the default: their whole attention is a few blocks and tuning would cost more
# than it saves. The probe times this many of the last (widest) rows per candidate, twice.
TUNE_MIN_KEYS = 1024
TUNE_PROBE_ROWS = 512


@dataclass(frozen=True)
class BlockTuning:
    """What tuning measured for one prompt shape: seconds per candidate and the choice."""

    n_heads: int
    keys: int  # the prompt length it was measured at
    seconds: dict[int, float]  # block elements -> best of two probe runs
    chosen: int

    @property
    def spread(self) -> float:
        """Slowest over fastest candidate: what a fixed size could cost on this machine."""
        return max(self.seconds.values()) / min(self.seconds.values())


_TUNED: dict[tuple, BlockTuning] = {}


def block_tuning() -> list[BlockTuning]:
    """Every block-size measurement this process made, in the order made."""
    return list(_TUNED.values())


def tune_blocks(n_heads: int, n_kv_heads: int, head_dim: int, m: int, dtype: torch.dtype = torch.float32) -> BlockTuning | None:
    """Measure the block size for prompts of `m` tokens now, on random tensors of that shape (the
    cost is data-independent), so a benchmark's timed runs do not pay for it. None when the size is
    fixed or the prompt too short to tune."""
    if fixed_block_elements() is not None or m < TUNE_MIN_KEYS:
        return None
    generator = torch.Generator().manual_seed(0)
    probe = tuple(torch.randn(h, m, head_dim, generator=generator, dtype=dtype) for h in (n_heads, n_kv_heads, n_kv_heads))
    block_rows(n_heads, m, probe)
    return block_tuning()[-1] if block_tuning() else None


def fixed_block_elements() -> int | None:
    fixed = BLOCK_ELEMENTS if BLOCK_ELEMENTS is not None else os.environ.get("KVTOOL_BLOCK_ELEMENTS")
    return None if fixed is None else int(fixed)


def _tune(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, m: int) -> BlockTuning:
    n_heads = query.shape[0]
    first = max(0, m - TUNE_PROBE_ROWS)
    seconds = {}
    timed_rows = set()
    for elements in BLOCK_CANDIDATES:
        rows = rows_for(elements, n_heads, m)
        if rows in timed_rows:  # the row clamp makes some candidates the same block
            continue
        timed_rows.add(rows)
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            causal_blocks(query, keys, values, 1.0, NO_EXTRAS, rows=rows, first_row=first)
            best = min(best, time.perf_counter() - started)
        seconds[elements] = best
    chosen = min(seconds, key=seconds.get)
    return BlockTuning(n_heads=n_heads, keys=m, seconds=seconds, chosen=chosen)


def rows_for(elements: int, n_heads: int, m: int) -> int:
    return max(16, min(256, elements // max(1, n_heads * m)))


def block_rows(n_heads: int, m: int, probe: tuple | None = None) -> int:
    """Query rows per block of the CPU path for `n_heads` query heads over `m` keys: the fixed size,
    else the size tuned on `probe` (the sequence's query, keys, values) for long prompts, else the
    default."""
    fixed = fixed_block_elements()
    if fixed is not None:
        return rows_for(fixed, n_heads, m)
    if probe is None or m < TUNE_MIN_KEYS:
        return rows_for(DEFAULT_BLOCK_ELEMENTS, n_heads, m)
    query, keys, _ = probe
    # One measurement per head count, width class (power of two) and thread count.
    key = (n_heads, keys.shape[0], query.shape[-1], query.dtype, 1 << (m - 1).bit_length(), torch.get_num_threads())
    tuned = _TUNED.get(key)
    if tuned is None:
        tuned = _TUNED[key] = _tune(*probe, m)
    return rows_for(tuned.chosen, n_heads, m)
