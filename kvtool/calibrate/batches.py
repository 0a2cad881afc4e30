"""Calibration prompts as token ids: chat formatting, length limit, left-padded batches.

Positions follow `generate`: each row counts its own real tokens (cumsum of the attention mask), so
a padded row sees the same positions as it would alone, and the per-token steps that follow
continue from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtool.models.prompts import format_prompts

# Marks where a prompt over the length limit was cut (the middle goes: the instruction opens the
# prompt and is restated at its end, so both ends carry it).
ELISION = "\n[...]\n"
# Share of the kept content taken from the start of the prompt; the rest comes from its end.
HEAD_SHARE = 0.75


@dataclass(frozen=True)
class Batch:
    """Left-padded prompts; `rows` are the positions of these prompts in the sample list."""

    rows: tuple[int, ...]
    input_ids: torch.Tensor  # [B, W]
    attention_mask: torch.Tensor  # [B, W]
    position_ids: torch.Tensor  # [B, W]

    @property
    def next_positions(self) -> torch.Tensor:
        """[B, 1] position of each row's first new token."""
        return self.attention_mask.sum(dim=1, keepdim=True)


def encode_prompt(tokenizer: Any, prompt: str, max_tokens: int) -> list[int]:
    """Token ids of the chat-formatted prompt, cut in the middle to at most `max_tokens`."""
    ids = _encode(tokenizer, prompt)
    if len(ids) <= max_tokens:
        return ids
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    overhead = max(len(ids) - len(content), 0) + len(tokenizer(ELISION, add_special_tokens=False)["input_ids"])
    keep = max_tokens - overhead
    # Re-tokenizing at the cut can merge or split a token; shrink until the result fits.
    for _ in range(8):
        if keep < 2:
            break
        head = int(keep * HEAD_SHARE)
        text = tokenizer.decode(content[:head]) + ELISION + tokenizer.decode(content[len(content) - (keep - head) :])
        ids = _encode(tokenizer, text)
        if len(ids) <= max_tokens:
            return ids
        keep -= len(ids) - max_tokens
    # The template alone is longer than the limit: keep its end, where the reply begins.
    return ids[-max_tokens:]


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    text = format_prompts(tokenizer, [prompt])[0]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_batches(encoded: Sequence[list[int]], batch_size: int, pad_id: int) -> list[Batch]:
    """Group prompts by length (less padding) into left-padded batches of at most `batch_size`."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    batches = []
    for start in range(0, len(order), batch_size):
        rows = tuple(order[start : start + batch_size])
        batches.append(left_pad([encoded[i] for i in rows], rows, pad_id))
    return batches


def left_pad(sequences: Sequence[list[int]], rows: tuple[int, ...], pad_id: int) -> Batch:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[i, width - len(seq) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(rows=rows, input_ids=ids, attention_mask=mask, position_ids=positions)
