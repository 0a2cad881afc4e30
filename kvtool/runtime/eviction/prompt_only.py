"""`prompt-only`: compress the prompt only. The prompt is compressed to its share, then nothing is evicted while
generating: every new token adds one entry, so memory exceeds the budget by the generated tokens, by
design. This is what kvpress and most papers measure; name it prompt-only wherever it is compared."""

from __future__ import annotations

import torch

from kvtool.runtime.eviction.base import EntryView, EvictRule


class PromptOnly(EvictRule):
    name = "prompt-only"
    holds_budget = False

    def victim(self, entries: EntryView) -> torch.Tensor:
        raise AssertionError("prompt-only compression never evicts")  # the layer never asks
