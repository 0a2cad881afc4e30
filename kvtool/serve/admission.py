"""Who gets a place in the running batch: the KV bytes a request's cache will hold, against `--kv-memory`.

A request is admitted when the bytes its cache will hold at its largest (its prompt and every token
it may generate, `max_tokens`, kept at the profile's per-layer shares) fit beside what the admitted
requests hold, and the batch has a row for it (`--max-batch`); otherwise it is refused at once (429
with Retry-After), never queued without bound. So memory, not a guess, sets how many sequences run
together: a profile that keeps a fifth of the entries admits about five times the sequences of the
full cache in the same memory.

The projection (`KvFootprint.projected`) counts, per layer, the entries the layer keeps at
`prompt + max_tokens` tokens (`ceil(ratio * T)`, at least the floor, at most T; every entry in a layer
the profile leaves whole) plus the slots a layer adds when it grows (`GROWTH_SLOTS`), each entry at
its stored bytes (keys and values, every KV head) and the per-slot bookkeeping a compressing layer
carries. It is what the cache can grow to, so it bounds what `usage.kv_bytes` reports at the end
(tests/test_serve_scheduler.py checks it).

A prompt phase holds more than its caches will keep: the full keys and values of its prompt until a
layer compresses them (without a draft, one layer's at a time; with a draft, every layer's until the
last round, `runtime.layer.held_prompt`). The scheduler runs one prompt phase at once, so the ledger
keeps room for the largest one any admitted request still waits for (`KvFootprint.prompt_phase`): a
request is admitted only if its bytes, every admitted request's and that room fit in `--kv-memory`,
and a prompt phase takes only the waiting requests whose prompt-phase bytes fit beside what is
reserved (`Ledger.room`). The oldest waiting request always fits, so nothing waits without end.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

import numpy as np

from kvtool.errors import KvtoolError
from kvtool.runtime.selection import kept_count

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "t": 1000**4, "tb": 1000**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

# Bytes of per-slot state a compressing layer keeps beside each row's entries: validity and frozen
# flags, the entry's logical column (int64), its score and its latest attention (float32), image flag.
SLOT_STATE_BYTES = 1 + 1 + 8 + 4 + 4 + 1


def parse_size(text: str) -> int:
    """"2GiB", "512MiB", "1.5G", "1000000" as bytes (binary units KiB..TiB, decimal K/KB..T/TB)."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise KvtoolError(f"--kv-memory: cannot read {text!r} as a size (say 2GiB, 512MiB or a number of bytes)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise KvtoolError(f"--kv-memory must be above 0, got {text!r}")
    return size


@dataclass(frozen=True)
class LayerShare:
    """What one layer keeps of a request: `ratio` of its tokens (at least `floor`), each entry
    `entry_bytes` (keys and values of every KV head); `window` caps a sliding layer; `compressing`
    layers add `SLOT_STATE_BYTES` per slot and grow by `growth` slots at a time."""

    ratio: float
    entry_bytes: int
    floor: int = 0
    window: int | None = None
    compressing: bool = True
    growth: int = 0
    prompt_entry_bytes: int = 0  # an entry as the prompt forward holds it (native), in a compressing layer
    keeps_prompt: bool = False  # it keeps the prompt's entries as the forward wrote them (ratio 1.0, native)


@dataclass(frozen=True)
class KvFootprint:
    """The per-layer shares of one cache kind (a profile's, or the full cache's)."""

    layers: tuple[LayerShare, ...]

    def projected(self, tokens: int) -> int:
        """Bytes this cache holds at most for one sequence of `tokens` tokens."""
        total = 0
        for layer in self.layers:
            kept = int(kept_count(layer.ratio, np.array([tokens]), layer.floor)[0]) if layer.ratio < 1.0 else tokens
            if layer.window is not None:
                kept = min(kept, layer.window)
            slots = kept + layer.growth
            total += slots * (layer.entry_bytes + (SLOT_STATE_BYTES if layer.compressing else 0))
        return total

    def prompt_phase(self, rows: int, tokens: int, held: bool) -> int:
        """Bytes a prompt phase of `rows` rows of `tokens` (padded) tokens holds beyond what its caches
        keep: every compressing layer's full prompt while a draft `held` it, else the largest layer's."""
        if held:  # every layer holds a copy, a layer that keeps its prompt too (it goes on writing there)
            return rows * tokens * sum(layer.prompt_entry_bytes for layer in self.layers)
        return rows * tokens * max([0, *(layer.prompt_entry_bytes for layer in self.layers if not layer.keeps_prompt)])


@dataclass
class Ledger:
    """The bytes and rows admitted requests hold, and the room kept for the prompt phase of those
    still waiting for one (thread-safe: the HTTP side admits, the scheduler starts and releases).
    `capacity` None: no memory limit, only `max_rows`."""

    capacity: int | None
    max_rows: int
    _held: dict[int, int] = field(default_factory=dict)
    _prompts: dict[int, int] = field(default_factory=dict)  # waiting requests' prompt-phase bytes
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, key: int, need: int, prompt: int = 0) -> bool:
        """Reserve `need` bytes and a row for `key`, whose prompt phase holds `prompt` bytes more for
        a while; False when they do not fit now beside the room kept for the waiting prompt phases."""
        with self._lock:
            if len(self._held) >= self.max_rows:
                return False
            room_kept = max([prompt, *self._prompts.values()])
            if self.capacity is not None and sum(self._held.values()) + need + room_kept > self.capacity:
                return False
            self._held[key] = need
            self._prompts[key] = prompt
            return True

    def started(self, key: int) -> None:
        """`key`'s prompt phase is over: the room kept for it goes."""
        with self._lock:
            self._prompts.pop(key, None)

    def release(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)
            self._prompts.pop(key, None)

    @property
    def room(self) -> float:
        """Bytes a prompt phase may hold beside every reservation now (inf without a memory limit)."""
        with self._lock:
            return float("inf") if self.capacity is None else self.capacity - sum(self._held.values())

    @property
    def reserved(self) -> int:
        with self._lock:
            return sum(self._held.values())

    @property
    def rows(self) -> int:
        with self._lock:
            return len(self._held)
