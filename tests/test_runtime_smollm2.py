"""The runtime on the real embedded model (SmolLM2-135M-Instruct, 30 layers, GQA 9/3), end to end."""

from __future__ import annotations

import pytest
import torch

from kvtool.models import format_prompts, load_model
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.memory import kv_bytes, kv_bytes_full
from kvtool.models.forward import with_cache

NEW = 24
TEXTS = [
    "Summarize in two sentences: The Python standard library is very extensive, offering a wide range of "
    "facilities. The library contains built-in modules (written in C) that provide access to system "
    "functionality such as file I/O that would otherwise be inaccessible to Python programmers, as well as "
    "modules written in Python that provide standardized solutions for many problems that occur in everyday "
    "programming. Some of these modules are explicitly designed to encourage and enhance the portability of "
    "Python programs by abstracting away platform-specifics into platform-neutral APIs.",
    "List three uses of a hash table and explain each briefly.",
    "Rewrite politely: give me the report now, I have waited long enough and my patience is gone.",
]


@pytest.fixture(scope="module")
def loaded(smollm2):
    return load_model(smollm2)


def batch(loaded, texts):
    tokenizer = loaded.tokenizer
    return tokenizer(format_prompts(tokenizer, texts), return_tensors="pt", padding=True, add_special_tokens=False)


def greedy(model, inputs, cache=None):
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=NEW, do_sample=False, **with_cache(model, cache),
            pad_token_id=model.generation_config.pad_token_id or 2,
        )
    return out[:, inputs["input_ids"].shape[1]:]


def until_eos(tokens: torch.Tensor, eos: int) -> list[int]:
    out = []
    for t in tokens.tolist():
        out.append(t)
        if t == eos:
            break
    return out


def test_budget_one_is_the_unmodified_model(loaded):
    model = loaded.model
    inputs = batch(loaded, TEXTS)
    plain = greedy(model, inputs)
    with attach(model, uniform_profile(model, 1.0)) as handle:
        same = greedy(model, inputs, handle.new_cache())
    assert torch.equal(plain, same)


def test_padded_batch_at_budget_0_2_equals_single_runs_and_saves_memory(loaded):
    model = loaded.model
    eos = loaded.tokenizer.eos_token_id
    with attach(model, uniform_profile(model, 0.2)) as handle:
        cache = handle.new_cache()
        together = greedy(model, batch(loaded, TEXTS), cache)
        assert kv_bytes(cache) < 0.5 * kv_bytes_full(cache)
        for i, text in enumerate(TEXTS):
            alone = greedy(model, batch(loaded, [text]), handle.new_cache())[0]
            assert until_eos(together[i], eos) == until_eos(alone, eos), f"prompt {i}"
