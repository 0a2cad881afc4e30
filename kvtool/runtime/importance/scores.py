"""What a prompt pass is asked to score and what it returns, shared by the passes and the scorers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision softmax column sums over thousands of rows lose too much; float64 stays float64.
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ScoreRequest:
    """What a prompt pass scores beside the layer-averaged column sums (which it always gives).

    heads: also the column sums per KV head. window: also, per KV head, the attention the last
    `window` real prompt rows give each column (0: not needed). expected: the layer adds the
    expected-attention scores (`importance.expected`) from its keys, values and query statistics
    (no pass computes them), and the expected-output or triattention ones for that scorer or a
    recording (`importance.queried`).
    """

    heads: bool = False
    window: int = 0
    expected: bool = False


@dataclass(frozen=True)
class PromptScores:
    """Attention received per prompt column, from one pass over the prompt's probabilities.

    importance: [B, n], column sums over every query row, averaged over all query heads (what
        calibration and the `attention-sum` scorer read).
    heads: [B, Hkv, n] or None, the same column sums averaged over each KV head's query heads
        (their mean over KV heads is `importance`).
    window: [B, Hkv, n] or None, per KV head the sum over the last `window` real query rows of
        A[row, column], averaged over the KV head's query heads (unpooled).
    expected: [B, Hkv, n] or None, the expected-attention scores (added by the layer, not the pass;
        only for that scorer or a recording).
    expected_output: [B, Hkv, n] or None, the expected-output scores (likewise; only for that
        scorer or a recording).
    triattention: [B, Hkv, n] or None, TriAttention's scores (likewise).
    Padded columns are 0 everywhere; padded query rows contribute nothing.
    """

    importance: torch.Tensor
    heads: torch.Tensor | None = None
    window: torch.Tensor | None = None
    expected: torch.Tensor | None = None
    expected_output: torch.Tensor | None = None
    triattention: torch.Tensor | None = None


NO_EXTRAS = ScoreRequest()


def with_rows(prompt: PromptScores | None, rows: PromptScores) -> PromptScores | None:
    """`prompt`'s scores with more query rows' added: `rows` are the column sums of rows that come
    after every prompt row (a draft's), over at least the prompt's columns, and every one of them is
    in the observation window (the window is the prompt's last rows plus all of them). Sums add, so
    this is what one pass over the prompt and the rows together gives."""
    if prompt is None:
        return None
    n = prompt.importance.shape[-1]
    more = lambda mine, theirs: None if mine is None else mine + theirs[..., :n].to(mine.dtype)  # noqa: E731
    return PromptScores(
        more(prompt.importance, rows.importance), more(prompt.heads, rows.heads), more(prompt.window, rows.heads),
        prompt.expected, prompt.expected_output, prompt.triattention,
    )
