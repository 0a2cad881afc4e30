"""The scoring engine calibration and evaluation share: prompts encoded and batched, the prompt
forward (recording importance through a kvtool cache), reference continuations and teacher-forced
NLL through a full or compressed cache, all on one token-stepping loop (the runtime's, which the
draft, `kvtool.runtime.draft`, runs on too)."""

from kvtool.scoring.batches import Batch, encode_batches, left_pad, make_batches, model_positions
from kvtool.scoring.encoding import Encoded, encode_answers, encode_prompt, encode_samples
from kvtool.scoring.engine import (
    Forced,
    NllTotal,
    PromptMeanNll,
    References,
    StepHook,
    prompt_forward,
    reference_continuations,
    step_tokens,
    teacher_forced,
    teacher_forced_nll,
)

__all__ = [
    "Batch",
    "Encoded",
    "Forced",
    "NllTotal",
    "PromptMeanNll",
    "References",
    "StepHook",
    "encode_answers",
    "encode_batches",
    "encode_prompt",
    "encode_samples",
    "left_pad",
    "make_batches",
    "model_positions",
    "prompt_forward",
    "reference_continuations",
    "step_tokens",
    "teacher_forced",
    "teacher_forced_nll",
]
