"""The runtime's switches in one public value: `RuntimeSettings`, read through `current_settings()`.

Each field chooses between two ways of computing the same cache (the same tokens; some differ in
float rounding or in where memory goes) on a GPU, or which loop `handle.generate` decodes with. The
defaults are what kvtool ships; `use_settings(**changes)` changes some of them for the code inside
its `with` block (a benchmark timing one way against the other, a check comparing them):

    from kvtool.runtime.settings import use_settings

    with use_settings(fused_decode_step=False):
        out = handle.generate(**inputs, max_new_tokens=64)  # the decode steps in eager ops

The value is process-wide, as the module constants it replaced were, and each one is read where it
takes effect: `hold_prompt_on_host` when a draft holds a layer's prompt (runtime.layer.held_prompt),
`fused_decode_step` when a layer fixes its slots for a decode loop (runtime.layer.fixed),
`split_victim_search` when the fused step's kernels are launched (kernels/triton_step.py, so a CUDA
graph keeps what it captured), `mixed_precision_decode` at each decode attention with scores
(runtime.importance.decode), `generate_loop` at each `generate` call (runtime.graphed_generate).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

GENERATE_LOOPS = ("auto", "fixed", "off")


@dataclass(frozen=True)
class RuntimeSettings:
    """How the runtime computes what it computes; see the module docstring for where each is read."""

    # Where a GPU holds a draft's whole prompts while the draft runs: True, in pinned host memory
    # (the prompt phase's peak then stays below the full cache's); False, on the GPU (no copies:
    # faster, one more copy of the keys and values). Off a GPU they stay where they are either way.
    hold_prompt_on_host: bool = True
    # Whether fixed-slot layers that qualify (the shipped recipe's: per-head `heavy-hitter`, packed,
    # on a device Triton runs on) decode through the four Triton kernels of kernels/triton_step.py
    # (True) or through some 40 eager ops a layer (False). Both compute the same step.
    fused_decode_step: bool = True
    # Whether the fused step's score-and-victim kernel walks each row's slots in the attention's
    # splits (True) or in one program per row and KV head (False). The same victims either way.
    split_victim_search: bool = True
    # Whether a half-precision model's decode attention with scores on a GPU multiplies its own keys
    # and values straight into float32 results, the values' product in chunks of slots (True), or
    # multiplies float32 copies of them (False). The same results up to float rounding.
    mixed_precision_decode: bool = True
    # The loop `handle.generate` decodes with (runtime.graphed_generate): "auto", kvtool's own loop of
    # `Decoder` steps on CUDA devices (one CUDA graph replayed), transformers' loop elsewhere;
    # "fixed", kvtool's loop everywhere (off a GPU its fixed-slot steps run eagerly); "off",
    # transformers' own loop always. The same sequences either way.
    generate_loop: str = "auto"

    def __post_init__(self) -> None:
        if self.generate_loop not in GENERATE_LOOPS:
            raise ValueError(f"generate_loop must be one of {', '.join(GENERATE_LOOPS)}, not {self.generate_loop!r}")


_current = RuntimeSettings()


def current_settings() -> RuntimeSettings:
    """The settings the runtime reads now."""
    return _current


@contextlib.contextmanager
def use_settings(**changes: object) -> Iterator[RuntimeSettings]:
    """The current settings with `changes` (field names of `RuntimeSettings`) for the code inside the
    `with` block, which gets them as its value; the settings before are back after it, also after
    an error. Blocks nest."""
    global _current
    saved = _current
    _current = dataclasses.replace(saved, **changes)
    try:
        yield _current
    finally:
        _current = saved
