"""Pinned host buffers that a draft's held prompts reuse from one prompt to the next (on a GPU).

Pinning host memory is slow, and torch's caching host allocator, which would otherwise keep freed
pinned blocks for the next prompt, is emptied by every CUDA graph capture (`torch.cuda.graph` calls
`torch._C._host_emptyCache()`). Measured on an H100 at Llama-3.1-8B's shape, 8192 x 4: the 4 GiB a
draft held were unpinned at the decode's graph capture (0.56-0.81 s there against 0.07-0.10 s) and
pinned afresh by the next prompt. The pool keeps the last draft's buffers referenced, so a capture
cannot free them, and hands them to the next draft: with it `bash benchmarks/gpu_check.sh` measures
the recipe's decode at 257.9 tok/s there, against 174.5 without it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

# A free buffer serves a request of at least half its size (prompts of similar lengths share them).
SLACK = 2


class PinnedPool:
    """Pinned uint8 buffers: `take` one per held tensor, `give_back` them once the draft is done."""

    def __init__(self):
        self._free: list[torch.Tensor] = []
        self._ready: Any = None  # the event after which the free buffers' last reads have ended
        self._lock = threading.Lock()  # drafts in two threads never take the same buffer

    @property
    def free_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._free)

    def take(self, shape: torch.Size, dtype: torch.dtype, stream: Any = None) -> torch.Tensor:
        """A pinned host tensor of `shape` and `dtype`; `stream`, the CUDA stream that will write it,
        first waits for the reads queued before the buffer came back."""
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.numel() <= SLACK * max(nbytes, 1)]
            buffer = min(fits, key=torch.Tensor.numel) if fits else None
            if buffer is not None:
                self._free.remove(buffer)
                if stream is not None and self._ready is not None:
                    stream.wait_event(self._ready)
        if buffer is None:
            buffer = self._allocate(nbytes)
        return buffer[:nbytes].view(dtype).view(shape)

    def give_back(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        """`tensors` (from `take`) are no longer needed once the work queued on `device` so far has
        run. They become the free buffers; those not taken since are let go (the pool holds what the
        last draft held, no more)."""
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        with self._lock:
            self._free, self._ready = [_whole(tensor) for tensor in tensors], ready

    def clear(self) -> None:
        """Let every free buffer go (torch's host allocator unpins them)."""
        with self._lock:
            self._free, self._ready = [], None

    @staticmethod
    def _allocate(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The uint8 buffer under a tensor `take` returned."""
    buffer = torch.empty(0, dtype=torch.uint8)
    return buffer.set_(tensor.untyped_storage())


POOL = PinnedPool()
