"""Run every method at every budget on the same prompts and references (the papers' protocol).

Per batch of left-padded prompts, the full cache runs once: its greedy continuation is the ROUGE-L
target and, unless the data has answers, the PPL reference; its NLL of the references is the full
PPL. Then every (method, budget) runs the prompt through its own compressed cache and, from copies
of that state, (1) teacher-forces the references token by token with the generation-time rule
active, scoring every reference token, and (2) decodes greedily for ROUGE-L; the physical KV bytes
at the end of (2) against a full cache's give the kept fraction.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtool.profiles.budget import check_budget
from kvtool.data import EVALUATION_DATA, Record, load_jsonl, packaged_data
from kvtool.errors import KvtoolError
from kvtool.evaluate.metrics import rouge_l_f1
from kvtool.evaluate.results import EvalReport, MethodResult
from kvtool.models.loader import as_loaded, eos_token_ids
from kvtool.profiles import MethodSettings, Profile
from kvtool.runtime.methods import get_method
from kvtool.scoring import (
    Batch,
    NllTotal,
    References,
    encode_batches,
    prompt_forward,
    reference_continuations,
    teacher_forced_nll,
)

Progress = Callable[[str, int, int], None]
Notify = Callable[[str], None]

DEFAULT_METHODS = ("local", "h2o", "elastic", "prefixkv")
DEFAULT_BUDGETS = (0.1, 0.2, 0.5)
STAGE_FULL = "full cache"
STAGE_COMPRESSED = "compressed caches"


@dataclass(frozen=True)
class EvalConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    max_new_tokens: int = 64
    batch_size: int = 4
    max_prompt_tokens: int = 1024

    def checked(self) -> "EvalConfig":
        if not self.methods:
            raise KvtoolError("no methods to evaluate")
        for name in self.methods:
            get_method(name)
        if not self.budgets:
            raise KvtoolError("no budgets to evaluate")
        budgets = tuple(check_budget(b) for b in self.budgets)
        if self.max_new_tokens < 1:
            raise KvtoolError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise KvtoolError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.max_prompt_tokens < 16:
            raise KvtoolError(f"--max-prompt-tokens must be at least 16, got {self.max_prompt_tokens}")
        methods = tuple(dict.fromkeys(self.methods))
        return EvalConfig(methods, tuple(dict.fromkeys(budgets)), self.max_new_tokens, self.batch_size, self.max_prompt_tokens)


@dataclass(frozen=True)
class _BatchTargets:
    batch: Batch
    references: References  # PPL references (answers or the full greedy continuation)
    full_texts: list[str]  # full-cache greedy outputs, per row


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def _texts(tokenizer: Any, refs: References) -> list[str]:
    return [
        tokenizer.decode(refs.tokens[b][refs.scored[b]].tolist(), skip_special_tokens=True).strip()
        for b in range(refs.tokens.shape[0])
    ]


class _Evaluation:
    def __init__(self, loaded: Any, config: EvalConfig, progress: Progress) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.progress = progress
        self.eos = eos_token_ids(self.model, self.tokenizer)
        self.pad = self.tokenizer.pad_token_id

    def _greedy(self, cache: Any, first_logits: Any, batch: Batch) -> References:
        return reference_continuations(
            self.model, cache, first_logits, batch, length=self.config.max_new_tokens,
            eos_ids=self.eos, pad_id=self.pad, answers=[None] * len(batch.rows),
        )

    def full_pass(self, batches: list[Batch], answers: list[list[list[int] | None]]) -> tuple[list[_BatchTargets], NllTotal]:
        from transformers import DynamicCache

        targets, total = [], NllTotal()
        for done, (batch, batch_answers) in enumerate(zip(batches, answers)):
            self.progress(STAGE_FULL, done, len(batches))
            cache = DynamicCache(config=self.model.config)
            first = prompt_forward(self.model, batch, cache)
            if any(a is not None for a in batch_answers):
                greedy = self._greedy(copy.deepcopy(cache), first, batch)
                refs = reference_continuations(
                    self.model, cache, first, batch, length=self._answer_length(batch_answers),
                    eos_ids=self.eos, pad_id=self.pad, answers=batch_answers,
                )
            else:
                refs = greedy = self._greedy(cache, first, batch)
            total.add(refs.nll_full, refs.scored)
            targets.append(_BatchTargets(batch, refs, _texts(self.tokenizer, greedy)))
        self.progress(STAGE_FULL, len(batches), len(batches))
        return targets, total

    def _answer_length(self, batch_answers: list[list[int] | None]) -> int:
        # Answers are scored whole; rows without one score the greedy continuation (max_new_tokens).
        lengths = [len(a) for a in batch_answers if a is not None]
        return max([self.config.max_new_tokens, *lengths])

    def method_pass(self, profile: Profile, method: str, budget: float, targets: list[_BatchTargets], tick: Callable[[], None]) -> MethodResult:
        from kvtool.runtime import attach
        from kvtool.runtime.memory import kv_bytes, kv_bytes_full

        nll, rouge, kept, full = NllTotal(), [], 0, 0
        with attach(self.model, profile) as handle:
            for target in targets:
                cache = handle.new_cache()
                first = prompt_forward(self.model, target.batch, cache)
                greedy_cache = copy.deepcopy(cache)
                scores = teacher_forced_nll(self.model, cache, first, target.batch, target.references)
                nll.add(scores, target.references.scored)
                greedy = self._greedy(greedy_cache, first, target.batch)
                kept += kv_bytes(greedy_cache)
                full += kv_bytes_full(greedy_cache)
                rouge += [rouge_l_f1(p, t) for p, t in zip(_texts(self.tokenizer, greedy), target.full_texts)]
                tick()
        return MethodResult(
            method=method, budget=budget, ppl=nll.ppl(), rouge_l=sum(rouge) / len(rouge),
            kv_fraction=kept / full if full else math.nan, tokens=nll.count, rouge_l_per_prompt=tuple(rouge),
        )


def evaluate(
    model: Any,
    *,
    data: str | Path | Sequence[Record] | None = None,
    profile: str | Path | None = None,
    config: EvalConfig = EvalConfig(),
    progress: Progress | None = None,
    notify: Notify | None = None,
) -> EvalReport:
    """Evaluate `config.methods` at `config.budgets` on `data` (default: the packaged evaluation prompts).

    Per-layer methods (prefixkv, prefixkv-evict) take their ratios from `profile`, else from the
    model's built-in calibrated profile, else from a calibration run on the packaged calibration
    prompts made first (announced through `notify`). Every method shares that profile's sink
    tokens, recent window and truncation distance.
    """
    started = time.perf_counter()
    config = config.checked()
    report = progress or _no_progress
    say = notify or (lambda line: None)
    data_name = str(data) if isinstance(data, (str, Path)) else ("records" if data is not None else EVALUATION_DATA)
    records = tuple(data) if isinstance(data, Sequence) and not isinstance(data, str) else load_jsonl(data or packaged_data(EVALUATION_DATA))
    if not records:
        raise KvtoolError("no evaluation prompts")
    loaded = as_loaded(model, "evaluate")
    bases, source = _base_profiles(loaded, config, profile, report, say)
    settings = next(iter(bases.values())).method if bases else MethodSettings()

    _note_text_prior(loaded, config, records, say)
    batches, answers = encode_batches(
        loaded, records, max_tokens=config.max_prompt_tokens, method=settings, batch_size=config.batch_size
    )
    run = _Evaluation(loaded, config, report)
    results = []
    with torch.inference_mode():
        targets, full_nll = run.full_pass(batches, answers)
        total = len(config.methods) * len(config.budgets) * len(batches)
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            report(STAGE_COMPRESSED, done, total)

        report(STAGE_COMPRESSED, 0, total)
        from kvtool.runtime.methods import method_profile

        for budget in config.budgets:
            for name in config.methods:
                method_prof = method_profile(name, loaded.model, budget, bases.get(budget))
                results.append(run.method_pass(method_prof, name, budget, targets, tick))
    has_answers = [r.answer is not None for r in records]
    kind = "answers" if all(has_answers) else ("full-cache greedy" if not any(has_answers) else "mixed")
    return EvalReport(
        model=loaded.name, data=data_name, samples=len(records), max_new_tokens=config.max_new_tokens,
        references=kind, full_ppl=full_nll.ppl(), reference_tokens=full_nll.count, profile_source=source,
        results=tuple(results), seconds=time.perf_counter() - started,
    )


def _note_text_prior(loaded: Any, config: EvalConfig, records: Sequence[Record], say: Notify) -> None:
    """Say so when a text-prior method runs where no prompt has image tokens (the prior then ranks
    nothing differently: the method is importance anchors + its merging)."""
    from kvtool.runtime.attach import image_token_ids

    names = [m for m in config.methods if get_method(m).selection == "text-prior"]
    if not names or any(r.images for r in records):
        return
    why = (
        f"{loaded.name} is a text-only model"
        if not image_token_ids(loaded.model.config)
        else "no evaluation prompt has images"
    )
    for name in names:
        method = get_method(name)
        say(
            f"note: {name}'s text prior is a no-op here ({why}: no image tokens), so {name} = importance "
            f"anchors + {method.merge} merging, the same ratio in every layer"
        )


def _base_profiles(loaded: Any, config: EvalConfig, profile: str | Path | None, progress: Progress, say: Notify) -> tuple[dict[float, Profile], str]:
    """Per budget, the calibrated profile methods draw ratios (per-layer ones) and settings from."""
    from kvtool.profiles.builtin import builtin_profiles
    from kvtool.runtime import load_profile

    if profile is not None:
        base = load_profile(profile)
        return {b: base for b in config.budgets}, f"profile {profile} (calibrated for budget {base.budget:g})"
    shipped = builtin_profiles(loaded.name)
    if shipped:
        profiles = {path.name: load_profile(path) for path in shipped}
        chosen = {b: min(profiles.items(), key=lambda item: (abs(item[1].budget - b), item[1].budget)) for b in config.budgets}
        names = sorted({name for name, _ in chosen.values()})
        return {b: p for b, (_, p) in chosen.items()}, f"built-in {', '.join(names)}"
    if not any(get_method(m).per_layer for m in config.methods):
        return {}, "none needed (no per-layer method)"
    from kvtool.calibrate.runner import calibrate

    budget = min(config.budgets, key=lambda b: (abs(b - 0.2), b))
    say(
        f"no calibrated profile for {loaded.name}: calibrating on the packaged calibration prompts at budget "
        f"{budget:g} first (pass --profile to use your own)"
    )
    result = calibrate(loaded, budget, progress=progress)
    return {b: result.profile for b in config.budgets}, f"calibrated now on the packaged prompts (budget {budget:g})"
