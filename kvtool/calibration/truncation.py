"""Tuning the truncation distance D by the perplexity it gives on the calibration prompts.

References are the full-cache greedy continuations (or the dataset's answers, where a sample has
one), generated token by token on the same full cache whose prompt forward measured the
importance, so the full-cache NLL comes for free from those steps (`kvtool.scoring`).

The compressed prompt is built once per batch, from the keys, values and importance the full pass
recorded (no second prompt forward); each candidate D runs on a deep copy of that cache, so every
candidate sees the very same compressed prefix and only the generation-time eviction differs.
PPL = exp(mean NLL), pooled over all scored tokens of all samples.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.layer.recorded_window import RecordedWindowLayer

from kvtool.scoring import Batch, NllTotal, References, StepHook, teacher_forced_nll


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
    recorded scores (every kind: column sums, per head, observation window) hold what `target`'s
    layers would compute, whatever their scorer and head mode, so each compressing layer is handed both
    and compresses as in that forward. This saves calibration a second forward over every
    prompt; a test checks the result against a real compressed prompt forward. A sliding layer
    that keeps the model's own window is copied as transformers' layer; one with a window of its
    own is cut from the whole prompt the record kept (`RecordedWindowLayer`). The prompt's
    image-token mask (set on `full` by the forward of a vision-language model) goes along, so rules
    such as `text-prior` and the kept-image counts see the image positions as in a real forward.
    """
    if getattr(full, "image_mask", None) is not None:
        target.set_image_mask(full.image_mask)
    mask = prompt_mask(attention_mask)
    compressing = target.compressing_layers()
    for index, source in enumerate(full.layers):
        layer = compressing.get(index)
        if isinstance(source, RecordedWindowLayer) and layer is not None and (
            layer.plan.cap != layer.plan.native_window or layer.plan.sink_tokens
        ):
            # A window of its own: cut from the whole prompt, as the prompt forward would have.
            keys, values = source.prompt
            layer.update(keys.clone(), values.clone())
            # A scored window ranks by the recorded last rows, as its prompt forward ranks by its own.
            scores = layer.last_rows_scores(source.rows, keys, mask, source.scaling) if layer.scores_last_rows_only else None
            layer.compress_prompt(mask, scores)
            continue
        if isinstance(source, RecordedWindowLayer):
            target.layers[index] = source.native()  # the model's own window: transformers' layer as it is
            continue
        if layer is not None and not hasattr(source, "prompt_scores"):
            raise KvtoolError("internal: a sliding layer replays only from a record (bare_cache(record_importance=True))")
        if layer is None:
            target.layers[index] = copy.deepcopy(source)
            continue
        # Copies: a budget-1.0 target layer keeps the tensors it is given and writes into them.
        layer.update(source.keys.clone(), source.values.clone())
        layer.compress_prompt(mask, source.scores_for(layer.score_request.window))
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
