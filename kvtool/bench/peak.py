"""Peak memory during one measured run.

CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (tensor memory on the GPU).
CPU: the process's resident set size (RSS), read from /proc/self/statm by a background thread
every 5 ms while the run lasts; the maximum sample. Where /proc is missing (macOS), the process's
lifetime peak RSS from `resource.getrusage` (`ru_maxrss`), which never goes down, so later runs
report at least what earlier ones did.

The resident set is what the machine feels, but it spreads by up to 0.6 GB between identical runs
(glibc keeps freed activations resident in fragmented heaps). `track_tensor_peak` measures what the
code itself holds, the same in every run: the most bytes of tensors the block had allocated at
once, net of what it freed, from the allocation events of torch's profiler (on CUDA from the
allocator's own peak). It slows the block, so the benchmark takes it from untimed runs.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

SAMPLE_INTERVAL_S = 0.005
_STATM = "/proc/self/statm"

CUDA_METHOD = "cuda max_memory_allocated (peak tensor memory on the GPU during the run)"
STATM_METHOD = "cpu rss: /proc/self/statm sampled every 5 ms during the run (peak resident set of the process)"
RUSAGE_METHOD = "cpu ru_maxrss: getrusage peak resident set of the process so far (lifetime peak, not per run)"


@dataclass
class PeakReading:
    """`bytes` is filled in when the `track_peak` block ends; `so_far()` reads the peak inside it."""

    bytes: int = 0
    _read: Callable[[], int] | None = field(default=None, repr=False)

    def so_far(self) -> int:
        """The peak from the block's start until now (a benchmark's prompt phase: the peak before decoding)."""
        return self._read() if self._read is not None else self.bytes


def _statm_available() -> bool:
    try:
        return _read_rss() > 0
    except OSError:
        return False


def _read_rss() -> int:
    with open(_STATM, "rb") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory_method(device: torch.device) -> str:
    """Which measurement `track_peak` makes on this device (the JSON and the table say it)."""
    if device.type == "cuda":
        return CUDA_METHOD
    return STATM_METHOD if _statm_available() else RUSAGE_METHOD


def release_memory(device: torch.device) -> None:
    """Return freed memory before a run, so one run's garbage does not count toward the next one's peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform.startswith("linux"):
        try:  # glibc keeps freed heap pages resident until trimmed
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="kvtool-bench-rss", daemon=True)
        self.peak = _read_rss()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_INTERVAL_S):
            self.peak = max(self.peak, _read_rss())

    def so_far(self) -> int:
        self.peak = max(self.peak, _read_rss())
        return self.peak

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, _read_rss())
        return self.peak


def _ru_maxrss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB elsewhere


@contextmanager
def track_peak(device: torch.device) -> Iterator[PeakReading]:
    """Peak memory of the block, by the method `peak_memory_method(device)` names."""
    reading = PeakReading()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

        def cuda_peak() -> int:
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))

        reading._read = cuda_peak
        try:
            yield reading
        finally:
            reading.bytes = cuda_peak()
        return
    if not _statm_available():
        reading._read = _ru_maxrss_bytes
        try:
            yield reading
        finally:
            reading.bytes = _ru_maxrss_bytes()
        return
    sampler = _RssSampler()
    sampler.start()
    reading._read = sampler.so_far
    try:
        yield reading
    finally:
        reading.bytes = sampler.stop()


@contextmanager
def track_tensor_peak(device: torch.device) -> Iterator[PeakReading]:
    """The most bytes of tensors the block had allocated at once, net of those of them it freed
    (filled in when the block ends). On a CPU the profiler does not see the block free tensors made
    before it; on CUDA such frees lower the block's count."""
    reading = PeakReading()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield reading
        finally:
            torch.cuda.synchronize(device)
            reading.bytes = int(torch.cuda.max_memory_allocated(device)) - start
        return
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler prints a line to stderr as it starts and stops
        profiler.start()
    try:
        yield reading
    finally:
        with _quiet_stderr():
            profiler.stop()
    changes = sorted(
        (event.start_ns(), event.nbytes()) for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in changes:  # an allocation's nbytes is positive, a free's negative
        held += nbytes
        peak = max(peak, held)
    reading.bytes = peak


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
