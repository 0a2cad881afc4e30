"""What `kvtool eval` measures, and the `--json` document other tools read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtool.evaluation.metrics import standard_error


# Where in the answer a token sits (1-based, inclusive; None: to the end). The draft's verified
# prefix covers the first few dozen tokens, so a PPL pooled over a long answer hides where its help
# ends: the first bucket is what the draft reaches, the last what only the compressed cache carries.
POSITION_BUCKETS: tuple[tuple[int, int | None], ...] = ((1, 32), (33, 128), (129, None))


def bucket_label(bucket: tuple[int, int | None]) -> str:
    first, last = bucket
    return f"{first}-{last}" if last is not None else f"{first}+"


@dataclass(frozen=True)
class PromptResults:
    """Per prompt, in data order, so two methods (or two tools) can be compared prompt by prompt."""

    nll: tuple[float, ...] = ()  # summed NLL of the prompt's reference tokens
    tokens: tuple[int, ...] = ()  # reference tokens scored
    rouge_l: tuple[float, ...] = ()
    accuracy: tuple[float | None, ...] = ()  # None where the prompt has no expected answers
    # Reference tokens that were the compressed cache's own top choice (teacher-forced): where a
    # greedy output would have stayed on the full cache's. Empty for the full cache.
    top1: tuple[int, ...] = ()
    # The same NLL sums and token counts split by POSITION_BUCKETS: one tuple per prompt.
    nll_by_position: tuple[tuple[float, ...], ...] = ()
    tokens_by_position: tuple[tuple[int, ...], ...] = ()

    def subset(self, rows: list[int]) -> "PromptResults":
        return PromptResults(*(tuple(values[i] for i in rows) if values else () for values in
                              (self.nll, self.tokens, self.rouge_l, self.accuracy, self.top1,
                               self.nll_by_position, self.tokens_by_position)))

    @property
    def ppl_by_position(self) -> tuple[float, ...]:
        """PPL pooled over prompts in each of POSITION_BUCKETS (NaN where no answer reaches it)."""
        out = []
        for b in range(len(POSITION_BUCKETS)):
            count = sum(t[b] for t in self.tokens_by_position)
            out.append(math.exp(sum(n[b] for n in self.nll_by_position) / count) if count else math.nan)
        return tuple(out)

    @property
    def ppl(self) -> float:
        count = sum(self.tokens)
        return math.exp(sum(self.nll) / count) if count else math.nan

    @property
    def agreement(self) -> float | None:
        """Top-1 agreement pooled over every scored reference token (None when not measured)."""
        count = sum(self.tokens)
        return sum(self.top1) / count if self.top1 and count else None

    @property
    def mean_accuracy(self) -> float | None:
        scored = [a for a in self.accuracy if a is not None]
        return sum(scored) / len(scored) if scored else None


@dataclass(frozen=True)
class MethodResult:
    """One method at one budget, pooled over every evaluation prompt."""

    method: str
    budget: float
    ppl: float  # exp(mean NLL) of the references, teacher-forced through the compressed cache
    rouge_l: float  # mean ROUGE-L F1 of the compressed greedy output vs the full cache's
    kv_fraction: float  # physical KV bytes / a full cache's bytes, at the end of greedy generation
    tokens: int  # reference tokens scored
    # Per prompt, in data order, so two methods can be compared prompt by prompt (paired).
    rouge_l_per_prompt: tuple[float, ...] = ()
    per_prompt: PromptResults = field(default_factory=PromptResults)
    # The most physical KV bytes held after any step of greedy generation (the prompt's included),
    # over the full cache's bytes at the end: what memory must be there, not only what is left.
    kv_peak_fraction: float = math.nan
    # The profile's draft as it ran (MethodSettings.draft, never longer than the answer): tokens
    # drafted at the budget to score the prompt again (0: none), how many rounds, whether verified,
    # whether later rounds drafted from the last one's predictions (`Draft.jacobi`).
    draft: int = 0
    draft_rounds: int = 1
    draft_verify: bool = False
    draft_jacobi: bool = False
    # Per prompt, how many of the greedy output's first tokens came from the verified prefix (the
    # full cache's own greedy tokens, read off the draft's forward); empty without verification.
    verified_per_prompt: tuple[int, ...] = ()
    # Hybrid models: kv_fraction of each layer type ("sliding_attention", "full_attention"); empty for one type.
    kv_fraction_by_type: dict[str, float] = field(default_factory=dict)

    @property
    def rouge_l_sem(self) -> float:
        """Standard error of the mean ROUGE-L over prompts: how far the prompt count lets us trust a gap."""
        return standard_error(self.rouge_l_per_prompt)

    @property
    def accuracy(self) -> float | None:
        """Mean answer accuracy over the prompts that have expected answers; None when none has."""
        return self.per_prompt.mean_accuracy

    @property
    def agreement(self) -> float | None:
        """Share of reference tokens the compressed cache itself ranks first (teacher-forced)."""
        return self.per_prompt.agreement


@dataclass(frozen=True)
class FullOutput:
    """The full cache's greedy output of one prompt: the ROUGE-L target (and PPL reference)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class EvalReport:
    model: str
    data: str
    samples: int
    max_new_tokens: int
    references: str  # "answers", "full-cache greedy", or "mixed"
    full_ppl: float
    reference_tokens: int
    profile_source: str  # where the per-layer ratios came from (built-in, file, calibrated now)
    results: tuple[MethodResult, ...]
    seconds: float
    outputs: dict[str, Any] = field(default_factory=dict)
    kinds: tuple[str | None, ...] = ()  # per prompt, in data order (None: the row names no kind)
    full_outputs: tuple[FullOutput, ...] = ()  # per prompt, in data order
    full: PromptResults = field(default_factory=PromptResults)  # the full cache's own NLL and accuracy
    score_from: int = 0  # reference / output tokens left out of PPL, top-1 and ROUGE-L
    kv_format: str = "native"  # how the methods stored their kept entries (EvalConfig.kv_format)
    # Bytes of one value in the model's own cache: kv_fraction is of that cache; x native_bytes / 2
    # it is the share of a 16-bit cache (what GPUs serve).
    native_bytes: int = 2

    def share_of_16bit(self, fraction: float) -> float:
        return fraction * self.native_bytes / 2

    @property
    def kind_rows(self) -> dict[str, list[int]]:
        """Prompt indices per kind, in first-seen order (empty when no row names a kind)."""
        rows: dict[str, list[int]] = {}
        for index, kind in enumerate(self.kinds):
            if kind is not None:
                rows.setdefault(kind, []).append(index)
        return rows

    @property
    def full_accuracy(self) -> float | None:
        return self.full.mean_accuracy

    def to_dict(self) -> dict[str, Any]:
        """The `--json` contract: `full_ppl` and `results` keep these names; the rest is context."""
        return {
            "full_ppl": self.full_ppl,
            "results": [
                {
                    "method": r.method, "budget": r.budget, "ppl": r.ppl, "rouge_l": r.rouge_l,
                    "kv_fraction": r.kv_fraction, "kv_fraction_16bit": _finite(self.share_of_16bit(r.kv_fraction)),
                    "kv_peak_fraction": _finite(r.kv_peak_fraction),
                    **({"kv_fraction_by_type": r.kv_fraction_by_type} if r.kv_fraction_by_type else {}),
                    "draft": r.draft, "draft_rounds": r.draft_rounds,
                    "draft_verify": r.draft_verify, "draft_jacobi": r.draft_jacobi, "verified_per_prompt": list(r.verified_per_prompt),
                    "rouge_l_sem": _finite(r.rouge_l_sem),
                    "rouge_l_per_prompt": list(r.rouge_l_per_prompt),
                    "accuracy": r.accuracy,
                    "accuracy_per_prompt": list(r.per_prompt.accuracy),
                    "nll_per_prompt": list(r.per_prompt.nll),
                    "tokens_per_prompt": list(r.per_prompt.tokens),
                    "ppl_by_position": _by_position(r.per_prompt),
                    "nll_by_position_per_prompt": [list(n) for n in r.per_prompt.nll_by_position],
                    "tokens_by_position_per_prompt": [list(t) for t in r.per_prompt.tokens_by_position],
                    "agreement": r.agreement,
                    "top1_per_prompt": list(r.per_prompt.top1),
                    "kinds": {kind: _kind_summary(r.per_prompt.subset(rows)) for kind, rows in self.kind_rows.items()},
                }
                for r in self.results
            ],
            "full_accuracy": self.full_accuracy,
            "full_ppl_by_position": _by_position(self.full),
            "full_kinds": {
                kind: {"ppl": self.full.subset(rows).ppl, "accuracy": self.full.subset(rows).mean_accuracy, "samples": len(rows)}
                for kind, rows in self.kind_rows.items()
            },
            "kinds_per_prompt": list(self.kinds),
            "full_outputs": [{"text": o.text, "token_ids": list(o.token_ids)} for o in self.full_outputs],
            "model": self.model,
            "data": self.data,
            "samples": self.samples,
            "max_new_tokens": self.max_new_tokens,
            "score_from": self.score_from,
            "references": self.references,
            "reference_tokens": self.reference_tokens,
            "profile_source": self.profile_source,
            "kv_format": self.kv_format,
            "native_bytes": self.native_bytes,
            "seconds": self.seconds,
        }


def _finite(x: float) -> float | None:
    # JSON has no NaN; one prompt has no standard error.
    return None if math.isnan(x) else x


def _by_position(scores: PromptResults) -> dict[str, float | None]:
    return {bucket_label(b): _finite(ppl) for b, ppl in zip(POSITION_BUCKETS, scores.ppl_by_position)}


def _kind_summary(scores: PromptResults) -> dict[str, Any]:
    return {
        "ppl": scores.ppl,
        "rouge_l": sum(scores.rouge_l) / len(scores.rouge_l),
        "rouge_l_sem": _finite(standard_error(scores.rouge_l)),
        "accuracy": scores.mean_accuracy,
        "agreement": scores.agreement,
        "samples": len(scores.rouge_l),
    }
