"""What a prompt token is worth to a layer: the attention it receives, and the scorers that rank by it.

The passes (computed next to the attention output the layer needs anyway):
    scores         what a pass is asked to score (ScoreRequest) and what it returns (PromptScores)
    prompt         the prompt pass's entry points, choosing one of the two paths below
    cpu_path       CPU path: a left-padded batch one sequence at a time, in blocks of query rows
    causal_blocks  the CPU path's kernel: one unpadded sequence's causal attention in row blocks
    block_size     the CPU path's block size, measured once per prompt shape (or fixed)
    chunked        portable path: any device, dtype or mask, in chunks of query rows
    decode         one new token's attention with the probabilities it gave each slot
    logits         what a layer does to its logits besides scaling them: soft-capping, sink
                   logits (a LogitScale, which every pass and kernel reads from its `scaling`)
The scorers (what selection ranks by, from a PromptScores), by name: base (the interface),
attention_sum, window, union, expected (Expected Attention, from calibrated query statistics),
expected_output (the same weighted by what each entry writes through the output projection),
triattention (TriAttention's distance-aware score, from the same statistics; `queried` adds the
statistics' scores to a prompt's). A new scorer is one new module registered in SCORERS below.
"""

from __future__ import annotations

from kvtool.errors import KvtoolError
from kvtool.runtime.importance.attention_sum import AttentionSum
from kvtool.runtime.importance.base import Scorer
from kvtool.runtime.importance.expected import ExpectedAttention, LayerQueries, expected_scores
from kvtool.runtime.importance.expected_output import ExpectedOutput
from kvtool.runtime.importance.triattention import TriAttention
from kvtool.runtime.importance.block_size import BlockTuning, block_tuning, tune_blocks
from kvtool.runtime.importance.decode import decode_attention_with_scores
from kvtool.runtime.importance.prompt import (
    attention_importance,
    attention_with_importance,
    attention_with_scores,
    prompt_scores,
)
from kvtool.runtime.importance.scores import NO_EXTRAS, PromptScores, ScoreRequest, accumulation_dtype, with_rows
from kvtool.runtime.importance.union import UnionScorer
from kvtool.runtime.importance.window import WindowScorer, pool_before_window

SCORERS: dict[str, type[Scorer]] = {
    rule.name: rule for rule in (AttentionSum, WindowScorer, UnionScorer, ExpectedAttention, ExpectedOutput, TriAttention)
}


def make_scorer(name: str, *, window: int, pool: int, window_share: float = 0.5) -> Scorer:
    """The scorer `name`; `window` and `pool` configure the scorers that read the observation
    window (`window`, `union`) and are ignored by the others, `window_share` the union's lists."""
    try:
        rule = SCORERS[name]
    except KeyError:
        raise KvtoolError(f"unknown scorer {name!r} (known: {', '.join(SCORERS)})") from None
    if issubclass(rule, UnionScorer):
        return rule(window=window, pool=pool, window_share=window_share)
    return rule(window=window, pool=pool) if issubclass(rule, WindowScorer) else rule()


__all__ = [
    "with_rows",
    "NO_EXTRAS",
    "SCORERS",
    "AttentionSum",
    "ExpectedAttention",
    "LayerQueries",
    "expected_scores",
    "BlockTuning",
    "PromptScores",
    "ScoreRequest",
    "Scorer",
    "UnionScorer",
    "WindowScorer",
    "accumulation_dtype",
    "attention_importance",
    "attention_with_importance",
    "attention_with_scores",
    "block_tuning",
    "decode_attention_with_scores",
    "make_scorer",
    "pool_before_window",
    "prompt_scores",
    "tune_blocks",
]
