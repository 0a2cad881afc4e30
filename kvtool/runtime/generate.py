"""Batched generation with timing and KV-cache accounting, for any cache the caller supplies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from kvtool.errors import KvtoolError
from kvtool.models.loader import eos_token_ids
from kvtool.models.prompts import format_prompts
from kvtool.profiles import Draft
from kvtool.runtime import draft as drafting
from kvtool.profiles import fingerprint_of
from kvtool.runtime.memory import kv_bytes, kv_bytes_by_type, kv_bytes_full


@dataclass(frozen=True)
class GenerationResult:
    """What one batched `generate` call produced and cost.

    prompt_tokens: real tokens per prompt (padding excluded).
    new_tokens: generated tokens per prompt, up to and including its first EOS.
    prefill_s: from just before `model.generate` until the first new token exists (argument
        handling, the prompt forward pass and the first token's selection).
    decode_tok_s: batch size * decode steps / decode seconds, where decode steps are the forward
        passes after the first token. Rows that already finished still ride along in the batch and
        are counted: this is batch throughput, not useful tokens per second. 0.0 when only one
        token was generated (no decode step to time).
    kv_bytes / kv_bytes_full: bytes the cache holds at the end / what a plain cache would hold.
    total_s: wall time of `model.generate`.
    compressed: False when the generation ran through a plain full cache (none was asked for, or
        the prompts were too short for compression to save memory: `runtime.memory`).
    """

    outputs: list[str]
    prompt_tokens: list[int]
    new_tokens: list[int]
    prefill_s: float
    decode_tok_s: float
    kv_bytes: int
    kv_bytes_full: int
    total_s: float
    compressed: bool = True
    # Per layer type: (bytes held, bytes a plain cache would hold); one entry for a model of one type.
    kv_by_type: dict[str, tuple[int, int]] = field(default_factory=dict)


class _StepClock(StoppingCriteria):
    """A StoppingCriteria that never stops anything; it timestamps each generation step.

    transformers calls stopping criteria once per generated token, after that token is chosen,
    so the first call closes the prefill and each later call closes one decode step.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)  # kernels are async; time finished work only
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    cache_factory: Callable[[], Any] | None = None,
    draft: Draft | None = None,
) -> GenerationResult:
    """Generate a continuation for each prompt as one left-padded batch.

    Greedy when `temperature` is 0, otherwise sampling at that temperature (seeded with `seed`).
    `cache_factory` builds the cache to use; by default a plain `DynamicCache` for the model's
    config, created here so its size can be read after generation. With a `draft` (a kvtool cache
    factory only) the prompt is compressed with the draft's attention in its scores first and the
    output starts with its verified prefix (`kvtool.runtime.draft.generate`, which
    `KvtoolHandle.generate` runs too).
    """
    if max_new_tokens < 1:
        raise KvtoolError("max-new-tokens must be at least 1")
    if temperature < 0:
        raise KvtoolError("temperature must be >= 0")
    if draft is not None and cache_factory is None:
        raise KvtoolError("a draft needs a kvtool cache (a profile or a budget)")
    texts = format_prompts(tokenizer, prompts)
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    prompt_width = inputs["input_ids"].shape[1]
    sampling: dict[str, Any] = {"do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    if temperature > 0:
        sampling.update(do_sample=True, temperature=temperature)
        if seed is not None:
            torch.manual_seed(seed)
    clock = _StepClock()
    make_cache = cache_factory or (lambda: DynamicCache(config=model.config))
    with torch.inference_mode():
        started = time.perf_counter()
        sequences, cache = drafting.generate(
            model, inputs, make_cache, draft,
            # With a draft the prompt is compressed before generate runs: what follows is decoding.
            on_prepared=lambda: clock.stamps.append(time.perf_counter()),
            max_new_tokens=max_new_tokens,
            stopping_criteria=StoppingCriteriaList([clock]),
            **sampling,
        )
        finished = time.perf_counter()

    eos = eos_token_ids(model, tokenizer)
    generated = [_until_eos(row.tolist(), eos) for row in sequences[:, prompt_width:]]
    outputs = [
        tokenizer.decode([t for t in row if t not in eos], skip_special_tokens=True) for row in generated
    ]
    prefill_end = clock.stamps[0] if clock.stamps else finished
    decode_steps = max(len(clock.stamps) - 1, 0)
    decode_s = clock.stamps[-1] - prefill_end if decode_steps else 0.0
    batch = len(prompts)
    return GenerationResult(
        outputs=outputs,
        prompt_tokens=[int(n) for n in inputs["attention_mask"].sum(dim=1).tolist()],
        new_tokens=[len(row) for row in generated],
        prefill_s=prefill_end - started,
        decode_tok_s=batch * decode_steps / decode_s if decode_s > 0 else 0.0,
        kv_bytes=kv_bytes(cache),
        kv_bytes_full=kv_bytes_full(cache),
        total_s=finished - started,
        compressed=not type(cache) is DynamicCache,
        kv_by_type=kv_bytes_by_type(cache, fingerprint_of(model).layer_types),
    )
