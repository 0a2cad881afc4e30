"""The output layer of a teacher-forced pass, run once over all its steps instead of once per step.

A teacher-forced pass feeds given tokens, so a step's logits are needed only to score it, never
to choose what comes next. On a CPU the output layer of a model with a large vocabulary is most of
a decode step (Gemma 3 270M: 640 x 262,144, about 60% of the step's multiply-adds), and a matrix
product over one or a few rows per recipe runs at a fraction of the speed of one over hundreds:
on the 2-core CPU, 4.1 ms per row at 30 rows against about 2 ms at 256. So `DeferredHead` stands in
for the model's output layer while the pass steps (recording each step's last hidden states and
returning a one-column placeholder), then runs the real layer over the recorded states in blocks.

It checks itself on the pass's first step: that step runs the real layer, and its logits must equal
the deferred computation of the same hidden states (the output layer and the model's logit
soft-capping, `final_logit_softcapping`); a model that does anything else to its logits fails the
check, and the pass keeps the per-step logits. Only eager steps are deferred: a CUDA graph's step
would record a buffer it overwrites (and on a GPU the per-step layer is cheap).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kvtool.runtime.graphed import default_mode

# Rows the output layer takes at once (steps x rows of the batch): past ~256 the CPU's matrix product is
# near its best speed, and 256 x 262,144 float32 logits are 268 MB.
BLOCK_ROWS = 256


class _Recorder(nn.Module):
    """The model's output layer while a pass is deferred: records its input's last position and,
    once `defer` is set, returns a one-column placeholder instead of running."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.defer = False
        self.hidden: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden.append(hidden[:, -1].detach())
        if self.defer:
            return hidden.new_zeros(*hidden.shape[:-1], 1)
        return self.head(hidden)


class DeferredHead:
    """`with head:` swaps `model`'s output layer for a recorder; `check(logits)` with the first
    stepped logits decides whether the rest is deferred; `logits()` then yields (step, logits) for
    every recorded step after the checked one."""

    def __init__(self, model: Any):
        self.model = model
        self.recorder = _Recorder(model.get_output_embeddings())
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.cap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def applies(cls, model: Any, cache: Any, steps: int) -> bool:
        """Whether a pass of `steps` steps through `cache` can defer `model`'s output layer."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return steps > 2 and isinstance(head, nn.Linear) and default_mode(cache, model.device) == "eager"

    def __enter__(self) -> "DeferredHead":
        self.model.set_output_embeddings(self.recorder)
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.set_output_embeddings(self.recorder.head)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.recorder.head(hidden)
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits

    def check(self, logits: torch.Tensor) -> bool:
        """Whether `logits`, the model's own for the one recorded step, are what deferring computes;
        if so, later steps are deferred."""
        hidden = self.recorder.hidden[-1]
        ok = logits.shape[-1] == self.recorder.head.out_features and torch.allclose(
            self._logits(hidden), logits, rtol=1e-5, atol=1e-5
        )
        self.recorder.defer = bool(ok)
        return self.recorder.defer

    def logits(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(step, [B, V] logits) of each deferred step, steps numbered as the pass's (the checked
        step's logits predict step 1), in blocks of about BLOCK_ROWS rows."""
        deferred = self.recorder.hidden[1:]
        if not deferred:
            return
        rows = deferred[0].shape[0]
        per_block = max(1, BLOCK_ROWS // rows)
        for start in range(0, len(deferred), per_block):
            block = deferred[start : start + per_block]
            logits = self._logits(torch.cat(block))
            for i in range(len(block)):
                yield start + i + 2, logits[i * rows : (i + 1) * rows]
