"""Serving engines' semantics emulated in kvtool: a cache an engine can serve (`Servable`), its bytes,
and the teacher-forced PPL of references through it.

A windowed layer is sliding-window attention from the first prompt token on (each token sees itself
and the window - 1 before it, in the prompt as while generating), as vLLM's sliding layers and
TensorRT-LLM's max_attention_window run it: exactly a banded causal mask over prompt and answer.
Every key and value is attended as stored (quantized on write, one format per layer). So one forward
of prompt + reference without a cache gives the NLL of every reference token, in the recipe search's
measure (`passes.recipe_ppls`: each prompt's mean NLL, exp of their mean). No window at native
precision is the full cache (tested against the full pass's own NLL), and a window is what
transformers' own sliding layers compute (tested on Qwen2's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from kvtool.calibration.passes import PromptState
from kvtool.errors import KvtoolError
from kvtool.runtime.precision import KVStorage
from kvtool.runtime.storage import storage_format

_NAME = "kvtool-engine-emulation"
# vLLM's and TensorRT-LLM's `fp8` KV cache: e4m3 with one scale per tensor (1.0 unless calibrated
# offline), not kvtool's per-(token, head) fp8. Emulated as a plain cast, clamped to e4m3's range.
FP8_TENSOR = "fp8-tensor"
_E4M3_MAX = 448.0

@dataclass(frozen=True)
class Servable:
    """One engine-servable cache: per layer a window in tokens or None (the full cache), the format
    of every layer not in `skip` (which stay native)."""

    windows: tuple[int | None, ...]
    fmt: str = "native"
    skip: tuple[int, ...] = ()

    def formats(self) -> dict[int, str]:
        return {i: self.fmt for i in range(len(self.windows)) if i not in self.skip and self.fmt != "native"}

    def window_strings(self) -> tuple[str, ...]:
        return tuple("full" if w is None else str(w) for w in self.windows)


def fake_quantized(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` [..., D] as the engine attends to it once stored in `fmt`."""
    if fmt == FP8_TENSOR:
        return x.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    storage = storage_format(fmt)
    return storage.decode(storage.encode(x), x.dtype)


def entry_share(fmt: str, head_dim: int, native: int) -> float:
    """A stored entry's bytes (key and value, scales included) over a native one's."""
    if fmt == FP8_TENSOR:
        return 1.0 / native
    return KVStorage(fmt, fmt).entry_share(head_dim, native)


def own_entries(fingerprint: Any, tokens: int) -> list[int]:
    """Entries each layer of the model's own cache holds at `tokens` (a sliding layer its window)."""
    window = fingerprint.sliding_window
    return [min(tokens, window) if kind == "sliding_attention" and window else tokens for kind in fingerprint.layer_types]


def kept_share(servable: Servable, fingerprint: Any, native: int, tokens: int) -> float:
    """`servable`'s bytes over the model's own cache's at a `tokens`-token prompt."""
    own = own_entries(fingerprint, tokens)
    spent = 0.0
    for i, (window, full) in enumerate(zip(servable.windows, own)):
        fmt = "native" if i in servable.skip else servable.fmt
        spent += entry_share(fmt, fingerprint.head_dim, native) * min(full if window is None else window, tokens)
    return spent / sum(own)


class _EngineAttention:
    """Attention as the engine runs it on one row without a cache: causal, each windowed layer (and
    each of the model's own sliding layers) banded to its window, keys and values quantized."""

    def __init__(self, windows: dict[int, int], formats: dict[int, str]) -> None:
        self.windows, self.formats = windows, formats

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer, rows, columns = module.layer_idx, query.shape[2], key.shape[2]
        fmt = self.formats.get(layer)
        if fmt is not None:
            key, value = fake_quantized(key, fmt), fake_quantized(value, fmt)
        position = torch.arange(columns - rows, columns, device=query.device)[:, None]
        column = torch.arange(columns, device=query.device)[None, :]
        allowed = column <= position
        if layer in self.windows:
            allowed &= position - column < self.windows[layer]
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2).contiguous(), None


def reference_rows(states: Sequence[PromptState]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt ids, scored reference ids) of every row of `states` with a scored token."""
    rows = []
    for state in states:
        if getattr(state.batch, "extras", None):
            raise KvtoolError("kvtool calibrate --engine runs on text prompts only (a prompt here has images)")
        refs = state.references
        for r in range(state.batch.input_ids.shape[0]):
            ref = refs.tokens[r][refs.scored[r]]
            if len(ref):
                rows.append((state.batch.input_ids[r][state.batch.attention_mask[r].bool()], ref))
    return rows


@torch.no_grad()
def emulated_ppl(model: Any, servable: Servable, rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """PPL of the references teacher-forced through `servable` as the engine runs it: exp of the
    mean over prompts of each prompt's mean NLL (the recipe search's measure)."""
    config = model.config.get_text_config(decoder=True)
    windows = {i: w for i, w in enumerate(servable.windows) if w is not None}
    own = getattr(config, "sliding_window", None)
    for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if kind == "sliding_attention" and own and i not in windows:
            windows[i] = own
    AttentionInterface.register(_NAME, _EngineAttention(windows, servable.formats()))
    previous = config._attn_implementation
    model.set_attn_implementation(_NAME)
    means = []
    try:
        for ids, ref in rows:
            inputs = torch.cat([ids, ref[:-1]])[None]
            logits = model(input_ids=inputs, use_cache=False, logits_to_keep=len(ref)).logits[0]
            logits = logits if logits.dtype == torch.float64 else logits.float()
            nll = -torch.log_softmax(logits, dim=-1).gather(1, ref[:, None].to(logits.device))[:, 0]
            means.append(float(nll.double().mean()))
    finally:
        model.set_attn_implementation(previous)
    return math.exp(sum(means) / len(means)) if means else float("nan")
