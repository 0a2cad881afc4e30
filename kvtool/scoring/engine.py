"""Scoring through any cache (full or compressed): references and teacher-forced NLL, token by token.

Calibration and evaluation score the same way: one prompt forward per batch (which, through a
kvtool cache created with `record_importance`, also records every compressing layer's importance),
then one token per row per step, from the prompt's last logits on. `step_tokens` is that loop
(`kvtool.runtime.steps`, which the draft runs on too); what a step does with its logits differs:

- `reference_continuations` picks the next token (greedy, or the dataset's answer) and scores it:
  on a full cache these are the references and their full-cache NLL;
- `teacher_forced_nll` feeds given references and scores them: through a compressed cache, with
  the generation-time eviction active, this is the compressed NLL.

A reference ends at its first EOS (scored, as the model must predict it); later steps are padding
and not scored. PPL = exp(mean NLL), pooled over all scored tokens of all samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtool.runtime.steps import StepAction, StepHook, prompt_forward, prompt_logits, step_tokens
from kvtool.scoring.deferred import DeferredHead
from kvtool.scoring.batches import Batch

__all__ = [  # the prompt forward and the step loop are the runtime's (`runtime.steps`), shared with the draft
    "StepAction", "StepHook", "prompt_forward", "prompt_logits", "step_tokens", "References", "NllTotal",
    "PromptMeanNll", "reference_continuations", "Forced", "teacher_forced", "teacher_forced_nll",
]

def _nll(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    # At the logits' own precision (float32 at least), not float64 always: float32 logits carry no
    # more, and over Gemma 3's 262,144 logits a float64 log-softmax took 64 ms for 30 rows on the
    # 2-core CPU against 8 ms (per-token NLLs moved by under 2e-5).
    logp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    return -logp.gather(1, token[:, None])[:, 0].to(torch.float64)


@dataclass(frozen=True)
class References:
    """Per batch: reference tokens, which of them are scored, and their full-cache NLL."""

    tokens: torch.Tensor  # [B, L] long; padding where not scored
    scored: torch.Tensor  # [B, L] bool
    nll_full: torch.Tensor  # [B, L] float64; 0 where not scored

    def repeated(self, times: int) -> "References":
        """The same references `times` times over, block after block (see `Batch.repeated`)."""
        return References(*(torch.cat([t] * times) for t in (self.tokens, self.scored, self.nll_full)))

    @property
    def steps(self) -> int:
        """Columns up to the last scored one in any row (the forwards a teacher-forced pass needs)."""
        used = self.scored.any(dim=0).nonzero()
        return int(used[-1]) + 1 if len(used) else 0


@dataclass
class NllTotal:
    """Sum of NLL and count of scored tokens, pooled over batches."""

    total: float = 0.0
    count: int = 0

    def add(self, nll: torch.Tensor, scored: torch.Tensor) -> None:
        self.total += float(nll[scored].sum())
        self.count += int(scored.sum())

    def ppl(self) -> float:
        return math.exp(self.total / self.count) if self.count else float("nan")


@dataclass
class PromptMeanNll:
    """Each prompt's mean NLL over its scored tokens, collected over batches.

    `ppl()` = exp(mean over prompts): every prompt counts the same, however long its reference, so a
    retrieval prompt whose reference is a short exact answer weighs as much as a 64-token chat
    continuation (pooled over tokens, the long references outvote it)."""

    means: list[float] = field(default_factory=list)
    count: int = 0  # scored tokens, all prompts

    def add(self, nll: torch.Tensor, scored: torch.Tensor) -> None:
        tokens = scored.sum(dim=1)
        sums = (nll * scored).sum(dim=1)
        for total, n in zip(sums.tolist(), tokens.tolist()):
            if n:
                self.means.append(total / n)
        self.count += int(tokens.sum())

    def ppl(self) -> float:
        return math.exp(sum(self.means) / len(self.means)) if self.means else float("nan")


def reference_continuations(
    model: Any,
    cache: Any,
    first_logits: torch.Tensor,
    batch: Batch,
    *,
    length: int,
    eos_ids: set[int],
    pad_id: int,
    answers: Sequence[list[int] | None],
    on_step: StepHook | None = None,
    prefix: Any = None,
) -> References:
    """Greedy continuation (or the given answer) of every row, with its NLL through `cache`.

    `cache` holds the prompt and `first_logits` [B, V] the prompt forward's last logits. A row with
    an answer is forced along it (cut to `length`) and ends with it; a row without one follows its
    argmax until its first EOS or `length` tokens, after the tokens of `prefix` (a verified
    draft's, `runtime.draft.Verified`) where it has them.
    """
    rows = first_logits.shape[0]
    device = first_logits.device
    forced = torch.full((rows, length), -1, dtype=torch.long, device=device)
    answer_len = torch.zeros(rows, dtype=torch.long, device=device)
    for b, answer in enumerate(answers):
        if answer is not None:
            ids = answer[:length]
            forced[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            answer_len[b] = len(ids)
    has_answer = torch.tensor([a is not None for a in answers], device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

    tokens = torch.full((rows, length), pad_id, dtype=torch.long, device=device)
    scored = torch.zeros(rows, length, dtype=torch.bool, device=device)
    nll = torch.zeros(rows, length, dtype=torch.float64, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    if prefix is not None:
        prefix = prefix.to(device)

    def choose_and_score(t: int, logits: torch.Tensor) -> torch.Tensor | None:
        nonlocal finished
        active = ~finished & (~has_answer | (t < answer_len))
        greedy = logits.argmax(dim=-1) if prefix is None else prefix.choose(t, logits)
        choice = torch.where(has_answer, forced[:, t].clamp(min=0), greedy)
        token = torch.where(active, choice, torch.full_like(choice, pad_id))
        tokens[:, t], scored[:, t] = token, active
        nll[:, t] = torch.where(active, _nll(logits, token), 0.0)
        ended_by_eos = ~has_answer & torch.isin(token, eos)
        finished |= ~active | ended_by_eos
        return None if bool(finished.all()) else token

    step_tokens(model, cache, first_logits, batch, length, choose_and_score, on_step)
    return References(tokens=tokens, scored=scored, nll_full=nll)


@dataclass(frozen=True)
class Forced:
    """What a teacher-forced pass measured per reference token: its NLL and whether it was the
    compressed cache's own top choice (where the greedy output would have stayed on the reference)."""

    nll: torch.Tensor  # [B, L] float64; 0 where not scored
    top1: torch.Tensor  # [B, L] bool; False where not scored


def teacher_forced(
    model: Any,
    cache: Any,
    first_logits: torch.Tensor,
    batch: Batch,
    references: References,
    on_step: StepHook | None = None,
) -> Forced:
    """The reference tokens fed one at a time through `cache`: their NLL and top-1 agreement.

    The tokens fed are given, so where it applies the output layer runs once over all steps after
    the first (`scoring.deferred`), not once per step."""
    rows, length = references.tokens.shape
    nll = torch.zeros(rows, length, dtype=torch.float64, device=first_logits.device)
    top1 = torch.zeros(rows, length, dtype=torch.bool, device=first_logits.device)

    def score(t: int, logits: torch.Tensor) -> torch.Tensor:
        token, scored = references.tokens[:, t], references.scored[:, t]
        nll[:, t] = torch.where(scored, _nll(logits, token), 0.0)
        top1[:, t] = scored & (logits.argmax(dim=-1) == token)
        return token

    steps = references.steps
    if not DeferredHead.applies(model, cache, steps):
        step_tokens(model, cache, first_logits, batch, steps, score, on_step)
        return Forced(nll=nll, top1=top1)

    with DeferredHead(model) as head:
        deferred = False

        def feed(t: int, logits: torch.Tensor) -> torch.Tensor:
            nonlocal deferred
            if deferred:
                return references.tokens[:, t]
            token = score(t, logits)
            if t == 1:  # the first stepped logits: the model's own, checked against deferring
                deferred = head.check(logits)
            return token

        step_tokens(model, cache, first_logits, batch, steps, feed, on_step)
    for t, logits in head.logits() if deferred else ():
        score(t, logits)
    return Forced(nll=nll, top1=top1)


def teacher_forced_nll(
    model: Any,
    cache: Any,
    first_logits: torch.Tensor,
    batch: Batch,
    references: References,
    on_step: StepHook | None = None,
) -> torch.Tensor:
    """NLL [B, L] of the reference tokens fed one at a time through `cache` (0 where not scored)."""
    return teacher_forced(model, cache, first_logits, batch, references, on_step).nll
