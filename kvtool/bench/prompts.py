"""Long benchmark prompts: real English text (Python's own documentation), no download needed."""

from __future__ import annotations

from typing import Any

import torch

# Each batch row starts this many tokens later in the text, so the rows differ.
ROW_OFFSET = 97


def _document_text() -> str:
    import pydoc
    import textwrap

    return " ".join(pydoc.render_doc(obj, renderer=pydoc.plaintext) for obj in (str, list, dict, set, textwrap))


def long_prompts(tokenizer: Any, n_tokens: int, batch: int) -> torch.Tensor:
    """`batch` different windows of the text, exactly `n_tokens` ids each ([batch, n_tokens], no padding).

    Every row starts with the tokenizer's BOS token when it has one, like a real prompt; the text
    repeats when it is shorter than the longest window.
    """
    ids = tokenizer(_document_text(), return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() == 0:
        raise ValueError("the tokenizer produced no tokens for the benchmark text")
    bos = getattr(tokenizer, "bos_token_id", None)
    body = n_tokens - 1 if bos is not None else n_tokens
    needed = body + ROW_OFFSET * (batch - 1)
    if ids.numel() < needed:
        ids = ids.repeat(-(-needed // ids.numel()))
    rows = [ids[ROW_OFFSET * i : ROW_OFFSET * i + body] for i in range(batch)]
    if bos is not None:
        rows = [torch.cat([torch.tensor([bos], dtype=ids.dtype), row]) for row in rows]
    return torch.stack(rows)
