"""Timed runs of the full, the kvtool and the truncated ("ceiling") cache on the same prompts.

The three caches run in one process on the same model and prompts: one short warm-up run each,
then `repeat` rounds that run all three in turn (interleaved, so drift such as thermal throttling
or a neighbour's load hits all three alike; each round starts with the next cache), and the median
of each metric over the rounds, with every run kept in the report.

A run is one prompt forward followed by `new_tokens` one-token greedy decode forwards in a plain
loop (no `generate`, so the timings contain nothing but the model and the cache).

Over 400 lines because the runs, the side-by-side decode and the statistics share one notion of
what is timed; split, a reader would have to hold three files to know what a figure means.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtool.bench.config import WARMUP_NEW_TOKENS, WARMUP_PROMPT_TOKENS, BenchConfig
from kvtool.bench.peak import peak_memory_method, release_memory, track_peak, track_tensor_peak
from kvtool.errors import KvtoolError
from kvtool.profiles import Draft, Profile
from kvtool.runtime import attach
from kvtool.runtime.attach import layer_plans
from kvtool.runtime.draft import prepare
from kvtool.runtime.graphed import Decoder
from kvtool.runtime.importance import BlockTuning, tune_blocks
from kvtool.runtime.layer import LayerPlan
from kvtool.profiles import fingerprint_of
from kvtool.runtime.memory import kv_bytes, kv_bytes_by_type
from kvtool.runtime.row_groups import rows_at_once
from kvtool.runtime.steps import Prompt

# The three caches, in the order each round runs them (keys of the JSON report).
FULL, COMPRESSED, CEILING = "full", "compressed", "ceiling"
CACHES = (FULL, COMPRESSED, CEILING)
LABELS = {FULL: "full", COMPRESSED: "kvtool", CEILING: "truncated ceiling"}


@dataclass(frozen=True)
class RunResult:
    """One run of one cache.

    prefill_s: the prompt forward (for the ceiling including the truncation after it).
    decode_s: the `new_tokens` one-token forwards after it.
    kv_bytes: bytes of KV storage the cache holds at the end (`kvtool.runtime.memory.kv_bytes`).
    kv_slots: physical entries per layer at the end (sequence length of each layer's key tensor).
    peak_memory_bytes: peak memory during the run (see `kvtool.bench.peak`).
    prompt_peak_memory_bytes: peak memory during the prompt phase alone (what the first token costs).
    """

    prefill_s: float
    decode_s: float
    batch: int
    new_tokens: int
    kv_bytes: int
    kv_slots: tuple[int, ...]
    peak_memory_bytes: int
    prompt_peak_memory_bytes: int
    kv_by_type: dict[str, int] = field(default_factory=dict)  # bytes held per layer type (hybrid models)

    @property
    def decode_tok_s(self) -> float:
        return self.batch * self.new_tokens / self.decode_s

    @property
    def end_to_end_tok_s(self) -> float:
        return self.batch * self.new_tokens / (self.prefill_s + self.decode_s)


@dataclass(frozen=True)
class CacheStats:
    """The median over the measured runs of one cache (each metric's own median)."""

    prefill_s: float
    decode_tok_s: float
    end_to_end_tok_s: float
    kv_bytes: int
    peak_memory_bytes: int
    prompt_peak_memory_bytes: int
    kv_slots: tuple[int, ...]
    runs: tuple[RunResult, ...]

    @classmethod
    def of(cls, runs: Sequence[RunResult]) -> CacheStats:
        if not runs:
            raise ValueError("no runs to summarise")
        return cls(
            prefill_s=statistics.median(r.prefill_s for r in runs),
            decode_tok_s=statistics.median(r.decode_tok_s for r in runs),
            end_to_end_tok_s=statistics.median(r.end_to_end_tok_s for r in runs),
            kv_bytes=int(statistics.median(r.kv_bytes for r in runs)),  # the same in every run
            peak_memory_bytes=int(statistics.median(r.peak_memory_bytes for r in runs)),
            prompt_peak_memory_bytes=int(statistics.median(r.prompt_peak_memory_bytes for r in runs)),
            kv_slots=runs[-1].kv_slots,
            runs=tuple(runs),
        )


@dataclass(frozen=True)
class BenchResult:
    """Medians of the three caches plus what was measured; the ratios are derived from the parts."""

    full: CacheStats
    compressed: CacheStats
    ceiling: CacheStats
    config: BenchConfig
    profile: Profile
    torch_threads: int
    device: str
    dtype: str
    peak_memory_method: str
    # The CPU prompt kernel's block size, measured on this machine before the timed runs (None on
    # other devices, with a fixed size, or for short prompts).
    prompt_blocks: BlockTuning | None = None
    # The three caches decoding in turns (None when the run skipped it).
    side_by_side: SideBySide | None = None
    # Rows kvtool's prompt phase ran at once (`runtime.row_groups.rows_at_once`; the batch unless a
    # draft held its prompt in the memory the model computes in).
    prompt_rows_at_once: int | None = None

    @property
    def decode_speedup(self) -> float:
        return self.compressed.decode_tok_s / self.full.decode_tok_s

    @property
    def decode_speedup_ceiling(self) -> float:
        return self.ceiling.decode_tok_s / self.full.decode_tok_s

    @property
    def prefill_ratio(self) -> float:
        return self.compressed.prefill_s / self.full.prefill_s

    @property
    def kv_fraction(self) -> float:
        return self.compressed.kv_bytes / self.full.kv_bytes

    @property
    def kv_fraction_by_type(self) -> dict[str, float]:
        """Per layer type, kvtool's KV bytes over the full cache's (empty for a model of one type)."""
        full, kept = self.full.runs[0].kv_by_type, self.compressed.runs[0].kv_by_type
        if len(full) < 2:
            return {}
        return {kind: kept.get(kind, 0) / held for kind, held in full.items() if held}


# Decode steps per turn of the side-by-side decode: the three caches alternate every few seconds,
# so the machine's drift (20-30% within an hour on a shared 2-core machine) hits all three alike.
TURN_STEPS = 8


@dataclass(frozen=True)
class SideBySide:
    """Decode tokens/s of each cache per turn, measured with the three caches held at once and
    decoding in turns of `TURN_STEPS` steps (each turn starting from the next cache in rotation)."""

    turn_steps: int
    tok_s: dict[str, tuple[float, ...]]  # cache name -> tok/s of each of its turns
    # cache name -> the most tensor bytes its (untimed) prompt phase had allocated at once
    # (`kvtool.bench.peak.track_tensor_peak`): the peak without the resident set's noise.
    prompt_tensor_peak: dict[str, int] = field(default_factory=dict)

    def decode_tok_s(self, name: str) -> float:
        return statistics.median(self.tok_s[name])

    @property
    def decode_speedup(self) -> float:
        return self.decode_tok_s(COMPRESSED) / self.decode_tok_s(FULL)

    @property
    def decode_speedup_ceiling(self) -> float:
        return self.decode_tok_s(CEILING) / self.decode_tok_s(FULL)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_slots(cache: Any) -> tuple[int, ...]:
    """Physical entries each layer holds (0 for a layer that was never filled)."""
    slots = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        slots.append(int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0)
    return tuple(slots)


def truncate_like(cache: Any, plans: Sequence[LayerPlan | None]) -> None:
    """Cut each compressing layer of a plain cache to the entries kvtool keeps there after the prompt.

    Layer l keeps its first ceil(R_l * n) entries (n = prompt length): the same shapes as the kvtool
    cache, with no scoring and no merging. Sliding-window layers (whose mask follows the tokens they
    have seen), layers kvtool leaves alone (plan None) and layers at ratio 1 stay untouched.
    """
    for layer, plan in zip(cache.layers, plans):
        if plan is None or not plan.compresses or plan.native_window is not None or getattr(layer, "keys", None) is None:
            continue  # a sliding layer stays transformers' own: its mask follows the tokens it has seen
        n = int(layer.keys.shape[-2])
        keep = int(plan.keep(np.array([n]))[0])
        layer.keys = layer.keys[:, :, :keep].contiguous()
        layer.values = layer.values[:, :, :keep].contiguous()


def capped(draft: Draft | None, new_tokens: int) -> Draft | None:
    """A profile's draft, never longer than the tokens generated (as `generate` runs it)."""
    return draft and draft.capped(new_tokens)


def run_once(
    model: Any,
    ids: torch.Tensor,
    new_tokens: int,
    make_cache: Callable[[], Any],
    after_prefill: Callable[[Any], None] | None = None,
    draft: Draft | None = None,
    rows_at_once: int | None = None,
) -> RunResult:
    """One prompt forward plus `new_tokens` greedy one-token forwards with a fresh cache. With a
    `draft`, the prompt phase also drafts and compresses the prompt again: every pass counts as
    the prompt phase. `rows_at_once`: the prompt phase that many rows at a time (None: as `prepare`
    chooses, `runtime.row_groups.rows_at_once`)."""
    device = ids.device
    release_memory(device)
    with track_peak(device) as peak:
        _sync(device)
        t0 = time.perf_counter()
        state = prompt_phase(model, ids, make_cache, after_prefill, draft, rows_at_once)
        _sync(device)
        t1 = time.perf_counter()
        prompt_peak = peak.so_far()
        state.planned = new_tokens
        decode_steps(model, state, new_tokens)
        _sync(device)
        t2 = time.perf_counter()
    return RunResult(
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        batch=ids.shape[0],
        new_tokens=new_tokens,
        kv_bytes=kv_bytes(state.cache),
        kv_slots=layer_slots(state.cache),
        kv_by_type={kind: held for kind, (held, _) in kv_bytes_by_type(state.cache, fingerprint_of(model).layer_types).items()},
        peak_memory_bytes=peak.bytes,
        prompt_peak_memory_bytes=prompt_peak,
    )


@dataclass
class DecodeState:
    """A cache after its prompt phase, the token it decodes next and the steps it has decoded."""

    cache: Any
    token: torch.Tensor  # [B, 1]
    prompt_tokens: int
    steps: int = 0
    # Decode steps planned in all (a decoder with fixed slots makes room for them once); None: as
    # many as the first `decode_steps` call asks for.
    planned: int | None = None
    decoder: Decoder | None = None


def prompt_phase(
    model: Any,
    ids: torch.Tensor,
    make_cache: Callable[[], Any],
    after_prefill: Callable[[Any], None] | None = None,
    draft: Draft | None = None,
    rows_at_once: int | None = None,
) -> DecodeState:
    """The prompt forward of `run_once` (and with a `draft` its rounds, `kvtool.runtime.draft.prepare`):
    the cache and the first new token."""
    ready = prepare(model, Prompt.of({"input_ids": ids}), make_cache, draft, rows=rows_at_once)
    if after_prefill is not None:
        after_prefill(ready.cache)
    return DecodeState(cache=ready.cache, token=ready.first_logits.argmax(-1, keepdim=True), prompt_tokens=ids.shape[1])


def decode_steps(model: Any, state: DecodeState, steps: int) -> None:
    """`steps` greedy one-token forwards continuing `state` (a plain loop: nothing but the model and
    the cache). A kvtool cache on a GPU decodes as a CUDA graph (`kvtool.runtime.graphed`); its
    capture is part of the decode time."""
    bsz = state.token.shape[0]
    if state.decoder is None:
        state.decoder = Decoder(model, state.cache, state.planned or steps)
    for _ in range(steps):
        position = torch.full((bsz, 1), state.prompt_tokens + state.steps, device=state.token.device)
        state.token = state.decoder(state.token, position).argmax(-1, keepdim=True)
        state.steps += 1


def run_bench(
    model: Any,
    ids: torch.Tensor,
    profile: Profile,
    config: BenchConfig,
    *,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measure the full cache, `profile`'s kvtool cache and the truncated ceiling on `ids`.

    `ids` is [batch, prompt_tokens] on the model's device (see `kvtool.bench.prompts.long_prompts`);
    `progress(description)` is called before each of the `config.total_runs` runs. The model is
    attached to the profile only around the kvtool runs (the full and the ceiling runs see the model
    as it is without kvtool) and is detached when this returns.
    """
    from transformers import DynamicCache

    if tuple(ids.shape) != (config.batch, config.prompt_tokens):
        expected = (config.batch, config.prompt_tokens)
        raise KvtoolError(f"prompt ids have shape {tuple(ids.shape)}, expected {expected}")
    with attach(model, profile) as handle:  # refuses a profile made for another model before any run
        rows = rows_at_once(config.batch, capped(profile.method.draft, config.new_tokens), handle.bare_cache(), model)
    plans = layer_plans(profile)

    def plain_cache() -> Any:
        return DynamicCache(config=model.config)

    def measure(name: str, prompt: torch.Tensor, new_tokens: int) -> RunResult:
        # Only the kvtool runs use kvtool attention: the other two run the model as it is without kvtool.
        if name == COMPRESSED:
            with attach(model, profile) as handle:
                return run_once(model, prompt, new_tokens, handle.bare_cache, draft=capped(profile.method.draft, new_tokens))
        if name == CEILING:
            return run_once(model, prompt, new_tokens, plain_cache, lambda cache: truncate_like(cache, plans))
        return run_once(model, prompt, new_tokens, plain_cache)

    def side_by_side() -> SideBySide:
        """Each cache's prompt phase again (untimed, its tensors' peak measured), then the three decode `new_tokens` steps each
        in turns: the runs above decode minutes apart, so the machine's drift between them enters
        their ratio; here every turn of one cache sits between turns of the other two."""
        states: dict[str, DecodeState] = {}
        tensor_peak: dict[str, int] = {}
        for name in CACHES:
            if progress is not None:
                progress(f"side by side: prompt phase, {LABELS[name]}")
            with track_tensor_peak(ids.device) as peak:
                if name == COMPRESSED:
                    with attach(model, profile) as handle:
                        draft = capped(profile.method.draft, config.new_tokens)
                        states[name] = prompt_phase(model, ids, handle.bare_cache, draft=draft)
                else:
                    after = (lambda cache: truncate_like(cache, plans)) if name == CEILING else None
                    states[name] = prompt_phase(model, ids, plain_cache, after)
            tensor_peak[name] = peak.bytes
            states[name].planned = config.new_tokens
        tok_s: dict[str, list[float]] = {name: [] for name in CACHES}
        turn = 0
        while states[FULL].steps < config.new_tokens:
            steps = min(TURN_STEPS, config.new_tokens - states[FULL].steps)
            for name in CACHES[turn % 3:] + CACHES[: turn % 3]:
                # As in the runs: kvtool attention for the kvtool cache only.
                with attach(model, profile) if name == COMPRESSED else contextlib.nullcontext():
                    _sync(ids.device)
                    start = time.perf_counter()
                    decode_steps(model, states[name], steps)
                    _sync(ids.device)
                    tok_s[name].append(ids.shape[0] * steps / (time.perf_counter() - start))
            turn += 1
        return SideBySide(turn_steps=TURN_STEPS, tok_s={name: tuple(v) for name, v in tok_s.items()}, prompt_tensor_peak=tensor_peak)

    blocks = None
    if ids.device.type == "cpu":
        shape = model.config.get_text_config()
        head_dim = getattr(shape, "head_dim", None) or shape.hidden_size // shape.num_attention_heads
        blocks = tune_blocks(
            shape.num_attention_heads, shape.num_key_value_heads, head_dim, config.prompt_tokens,
            next(model.parameters()).dtype,
        )
    runs: dict[str, list[RunResult]] = {name: [] for name in CACHES}
    warmup_ids = ids[:, : min(WARMUP_PROMPT_TOKENS, config.prompt_tokens)]
    with torch.inference_mode():
        for name in CACHES:
            if progress is not None:
                progress(f"warm-up: {LABELS[name]}")
            measure(name, warmup_ids, min(WARMUP_NEW_TOKENS, config.new_tokens))
        for round_index in range(config.repeat):
            # Interleaved, so drift hits all three alike, and each round starts one cache later: a
            # cache always first after the previous round's decode ran its prompt phase up to 30%
            # slower than the same forward in another place of the round.
            for name in CACHES[round_index % 3:] + CACHES[: round_index % 3]:
                if progress is not None:
                    progress(f"run {round_index + 1}/{config.repeat}: {LABELS[name]}")
                runs[name].append(measure(name, ids, config.new_tokens))
        release_memory(ids.device)
        paired = side_by_side() if config.side_by_side else None
    return BenchResult(
        full=CacheStats.of(runs[FULL]),
        compressed=CacheStats.of(runs[COMPRESSED]),
        ceiling=CacheStats.of(runs[CEILING]),
        config=config,
        profile=profile,
        torch_threads=torch.get_num_threads(),
        device=str(ids.device),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        peak_memory_method=peak_memory_method(ids.device),
        prompt_blocks=blocks,
        side_by_side=paired,
        prompt_rows_at_once=rows,
    )
