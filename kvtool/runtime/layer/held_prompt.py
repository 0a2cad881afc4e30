"""A layer's whole prompt held aside for a draft's rows (runtime.draft), on the device or in host memory.

While a draft runs, every layer holds its uncompressed prompt: one more copy of the full cache's keys
and values beside the compressed cache, which on a GPU put the prompt phase's peak above the full
cache's (docs/results.md, on a GPU). There the held keys and values go to pinned host memory instead
(`RuntimeSettings.hold_prompt_on_host`, the default), copied on a side stream while the prompt forward
goes on, and come back one layer at a time when the draft's forward reads that layer (which compresses
it again there: runtime.held), each layer's copy back started on the side stream while the layer before
it computes (`fetch`). On a CPU they stay where they are, and the layer compresses its prompt only once
the prompt forward has ended (`PromptCompression.compress_pending`), so no compressed copy sits beside
it under the forward's activations, and a batch is prepared a group of rows at a time
(`runtime.row_groups`), so one group's held prompt and every row's compressed cache stay within the
full cache's keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtool.runtime.importance import PromptScores
from kvtool.runtime.layer.pinned import POOL
from kvtool.runtime.settings import current_settings

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
    # The CUDA event that ends the copy to host memory (None: keys and values on `device`). Nothing waits
    # on it: the copy back runs after it on the same side stream (`_side_stream`); it marks a host-held prompt.
    copied: Any = None

    @classmethod
    def hold(cls, keys, values, token_valid, scores, image, *, private: bool) -> "HeldPrompt":
        """Hold `keys` and `values` aside (in host memory on a GPU, by `RuntimeSettings.hold_prompt_on_host`);
        `private`: the layer goes on writing into these tensors, so a copy is held even on the device."""
        if private:  # on a GPU also: the copy out must not race the layer's later writes
            keys, values = keys.clone(), values.clone()
        if held_on_host(keys.device):
            (keys, values), copied = _to_host(keys, values)
            return cls(keys, values, token_valid, scores, image, copied)
        return cls(keys, values, token_valid, scores, image)

    @property
    def device(self) -> torch.device:
        return self.token_valid.device

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def fetch(self) -> Any:
        """Start copying keys and values held in host memory back to the device, on the side stream
        (after the copies out): what `followed_by` then reads. None when they are on the device."""
        if self.copied is None:
            return None
        return _to_device(self.keys, self.values, self.device)

    def followed_by(self, keys: torch.Tensor, values: torch.Tensor, fetched: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values with new rows' `keys` and `values` after them, on the device;
        `fetched` is what `fetch` started (started here if None)."""
        if self.copied is None:
            return torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        held_keys, held_values = _arrived(fetched if fetched is not None else self.fetch(), self.device)
        return torch.cat([held_keys, keys], dim=-2), torch.cat([held_values, values], dim=-2)


def let_go(held: list[HeldPrompt]) -> None:
    """The draft is done with `held`: buffers in host memory go back to the pool for the next draft
    (`runtime.layer.pinned`), once the copies queued from them have run."""
    on_host = [h for h in held if h.copied is not None]
    if on_host:
        POOL.give_back([t for h in on_host for t in (h.keys, h.values)], on_host[0].device)
    held.clear()


def held_on_host(device: torch.device) -> bool:
    """Whether a draft's prompts held for a model on `device` leave its memory (pinned host memory)."""
    return current_settings().hold_prompt_on_host and device.type == "cuda"


def _side_stream(device: torch.device) -> Any:
    """The stream of every copy out and back on `device`: in one queue, a copy back runs after the
    copy out it reads, and a pinned buffer's next copy out after the last copy back from it."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _to_device(keys: torch.Tensor, values: torch.Tensor, device: torch.device) -> Any:
    """Copies of pinned `keys` and `values` on `device`, made on the side stream, and the event that
    ends them."""
    stream = _side_stream(device)
    with torch.cuda.stream(stream):
        copies = [torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t, non_blocking=True) for t in (keys, values)]
        ready = torch.cuda.Event()
        ready.record(stream)
    return copies[0], copies[1], ready


def _arrived(fetched: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values `_to_device` copied, once the device's queue has waited for them (the
    host does not); the allocator keeps their memory until the device's queue is done with them."""
    keys, values, ready = fetched
    current = torch.cuda.current_stream(device)
    ready.wait(current)
    keys.record_stream(current)
    values.record_stream(current)
    return keys, values


def _to_host(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Copies of CUDA `tensors` in pinned host memory, made on a side stream after the work queued so
    far, and the event that ends them. The device tensors may be freed at once: the caching allocator
    keeps their memory until the side stream has read it (`record_stream`)."""
    device = tensors[0].device
    stream = _side_stream(device)
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
