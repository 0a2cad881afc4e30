"""One-token decode forwards through a cache, replayed as a CUDA graph where that is possible.

On a GPU a decode step of a small batch is bound by kernel launches, not by reading the cache: the
full cache of an 8B model launches about 1,200 kernels a step at about 22 µs of host time each, and a
kvtool cache's eager bookkeeping 21 more per layer (`benchmarks/gpu_bench.py --shape llama3-8b
--profile` on an H100: 1,884 launches a step against 1,204). Compressing the cache then
saves memory but no time. With its slots fixed (layer/fixed.py) a kvtool cache's decode step runs
the same kernels on the same buffers every time and reads nothing back to the host, so the whole
step, the model's forward included, is captured once as a CUDA graph and then replayed: one launch
per step, and the step costs what its kernels cost on the GPU. On an H100 at Llama-3.1-8B's shape
that takes kvtool's decode from 0.48x / 0.56x the full cache's to 1.70x / 1.55x (8192 x 4 / 32768 x 2;
`benchmarks/gpu_bench.py --shape llama3-8b --shapes 8192x4,32768x2`).

`Decoder` is what the benchmarks' decode loop (`kvtool.bench.measure.decode_steps`), the draft's
steps (`runtime.steps.step_tokens`) and `generate`'s loop (`runtime.graphed_generate`) call. It picks:
- "graph": a kvtool cache on a CUDA device, every layer compressed: fixed slots, the first step run
  eagerly on a side stream (CUDA graphs want their kernels warmed up), the second captured, and every
  step from then on a replay;
- "fixed": fixed slots run eagerly (what the graph replays; the tests check it on a CPU, where
  there is no graph, against the eager steps);
- "eager": anything else, and on a CPU, where fixed slots would only add the masking of spare slots.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.layer import CompressingLayer

MODES = ("auto", "graph", "fixed", "eager")


def graph_applies(cache: Any, device: torch.device) -> bool:
    """Whether `cache`'s decode steps can be a CUDA graph on `device`: a kvtool cache (not a grouped or
    held one) whose every layer is a compressed kvtool layer."""
    return (
        device.type == "cuda"
        and type(cache) is KvtoolCache
        and all(isinstance(layer, CompressingLayer) and layer.compressed for layer in cache.layers)
    )


def default_mode(cache: Any, device: torch.device) -> str:
    """The mode "auto" picks: "graph" where `graph_applies`, else "eager"."""
    return "graph" if graph_applies(cache, device) else "eager"


class Decoder:
    """`decoder(token, position)` runs one decode forward of `steps` at most and returns the [B, V]
    logits of the fed token (with "graph", the graph's output buffer: read it before the next call)."""

    def __init__(self, model: Any, cache: Any, steps: int, mode: str = "auto"):
        if mode not in MODES:
            raise KvtoolError(f"unknown decode mode {mode!r} (known: {', '.join(MODES)})")
        device = model.device
        if mode == "auto":
            mode = default_mode(cache, device)
        if mode == "graph" and not graph_applies(cache, device):
            raise KvtoolError("a CUDA-graph decode needs a kvtool cache with every layer compressed, on a CUDA device")
        if mode in ("graph", "fixed"):
            cache.fix_slots(steps)
        self.model, self.cache, self.mode = model, cache, mode
        self._left = steps
        self._ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._warm = False
        self._graph: Any = None
        self._logits: torch.Tensor | None = None

    @property
    def left(self) -> int:
        """Steps still to come out of the `steps` it was made for (fixed slots and graphs)."""
        return self._left

    def __call__(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if self.mode == "eager":
            return self._forward(token, position)
        if self._left < 1:
            raise KvtoolError("internal: more decode steps than the fixed slots were made for")
        self._left -= 1
        if self._ids is None:
            self._ids, self._positions = token.clone(), position.clone()
        else:
            self._ids.copy_(token)
            self._positions.copy_(position)
        if self._graph is not None:
            self._graph.replay()
            return self._logits
        if self.mode == "fixed":
            return self._forward(self._ids, self._positions)
        if not self._warm:
            # A real step on a side stream: what torch asks before a capture (library handles and
            # lazily built state are set up by then, not inside the graph).
            current = torch.cuda.current_stream(self._ids.device)
            side = torch.cuda.Stream(self._ids.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                logits = self._forward(self._ids, self._positions)
            current.wait_stream(side)
            self._warm = True
            return logits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step; nothing runs until the replay
            self._logits = self._forward(self._ids, self._positions)
        self._graph = graph
        graph.replay()
        return self._logits

    def close(self) -> None:
        """Free the graph and give the cache its eager steps back."""
        self._graph, self._logits = None, None
        if self.mode in ("graph", "fixed"):
            self.cache.release_slots()

    def _forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # No attention mask: a kvtool layer masks by its own slots and a plain cache needs none for
        # unpadded rows; transformers then builds none (reading a 2-D mask would wait for the GPU).
        out = self.model(
            input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1,
            **with_cache(self.model, self.cache),
        )
        return out.logits[:, -1]
