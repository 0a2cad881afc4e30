"""Prompts and answers as token ids: chat formatting, the length limit, prompts with images.

What calibration and evaluation feed the model is encoded here, the same way for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtool.data import Record
from kvtool.errors import KvtoolError
from kvtool.models.images import encode_image_prompt, no_image_support
from kvtool.models.prompts import format_prompts
from kvtool.profiles import MethodSettings

# Marks where a prompt over the length limit was cut (the middle goes: the instruction opens the
# prompt and is restated at its end, so both ends carry it).
ELISION = "\n[...]\n"
# Share of the kept content taken from the start of the prompt; the rest comes from its end.
HEAD_SHARE = 0.75


@dataclass(frozen=True)
class Encoded:
    """One prompt's token ids and, with images, the processor's other outputs ([1, ...] tensors)."""

    ids: list[int]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)


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


def encode_samples(
    tokenizer: Any,
    samples: Sequence[Record],
    max_tokens: int,
    method: MethodSettings,
    *,
    processor: Any = None,
    model: Any = None,
    name: str = "the model",
) -> list[Encoded]:
    """Each sample's prompt as the model sees it; samples with images go through `processor`.

    Text prompts over `max_tokens` are cut in the middle; prompts with images are not cut (an
    image's tokens cannot be split) and are an error instead.
    """
    protected = method.sink_tokens + method.recent_window
    encoded = []
    for index, record in enumerate(samples):
        if record.images:
            item = _encode_with_images(processor, model, name, record, index, max_tokens)
        else:
            item = Encoded(encode_prompt(tokenizer, record.prompt, max_tokens))
        ids = item.ids
        if len(ids) <= protected:
            raise KvtoolError(
                f"{record.describe(index)} is {len(ids)} tokens long as the model sees it, not more than the "
                f"{protected} protected tokens ({method.sink_tokens} sink + {method.recent_window} recent) that "
                "are always kept: nothing to compress; use longer prompts"
            )
        encoded.append(item)
    return encoded


def _encode_with_images(processor: Any, model: Any, name: str, record: Record, index: int, max_tokens: int) -> Encoded:
    where = record.where or record.describe(index)
    if processor is None:
        if model is None:
            raise KvtoolError(f"{where}: has \"images\" but no processor was given to encode them")
        raise no_image_support(model.config, name, where)
    ids, extras = encode_image_prompt(processor, record.prompt, record.images, where)
    if len(ids) > max_tokens:
        raise KvtoolError(
            f"{where}: is {len(ids)} tokens with its images, over the {max_tokens}-token prompt limit; prompts with "
            "images are not cut (an image's tokens cannot be split): raise --max-prompt-tokens or shorten the prompt"
        )
    return Encoded(ids, extras)


def encode_answers(tokenizer: Any, samples: Sequence[Record], rows: Sequence[int]) -> list[list[int] | None]:
    """Token ids of the `answer` of each sample in `rows` (None where it has none), as it continues the prompt."""
    return [
        None if samples[r].answer is None else list(tokenizer(samples[r].answer, add_special_tokens=False)["input_ids"])
        for r in rows
    ]
