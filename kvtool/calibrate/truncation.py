"""Tuning the truncation distance D by the perplexity it gives on the calibration prompts.

References are the full-cache greedy continuations (or the dataset's answers, where a sample has
one), generated token by token on the same full cache whose prompt forward measured the
importance, so the full-cache NLL comes for free from those steps. A reference ends at its first
EOS (scored, as the model must predict it); later steps are padding and not scored.

The compressed prompt is built once per batch, from the keys, values and importance the full pass
recorded (no second prompt forward); each candidate D runs on a deep copy of that cache, so every
candidate sees the very same compressed prefix and only the generation-time eviction differs.
PPL = exp(mean NLL), pooled over all scored tokens of all samples.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtool.calibrate.batches import Batch

DEFAULT_CANDIDATES = (0, 8, 16, 25, 48, 96)
# As long as kvtool eval's default generation: the fixed-point queue holds about D entries, so the
# last D prompt entries are gone after ~D / (1 - budget) steps; 32-token references ended before
# that and favoured a D that lost on 64-token generations (smollm2 at 0.2: D 25 -> 48, held-out
# PPL 2.987 -> 2.809). Still a CPU calibration in minutes.
REFERENCE_TOKENS = 64

StepHook = Callable[[], None]


@dataclass(frozen=True)
class References:
    """Per batch: reference tokens, which of them are scored, and their full-cache NLL."""

    tokens: torch.Tensor  # [B, L] long; padding where not scored
    scored: torch.Tensor  # [B, L] bool
    nll_full: torch.Tensor  # [B, L] float64; 0 where not scored

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


@dataclass(frozen=True)
class TruncationResult:
    """Calibration PPL of every candidate D, the chosen one, and the full-cache PPL."""

    ppl: dict[int, float]
    best: int
    ppl_full: float
    tokens: int  # reference tokens scored, all samples together

    @property
    def ppl_compressed(self) -> float:
        return self.ppl[self.best]


@dataclass
class TruncationScores:
    """Running totals while batches are processed."""

    candidates: tuple[int, ...]
    full: NllTotal = field(default_factory=NllTotal)
    compressed: dict[int, NllTotal] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.compressed = {d: NllTotal() for d in self.candidates}

    def result(self, default: int) -> TruncationResult:
        ppl = {d: total.ppl() for d, total in self.compressed.items()}
        return TruncationResult(ppl=ppl, best=choose(ppl, default), ppl_full=self.full.ppl(), tokens=self.full.count)


def choose(ppl: dict[int, float], default: int) -> int:
    """Lowest PPL; exact ties (e.g. nothing is ever evicted) go to the default D, then the smaller."""
    return min(ppl, key=lambda d: (ppl[d], d != default, d))


def _forward(model: Any, token: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
    out = model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True)
    return out.logits[:, -1]


def _nll(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return -logp.gather(1, token[:, None])[:, 0]


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
) -> References:
    """Greedy continuation (or the given answer) of every row, with its full-cache NLL.

    `cache` holds the full prompt and `first_logits` [B, V] the prompt forward's last logits.
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
    mask, position = batch.attention_mask.to(device), batch.next_positions.to(device)
    logits = first_logits
    for t in range(length):
        active = ~finished & (~has_answer | (t < answer_len))
        choice = torch.where(has_answer, forced[:, t].clamp(min=0), logits.argmax(dim=-1))
        token = torch.where(active, choice, torch.full_like(choice, pad_id))
        tokens[:, t], scored[:, t] = token, active
        nll[:, t] = torch.where(active, _nll(logits, token), 0.0)
        ended_by_eos = ~has_answer & torch.isin(token, eos)
        finished |= ~active | ended_by_eos
        if t == length - 1 or bool(finished.all()):
            break
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        logits = _forward(model, token[:, None], mask, position, cache)
        position = position + 1
        if on_step:
            on_step()
    return References(tokens=tokens, scored=scored, nll_full=nll)


def teacher_forced_nll(
    model: Any,
    cache: Any,
    first_logits: torch.Tensor,
    batch: Batch,
    references: References,
    on_step: StepHook | None = None,
) -> torch.Tensor:
    """NLL [B, L] of the reference tokens fed one at a time through `cache` (0 where not scored)."""
    rows, length = references.tokens.shape
    nll = torch.zeros(rows, length, dtype=torch.float64, device=first_logits.device)
    steps = references.steps
    mask, position = batch.attention_mask.to(first_logits.device), batch.next_positions.to(first_logits.device)
    logits = first_logits
    for t in range(steps):
        token = references.tokens[:, t]
        nll[:, t] = torch.where(references.scored[:, t], _nll(logits, token), 0.0)
        if t == steps - 1:
            break
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        logits = _forward(model, token[:, None], mask, position, cache)
        position = position + 1
        if on_step:
            on_step()
    return nll


def prompt_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The boolean [B, 1, n, n] causal padding mask a prompt forward hands its attention layers."""
    valid = attention_mask.bool()
    n = valid.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    return causal[None, None] & valid[:, None, None, :] & valid[:, None, :, None]


def compress_recorded_prompt(target: Any, full: Any, attention_mask: torch.Tensor) -> Any:
    """Fill `target` (a fresh cache with the calibrated plans) with the prompt that `full` holds.

    `full` is a budget-1.0 kvtool cache straight after its prompt forward, importance recorded:
    its keys and values are exactly what the same prompt forward would store in `target`, and the
    importance is what `target`'s layers would compute, so each compressing layer is handed both
    and compresses as in that forward. This saves calibration a second forward over every
    prompt; a test checks the result against a real compressed prompt forward. Layers kvtool
    leaves alone (sliding windows) are copied as they are. The prompt's image-token mask (set on
    `full` by the forward of a vision-language model) goes along, so rules such as `text-prior`
    and the kept-image counts see the image positions as in a real forward.
    """
    if getattr(full, "image_mask", None) is not None:
        target.set_image_mask(full.image_mask)
    mask = prompt_mask(attention_mask)
    compressing = target.compressing_layers()
    for index, source in enumerate(full.layers):
        layer = compressing.get(index)
        if layer is None:
            target.layers[index] = copy.deepcopy(source)
            continue
        # Copies: a budget-1.0 target layer keeps the tensors it is given and writes into them.
        layer.update(source.keys.clone(), source.values.clone())
        layer.compress_prompt(mask, source.prompt_importance)
    return target


def score_candidates(
    model: Any,
    compressed_cache: Any,
    first_logits: torch.Tensor,
    batch: Batch,
    references: References,
    scores: TruncationScores,
    on_step: StepHook | None = None,
) -> None:
    """Teacher-force one batch's references through a copy of its compressed cache per candidate D."""
    for distance in scores.candidates:
        cache = copy.deepcopy(compressed_cache)
        cache.set_truncation_distance(distance)
        nll = teacher_forced_nll(model, cache, first_logits, batch, references, on_step)
        scores.compressed[distance].add(nll, references.scored)
