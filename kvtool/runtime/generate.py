"""Batched generation with timing and KV-cache accounting, for any cache the caller supplies."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.models.loader import eos_token_ids
from kvtool.models.prompts import format_prompts
from kvtool.runtime.memory import kv_bytes, kv_bytes_full
from kvtool.runtime.verified import ForcedPrefix, Verified, verify_draft


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
    """

    outputs: list[str]
    prompt_tokens: list[int]
    new_tokens: list[int]
    prefill_s: float
    decode_tok_s: float
    kv_bytes: int
    kv_bytes_full: int
    total_s: float


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


def drafted_cache(
    model: Any,
    inputs: Any,
    cache_factory: Callable[[], Any],
    draft: int,
    sampling: dict | None = None,
    rounds: int = 1,
    verify: bool = False,
    reuse: bool = False,
) -> tuple[Any, dict, Verified | None]:
    """A cache whose prompt was compressed with a draft's attention in its scores, the inputs
    that continue from it (the prompt and the draft's first token), and with `verify` the verified
    prefix of the last round's draft (else None).

    The draft is `draft` tokens generated through a compressed cache of their own (dropped before
    the second fills, so one budget is held at a time); the prompt runs again with them appended
    into a fresh cache (`KvtoolCache.set_draft`), which keeps prompt entries only. The draft's first
    token came from the prompt's own last logits, so it is the output's first token as without a draft.
    `sampling`: generate's decoding arguments for the draft (greedy by default). With `rounds` > 1
    each later draft continues from the first token through the cache the last round scored; with
    `verify`, from the last round's verified prefix on (`runtime.verified`); `reuse`: the cache
    stores the draft forward's keys and values for the verified tokens (`KvtoolCache.reuse_draft`).
    """
    sampling = sampling or {"do_sample": False}
    width = inputs["input_ids"].shape[1]
    mask = inputs["attention_mask"]
    one_more = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    drafted = model.generate(**inputs, **with_cache(model, cache_factory()), max_new_tokens=draft, **sampling)[:, width:]
    cache = prefix = None
    for round_ in range(rounds):
        if round_:
            # The first token is the prompt's own; the rest come through the cache the last round scored.
            resumed = {"input_ids": torch.cat([inputs["input_ids"], drafted[:, :1]], dim=1), "attention_mask": one_more}
            rest = model.generate(
                **resumed, **with_cache(model, cache), max_new_tokens=draft - 1, **sampling,
                **_forced(prefix, width),
            )[:, width + 1 :]
            drafted = torch.cat([drafted[:, :1], rest], dim=1)
        del cache  # one budget at a time
        longer = torch.cat([mask, mask.new_ones(drafted.shape)], dim=1)
        cache = cache_factory()
        cache.set_draft(drafted.shape[1], keep=verify and reuse)
        out = model(
            input_ids=torch.cat([inputs["input_ids"], drafted], dim=1), attention_mask=longer,
            position_ids=(longer.cumsum(dim=1) - 1).clamp(min=0), use_cache=True,
            logits_to_keep=drafted.shape[1] if verify else 1, **with_cache(model, cache),
        )
        if verify:
            prefix = verify_draft(cache, drafted, out.logits, reuse)
    return cache, {"input_ids": torch.cat([inputs["input_ids"], drafted[:, :1]], dim=1), "attention_mask": one_more}, prefix


def _forced(prefix: Verified | None, width: int) -> dict:
    """generate's keyword for feeding `prefix` (a prompt of `width` columns, its first token given)."""
    return {} if prefix is None else {"logits_processor": LogitsProcessorList([ForcedPrefix(prefix, width)])}


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    cache_factory: Callable[[], Any] | None = None,
    draft: int = 0,
    draft_rounds: int = 1,
    draft_verify: bool = False,
    draft_reuse: bool = False,
) -> GenerationResult:
    """Generate a continuation for each prompt as one left-padded batch.

    Greedy when `temperature` is 0, otherwise sampling at that temperature (seeded with `seed`).
    `cache_factory` builds the cache to use; by default a plain `DynamicCache` for the model's
    config, created here so its size can be read after generation. `draft` > 0 (a kvtool cache
    factory only): that many tokens are first generated through a compressed cache, and a fresh
    cache compresses the prompt with their attention in its scores (`drafted_cache`); generation
    then goes on from the draft's first token, which is the prompt's own next token; `draft_rounds`
    repeats the draft through each round's cache; `draft_verify` checks each draft with the full-attention
    logits of its own forward, and the output starts with the verified prefix (`runtime.verified`;
    greedy only: with a temperature the draft is used unchecked); `draft_reuse` stores that forward's
    keys and values for the verified tokens instead of recomputing them through the compressed cache.
    """
    if max_new_tokens < 1:
        raise KvtoolError("max-new-tokens must be at least 1")
    if temperature < 0:
        raise KvtoolError("temperature must be >= 0")
    if draft and cache_factory is None:
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
    with torch.inference_mode():
        started = time.perf_counter()
        if draft and max_new_tokens > 1:
            # A draft longer than the answer would score tokens nobody reads.
            cache, inputs, prefix = drafted_cache(
                # The verified prefix is the full cache's greedy answer: a sampled answer does not start with it.
                model, inputs, cache_factory, min(draft, max_new_tokens), sampling, draft_rounds,
                draft_verify and temperature == 0, draft_reuse,
            )
            max_new_tokens -= 1  # the draft's first token is the output's first
            clock.stamps.append(time.perf_counter())  # the prompt is compressed: what follows is decoding
        else:
            cache = cache_factory() if cache_factory is not None else DynamicCache(config=model.config)
            prefix = None
        sequences = model.generate(
            **inputs,
            **with_cache(model, cache),
            max_new_tokens=max_new_tokens,
            stopping_criteria=StoppingCriteriaList([clock]),
            **sampling,
            **_forced(prefix, prompt_width),
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
    )
