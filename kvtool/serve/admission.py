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
(tests/test_serve_scheduler.py checks it). A prompt's forward holds its full keys and values until
the layer compresses them (with a draft, until the last round): one group of waiting requests at a
time, since the scheduler runs one prompt phase at once (its PROMPT_GROUP_ROWS and
PROMPT_GROUP_TOKENS bound the group); that transient is not reserved.
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


@dataclass
class Ledger:
    """The bytes and rows admitted requests hold (thread-safe: the HTTP side admits, the scheduler
    releases). `capacity` None: no memory limit, only `max_rows`."""

    capacity: int | None
    max_rows: int
    _held: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, key: int, need: int) -> bool:
        """Reserve `need` bytes and a row for `key`; False when they do not fit now."""
        with self._lock:
            if len(self._held) >= self.max_rows:
                return False
            if self.capacity is not None and sum(self._held.values()) + need > self.capacity:
                return False
            self._held[key] = need
            return True

    def release(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)

    @property
    def reserved(self) -> int:
        with self._lock:
            return sum(self._held.values())

    @property
    def rows(self) -> int:
        with self._lock:
            return len(self._held)
