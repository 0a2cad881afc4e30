"""A layer's whole prompt held aside for a draft's rows (runtime.draft), on the device or in host memory.

While a draft runs, every layer holds its uncompressed prompt: one more copy of the full cache's keys
and values beside the compressed cache, which on a GPU put the prompt phase's peak above the full
cache's (docs/results.md, on a GPU). There the held keys and values go to pinned host memory instead,
copied on a side stream while the prompt forward goes on, and come back one layer at a time when the
draft's forward reads that layer (which compresses it again there: runtime.held). On a CPU they stay
where they are, and the layer compresses its prompt only once the prompt forward has ended
(`PromptCompression.compress_pending`), so no compressed copy sits beside it under the forward's
activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtool.runtime.importance import PromptScores
from kvtool.runtime.layer.pinned import POOL

# Where a GPU holds a draft's prompts: True, in pinned host memory (the prompt phase's peak then stays
# below the full cache's); False, on the GPU (no copies: faster, one more copy of the keys and values).
ON_HOST = True

_STREAMS: dict[torch.device, Any] = {}


@dataclass(frozen=True)
class HeldPrompt:
    """One layer's whole prompt as its forward left it, before compression: what a draft's rows
    attend to and what the layer compresses again once their attention has joined the scores."""

    keys: torch.Tensor  # [B, Hkv, n, D], on `device` or in pinned host memory
    values: torch.Tensor
    token_valid: torch.Tensor  # [B, n] real (unpadded) columns, on the layer's device
    scores: PromptScores | None  # what the prompt pass scored (None where the layer ranks by position)
    image: torch.Tensor | None  # [B, n] image-token positions, or None
    copied: Any = None  # the CUDA event that ends the copy to host memory; None: keys and values on `device`

    @classmethod
    def hold(cls, keys, values, token_valid, scores, image, *, private: bool) -> "HeldPrompt":
        """Hold `keys` and `values` aside (in host memory on a GPU, by `ON_HOST`); `private`: the
        layer goes on writing into these tensors, so a copy is held even on the device."""
        if private:  # on a GPU also: the copy out must not race the layer's later writes
            keys, values = keys.clone(), values.clone()
        if _on_host(keys.device):
            (keys, values), copied = _to_host(keys, values)
            return cls(keys, values, token_valid, scores, image, copied)
        return cls(keys, values, token_valid, scores, image)

    @property
    def device(self) -> torch.device:
        return self.token_valid.device

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def followed_by(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values with new rows' `keys` and `values` after them, on the device."""
        if self.copied is None:
            return torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        _wait(self.copied, self.device)
        n = self.length
        out = []
        for held, new in ((self.keys, keys), (self.values, values)):
            whole = torch.empty(*held.shape[:2], n + new.shape[2], held.shape[3], dtype=held.dtype, device=self.device)
            whole[:, :, :n].copy_(held, non_blocking=True)  # pinned memory: queued, the host goes on
            whole[:, :, n:] = new
            out.append(whole)
        return out[0], out[1]


def let_go(held: list[HeldPrompt]) -> None:
    """The draft is done with `held`: buffers in host memory go back to the pool for the next draft
    (`runtime.layer.pinned`), once the copies queued from them have run."""
    on_host = [h for h in held if h.copied is not None]
    if on_host:
        POOL.give_back([t for h in on_host for t in (h.keys, h.values)], on_host[0].device)
    held.clear()


def _on_host(device: torch.device) -> bool:
    return ON_HOST and device.type == "cuda"


def _wait(copied: Any, device: torch.device) -> None:
    """The device's queue waits for the copy out to end; the host does not."""
    copied.wait(torch.cuda.current_stream(device))


def _to_host(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Copies of CUDA `tensors` in pinned host memory, made on a side stream after the work queued so
    far, and the event that ends them. The device tensors may be freed at once: the caching allocator
    keeps their memory until the side stream has read it (`record_stream`)."""
    device = tensors[0].device
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        hosts = []
        for tensor in tensors:
            host = POOL.take(tensor.shape, tensor.dtype, stream)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
            hosts.append(host)
        copied = torch.cuda.Event()
        copied.record(stream)
    return tuple(hosts), copied
