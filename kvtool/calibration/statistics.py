"""Per-sample, per-layer importance statistics: cumulative-priority curves and Gini coefficients.

Only the compressible tokens enter a curve. The sinks and the recent window are kept whatever
their score, so they are not part of what the per-layer ratio decides; leaving them in would also
let the huge attention mass of the first token dominate every layer's curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.profiles.lorenz import gini_from_importance, priority_curve
from kvtool.runtime.selection import kept_count, select_rule

# Samples per stored curve; the ratios are solved on exactly these curves, so a profile re-derived
# from its own curves at its own budget gives its own ratios back.
CURVE_POINTS = 201


@dataclass(frozen=True)
class LayerImportance:
    """One compressing layer's prompt importance for a batch (host copies)."""

    importance: np.ndarray  # [B, n] attention received per prompt column
    valid: np.ndarray  # [B, n] bool, real (unpadded) columns


@dataclass(frozen=True)
class ImportanceStats:
    """Statistics of S samples over the Lc compressing layers (rows in sample order)."""

    layers: tuple[int, ...]  # model layer index of each compressing layer
    curves: np.ndarray  # [S, Lc, points] priority curves of the compressible tokens
    gini: np.ndarray  # [S, Lc] exact Gini of the same tokens
    prompt_tokens: np.ndarray  # [S] real prompt tokens

    def layer_gini(self) -> np.ndarray:
        """[Lc] mean Gini over samples (equals the Gini of the mean curve, up to the grid)."""
        return self.gini.mean(axis=0)


def compressible(
    importance: np.ndarray, valid: np.ndarray, sink_tokens: int, recent_window: int, per_row_mean: bool = True
) -> np.ndarray:
    """The importance of one row's real tokens, minus the protected sinks and recent window.

    With `per_row_mean` each column sum is divided by the rows that can see the token (n - i):
    a causal column sum grows with the number of later rows, so without it every layer looks
    concentrated on its early tokens and the Gini measures position more than attention.
    """
    real = importance[valid]
    if per_row_mean:
        real = real / (len(real) - np.arange(len(real)))
    end = len(real) - recent_window
    if end <= sink_tokens:
        raise ValueError(
            f"a prompt of {len(real)} tokens has nothing to compress beside its "
            f"{sink_tokens} sink and {recent_window} recent tokens"
        )
    return real[sink_tokens:end]


def batch_stats(
    layers: dict[int, LayerImportance],
    *,
    sink_tokens: int,
    recent_window: int,
    points: int = CURVE_POINTS,
    per_row_mean: bool = True,
) -> ImportanceStats:
    """Curves and Gini for every row of one batch and every compressing layer."""
    order = tuple(sorted(layers))
    if not order:
        raise ValueError("the model has no compressing (full-attention) layer to calibrate")
    first = layers[order[0]]
    rows = first.importance.shape[0]
    curves = np.empty((rows, len(order), points))
    gini = np.empty((rows, len(order)))
    for j, index in enumerate(order):
        layer = layers[index]
        for b in range(rows):
            scores = compressible(layer.importance[b], layer.valid[b], sink_tokens, recent_window, per_row_mean)
            curves[b, j] = priority_curve(scores, points)
            gini[b, j] = gini_from_importance(scores)
    tokens = first.valid.sum(axis=1).astype(np.int64)
    return ImportanceStats(layers=order, curves=curves, gini=gini, prompt_tokens=tokens)


def combine(parts: Sequence[tuple[Sequence[int], ImportanceStats]], samples: int) -> ImportanceStats:
    """Put per-batch statistics back into sample order; `parts` pairs each batch's rows with its stats."""
    layers = parts[0][1].layers
    points = parts[0][1].curves.shape[-1]
    curves = np.empty((samples, len(layers), points))
    gini = np.empty((samples, len(layers)))
    tokens = np.empty(samples, dtype=np.int64)
    for rows, stats in parts:
        index = list(rows)
        curves[index], gini[index], tokens[index] = stats.curves, stats.gini, stats.prompt_tokens
    return ImportanceStats(layers=layers, curves=curves, gini=gini, prompt_tokens=tokens)


@dataclass(frozen=True)
class PromptImages:
    """One batch's recorded prompt state where it has image tokens: what the kept image share needs."""

    importance: dict[int, Any]  # layer -> [B, n] torch importance, exactly what the runtime ranks by
    valid: Any  # [B, n] torch bool, real prompt columns
    image: Any  # [B, n] torch bool, image-token columns (never padding)

    @classmethod
    def of(cls, cache: Any) -> PromptImages:
        """From a budget-1.0 kvtool cache right after its prompt forward, importance recorded."""
        layers = cache.compressing_layers()
        first = next(iter(layers.values()))
        valid = first.prompt_valid.detach().cpu()
        return cls(
            importance={index: layer.prompt_importance.detach().cpu() for index, layer in layers.items()},
            valid=valid,
            image=cache.image_mask.detach().cpu() & valid,
        )


def kept_image_share(batches: Sequence[PromptImages], ratios: dict[int, float], method: Any) -> dict[int, float] | None:
    """Per compressing layer, the mean share of kept prompt entries that are image tokens at `ratios`.

    The entries are the ones the runtime keeps: `method`'s selection rule (a MethodSettings) on the
    recorded importance with the image mask (the text prior sees it), `ceil(ratio * n)` per prompt;
    merging changes what a kept entry holds, not which entries stay. Averaged over the prompts that
    have image tokens; None when none has (text-only calibration).
    """
    rule = select_rule(method.selection)
    shares: dict[int, list[float]] = {index: [] for index in ratios}
    for batch in batches:
        valid, image = batch.valid, batch.image
        rows = image.any(dim=1).numpy()
        tokens = valid.sum(dim=1).numpy()
        for index, ratio in ratios.items():
            keep = kept_count(float(ratio), tokens)
            if ratio >= 1.0:
                kept_image = image.sum(dim=1).numpy()
            else:
                selection = rule.select(
                    batch.importance[index], valid, keep,
                    sink_tokens=method.sink_tokens, recent_window=method.recent_window, image_mask=image,
                )
                kept_image = (image.gather(1, selection.index) & selection.valid).sum(dim=1).numpy()
            share = kept_image / np.maximum(keep, 1)
            shares[index].extend(float(v) for v in share[rows])
    if not any(shares.values()):
        return None
    return {index: float(np.mean(values)) for index, values in shares.items()}
