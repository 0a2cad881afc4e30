"""Run every method at every budget on the same prompts and references (the papers' protocol).

Per batch of left-padded prompts, the full cache runs once: its greedy continuation is the ROUGE-L
target and, unless the data has answers, the PPL reference; its NLL of the references is the full
PPL. Then every (method, budget) runs the prompt through its own compressed cache and, from copies
of that state, (1) teacher-forces the references token by token with the generation-time rule
active, scoring every reference token, and (2) decodes greedily for ROUGE-L; the physical KV bytes
at the end of (2) against a full cache's give the kept fraction, their largest value after any step
the peak. `score_from = K` leaves the first K tokens of every reference and output out of PPL,
top-1 and ROUGE-L (accuracy reads the whole output). A profile's draft prepares each batch's cache
as `generate` does (`kvtool.runtime.draft.prepare`).

Over 300 lines because the protocol (one full-cache run, then every method from copies of the same
state) is one loop whose steps share their state; split, its order would be hard to follow.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtool.calibration.choose import choose_profiles
from kvtool.data import EVALUATION_DATA, Record, load_jsonl, packaged_data
from kvtool.errors import KvtoolError
from kvtool.evaluation.metrics import answer_accuracy, rouge_l_f1
from kvtool.evaluation.results import POSITION_BUCKETS, EvalReport, FullOutput, MethodResult, PromptResults
from kvtool.models import image_token_ids
from kvtool.models.loader import as_loaded, eos_token_ids
from kvtool.profiles import MethodSettings, Profile
from kvtool.profiles.kept_fraction import check_budget
from kvtool.runtime import attach
from kvtool.runtime.draft import prepare
from kvtool.profiles import fingerprint_of
from kvtool.runtime.memory import kv_bytes, kv_bytes_by_type, kv_bytes_full
from kvtool.runtime.methods import get_method, method_profile
from kvtool.runtime.precision import KVStorage, entries_for, native_bytes
from kvtool.scoring import (
    Batch,
    NllTotal,
    References,
    encode_batches,
    prompt_forward,
    reference_continuations,
    teacher_forced,
)

Progress = Callable[[str, int, int], None]
Notify = Callable[[str], None]

DEFAULT_METHODS = ("kvtool", "prefixkv", "h2o", "tova", "local")
DEFAULT_BUDGETS = (0.1, 0.2, 0.5)
STAGE_FULL = "full cache"
STAGE_COMPRESSED = "compressed caches"


@dataclass(frozen=True)
class EvalConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    max_new_tokens: int = 64
    batch_size: int = 4
    max_prompt_tokens: int = 2048  # the packaged retrieval prompts reach ~1.9k tokens; a cut could drop a needle
    score_from: int = 0  # reference / output tokens left out of PPL, top-1 and ROUGE-L, from the start
    # How every method stores the entries it keeps ("int8", "int8/int4-g32"; precision.KVStorage):
    # at the same bytes, a lower precision keeps more of them. None: kvtool's recipe as calibrated
    # (its layers' own formats), every other method at the model's own precision.
    kv_format: str | None = None

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
        if not 0 <= self.score_from < self.max_new_tokens:
            raise KvtoolError(f"--score-from must be at least 0 and below --max-new-tokens ({self.max_new_tokens}), got {self.score_from}")
        methods = tuple(dict.fromkeys(self.methods))
        return EvalConfig(
            methods, tuple(dict.fromkeys(budgets)), self.max_new_tokens, self.batch_size, self.max_prompt_tokens, self.score_from,
            None if self.kv_format is None else KVStorage.parse(self.kv_format).name,
        )


@dataclass(frozen=True)
class _BatchTargets:
    batch: Batch
    references: References  # PPL references (answers or the full greedy continuation)
    full_texts: list[str]  # full-cache greedy outputs, per row
    full_ids: list[tuple[int, ...]]  # their token ids, per row


@dataclass
class _PerPrompt:
    """Per-prompt scores filled in data order (batches group prompts by length)."""

    size: int
    nll: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rouge_l: list[float] = field(default_factory=list)
    accuracy: list[float | None] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    nll_by_position: list[tuple[float, ...]] = field(default_factory=list)
    tokens_by_position: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nll, self.tokens = [0.0] * self.size, [0] * self.size
        self.rouge_l, self.accuracy = [math.nan] * self.size, [None] * self.size
        empty = len(POSITION_BUCKETS)
        self.nll_by_position, self.tokens_by_position = [(0.0,) * empty] * self.size, [(0,) * empty] * self.size

    def add_nll(self, rows: tuple[int, ...], nll: torch.Tensor, scored: torch.Tensor) -> None:
        # The reference's token t (0-based) is answer position t + 1.
        position = torch.arange(1, nll.shape[1] + 1, device=nll.device)
        buckets = [(position >= first) & (position <= (last or nll.shape[1])) for first, last in POSITION_BUCKETS]
        for b, row in enumerate(rows):
            self.nll[row] = float(nll[b][scored[b]].sum())
            self.tokens[row] = int(scored[b].sum())
            self.nll_by_position[row] = tuple(float(nll[b][scored[b] & bucket].sum()) for bucket in buckets)
            self.tokens_by_position[row] = tuple(int((scored[b] & bucket).sum()) for bucket in buckets)

    def add_top1(self, rows: tuple[int, ...], top1: torch.Tensor) -> None:
        if not self.top1:
            self.top1 = [0] * self.size
        for b, row in enumerate(rows):
            self.top1[row] = int(top1[b].sum())

    def scores(self) -> PromptResults:
        return PromptResults(
            tuple(self.nll), tuple(self.tokens), tuple(self.rouge_l), tuple(self.accuracy), tuple(self.top1),
            tuple(self.nll_by_position), tuple(self.tokens_by_position),
        )


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def _token_ids(refs: References) -> list[tuple[int, ...]]:
    return [tuple(refs.tokens[b][refs.scored[b]].tolist()) for b in range(refs.tokens.shape[0])]


def _texts(tokenizer: Any, refs: References, start: int = 0) -> list[str]:
    return [tokenizer.decode(list(ids[start:]), skip_special_tokens=True).strip() for ids in _token_ids(refs)]


def _scored_from(scored: torch.Tensor, start: int) -> torch.Tensor:
    """`scored` without its first `start` steps."""
    if start == 0:
        return scored
    scored = scored.clone()
    scored[:, :start] = False
    return scored


class _Evaluation:
    def __init__(self, loaded: Any, config: EvalConfig, records: Sequence[Record], progress: Progress) -> None:
        self.loaded = loaded
        self.records = records
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.progress = progress
        self.eos = eos_token_ids(self.model, self.tokenizer)
        self.pad = self.tokenizer.pad_token_id

    def _greedy(
        self, cache: Any, first_logits: Any, batch: Batch, on_step: Callable[[], None] | None = None, prefix: Any = None
    ) -> References:
        return reference_continuations(
            self.model, cache, first_logits, batch, length=self.config.max_new_tokens,
            eos_ids=self.eos, pad_id=self.pad, answers=[None] * len(batch.rows), on_step=on_step, prefix=prefix,
        )

    def _scored_texts(self, greedy: References, rows: tuple[int, ...], into: _PerPrompt) -> list[str]:
        """Score accuracy on the whole greedy outputs; return the texts ROUGE-L compares (from
        `score_from` on; decoded once more only when that cuts anything)."""
        whole = _texts(self.tokenizer, greedy)
        self._accuracy(rows, whole, into)
        return _texts(self.tokenizer, greedy, self.config.score_from) if self.config.score_from else whole

    def _accuracy(self, rows: tuple[int, ...], texts: list[str], into: _PerPrompt) -> None:
        for row, text in zip(rows, texts):
            if self.records[row].answers:
                into.accuracy[row] = answer_accuracy(text, self.records[row].answers)

    def full_pass(
        self, batches: list[Batch], answers: list[list[list[int] | None]]
    ) -> tuple[list[_BatchTargets], NllTotal, _PerPrompt]:
        from transformers import DynamicCache

        targets, total, per_prompt = [], NllTotal(), _PerPrompt(len(self.records))
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
            scored = _scored_from(refs.scored, self.config.score_from)
            total.add(refs.nll_full, scored)
            per_prompt.add_nll(batch.rows, refs.nll_full, scored)
            texts = self._scored_texts(greedy, batch.rows, per_prompt)
            targets.append(_BatchTargets(batch, refs, texts, _token_ids(greedy)))
        self.progress(STAGE_FULL, len(batches), len(batches))
        return targets, total, per_prompt

    def _answer_length(self, batch_answers: list[list[int] | None]) -> int:
        # Answers are scored whole; rows without one score the greedy continuation (max_new_tokens).
        lengths = [len(a) for a in batch_answers if a is not None]
        return max([self.config.max_new_tokens, *lengths])

    def method_pass(self, profile: Profile, method: str, budget: float, targets: list[_BatchTargets], tick: Callable[[], None]) -> MethodResult:
        nll, kept, peak, full = NllTotal(), 0, 0, 0
        by_type: dict[str, list[int]] = {}
        kinds = fingerprint_of(self.model).layer_types
        per_prompt = _PerPrompt(len(self.records))
        verified = [0] * len(self.records)
        draft = profile.method.draft
        draft = draft and draft.capped(self.config.max_new_tokens)  # as generate: no longer than the answer
        with attach(self.model, profile) as handle:
            for target in targets:
                ready = prepare(self.model, target.batch, handle.bare_cache, draft)
                cache, first, prefix = ready.cache, ready.first_logits, ready.prefix
                del ready
                greedy_cache = copy.deepcopy(cache)
                forced = teacher_forced(self.model, cache, first, target.batch, target.references)
                scored = _scored_from(target.references.scored, self.config.score_from)
                nll.add(forced.nll, scored)
                per_prompt.add_nll(target.batch.rows, forced.nll, scored)
                per_prompt.add_top1(target.batch.rows, forced.top1 & scored)
                largest = [kv_bytes(greedy_cache)]
                greedy = self._greedy(
                    greedy_cache, first, target.batch, on_step=lambda: largest.append(kv_bytes(greedy_cache)), prefix=prefix
                )
                if prefix is not None:
                    written = greedy.scored.sum(dim=1).cpu()
                    for b, row in enumerate(target.batch.rows):
                        verified[row] = int(min(prefix.lengths[b], written[b]))
                kept += largest[-1]
                peak += max(largest)
                full += kv_bytes_full(greedy_cache)
                for kind, (held, whole) in kv_bytes_by_type(greedy_cache, kinds).items():
                    sums = by_type.setdefault(kind, [0, 0])
                    sums[0] += held
                    sums[1] += whole
                texts = self._scored_texts(greedy, target.batch.rows, per_prompt)
                for row, text, target_text in zip(target.batch.rows, texts, target.full_texts):
                    per_prompt.rouge_l[row] = rouge_l_f1(text, target_text)
                tick()
        rouge = per_prompt.rouge_l
        return MethodResult(
            method=method, budget=budget, ppl=nll.ppl(), rouge_l=sum(rouge) / len(rouge),
            kv_fraction=kept / full if full else math.nan, tokens=nll.count, rouge_l_per_prompt=tuple(rouge),
            kv_peak_fraction=peak / full if full else math.nan, draft=draft.tokens if draft else 0,
            draft_rounds=draft.rounds if draft else 1, draft_verify=bool(draft and draft.verify),
            draft_jacobi=bool(draft and draft.jacobi and draft.rounds > 1),
            verified_per_prompt=tuple(verified) if draft and draft.verify else (),
            per_prompt=per_prompt.scores(),
            kv_fraction_by_type={kind: held / whole for kind, (held, whole) in by_type.items() if whole} if len(by_type) > 1 else {},
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

    Per-layer methods (kvtool, prefixkv, prefixkv-evict) take their recipe and ratios from `profile`, else from the
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
    # Every method shares the calibrated profile's sinks, recent window and D; without per-layer
    # methods a model with no calibrated profile is not calibrated just for those.
    # At a lower precision a budget keeps more entries: the calibrated profile nearest that share of
    # entries is the recipe's base (`precision.at_storage` then spends the budget's bytes on it).
    storage = None if config.kv_format is None else KVStorage.parse(config.kv_format)
    entries = {budget: entries_for(budget, storage, loaded.model) for budget in config.budgets}
    chosen = choose_profiles(
        loaded, sorted(set(entries.values())), profile_path=profile,
        calibrate_missing=any(get_method(m).per_layer for m in config.methods), progress=report, notify=say,
    )
    bases = {budget: chosen[entries[budget]].profile for budget in config.budgets if entries[budget] in chosen}
    source = "; ".join(f"{b:g}: {chosen[e].source}" for b, e in entries.items() if e in chosen) or "none needed (no per-layer method)"
    settings = next(iter(bases.values())).method if bases else MethodSettings()

    _note_text_prior(loaded, config, records, say)
    batches, answers = encode_batches(
        loaded, records, max_tokens=config.max_prompt_tokens, method=settings, batch_size=config.batch_size
    )
    run = _Evaluation(loaded, config, records, report)
    results = []
    with torch.inference_mode():
        targets, full_nll, full_scores = run.full_pass(batches, answers)
        total = len(config.methods) * len(config.budgets) * len(batches)
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            report(STAGE_COMPRESSED, done, total)

        report(STAGE_COMPRESSED, 0, total)
        for budget in config.budgets:
            for name in config.methods:
                method_prof = method_profile(name, loaded.model, budget, bases.get(budget), storage)
                results.append(run.method_pass(method_prof, name, budget, targets, tick))
    has_answers = [r.answer is not None for r in records]
    kind = "answers" if all(has_answers) else ("full-cache greedy" if not any(has_answers) else "mixed")
    return EvalReport(
        model=loaded.name, data=data_name, samples=len(records), max_new_tokens=config.max_new_tokens,
        score_from=config.score_from,
        references=kind, full_ppl=full_nll.ppl(), reference_tokens=full_nll.count, profile_source=source,
        results=tuple(results), seconds=time.perf_counter() - started,
        kinds=tuple(r.kind for r in records), full_outputs=_full_outputs(targets, len(records)),
        full=full_scores.scores(), kv_format=config.kv_format or "as calibrated", native_bytes=native_bytes(loaded.model),
    )


def _full_outputs(targets: list[_BatchTargets], size: int) -> tuple[FullOutput, ...]:
    outputs: list[FullOutput | None] = [None] * size
    for target in targets:
        for row, text, ids in zip(target.batch.rows, target.full_texts, target.full_ids):
            outputs[row] = FullOutput(text, ids)
    return tuple(outputs)


def _note_text_prior(loaded: Any, config: EvalConfig, records: Sequence[Record], say: Notify) -> None:
    """Say so when a text-prior method runs where no prompt has image tokens (the prior then ranks
    nothing differently: the method is importance anchors + its merging)."""
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
