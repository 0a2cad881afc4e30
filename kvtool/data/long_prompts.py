"""Long prompts built from a prompt set: one prompt in the middle of others' texts.

A hybrid model's sliding-window layers see only the last few hundred tokens; what its full-attention
layers must carry, and what shorter windows lose, shows only on prompts longer than the window. The
packaged prompts run 0.4k to 1.2k tokens, so calibration of such a model surrounds each drawn prompt
with other prompts of the same set (never the evaluation set) until it is about `chars` long: the
request sits in the middle, as in the long prompts of the issue that measured Gemma 3.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from kvtool.data.records import Record

# About three characters a token in the packaged prompts (Gemma 3: 2,786 tokens for 8k characters).
CHARS_PER_TOKEN = 3


def long_prompts(chosen: Sequence[Record], pool: Sequence[Record], tokens: int, seed: int = 0) -> tuple[Record, ...]:
    """Each of `chosen` with text-only prompts from `pool` (not itself) before and after it, about
    `tokens` tokens in all; answers and kinds stay the record's own."""
    rng = random.Random(seed)
    fillers = [r for r in pool if not r.images]
    out = []
    for record in chosen:
        others = [r for r in fillers if r.prompt != record.prompt]
        rng.shuffle(others)
        before, after, size = [], [], len(record.prompt)
        for i, other in enumerate(others):
            if size >= tokens * CHARS_PER_TOKEN:
                break
            (before if i % 2 == 0 else after).append(other.prompt)
            size += len(other.prompt) + 2
        text = "\n\n".join([*before, record.prompt, *after])
        out.append(replace(record, prompt=text, where=f"{record.where} (in a long prompt)"))
    return tuple(out)


def first_per_kind(records: Sequence[Record], count: int) -> tuple[Record, ...]:
    """The first `count` records of each kind, in file order (a shorter run over every kind)."""
    seen: dict[str | None, int] = {}
    out = []
    for record in records:
        if seen.get(record.kind, 0) < count:
            seen[record.kind] = seen.get(record.kind, 0) + 1
            out.append(record)
    return tuple(out)
