"""Freed tensors go back to the system: glibc's threshold for mapping large blocks on their own, fixed.

torch's CPU tensors come from glibc's malloc. Blocks above its mmap threshold are mapped on their
own and unmapped when freed; the rest live in the heap, which only shrinks from its top. glibc
raises the threshold each time a mapped block is freed (up to 32 MiB), so after the first layers of
a prompt forward most activations land in the heap, interleaved with what stays alive (a cache's
keys and values, a held prompt): their memory stays resident after they are freed. A 2048 × 4
prompt phase of the SmolLM2 recipe peaked at 2.81 GB resident with glibc's default and 1.75 GB with
the threshold fixed at 1 MiB (the full cache's prompt forward: 1.82 and 1.55 GB); the prompt
forward's time did not change measurably (docs/results.md, speed and memory on the CPU). A decode
step's tensors stay below 1 MiB at the batch sizes kvtool runs, so steps keep reusing the heap.

The CLI sets it at start. An explicit MALLOC_MMAP_THRESHOLD_ in the environment wins; elsewhere
than glibc (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import sys

THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_large_frees(load=ctypes.CDLL) -> str:
    """Fix glibc's mmap threshold at THRESHOLD_BYTES; returns "set", "as set" (the environment
    says) or "unavailable" (not Linux with glibc)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "as set"
    if not sys.platform.startswith("linux"):
        return "unavailable"
    try:
        libc = load("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "unavailable"
    return "set" if mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1 else "unavailable"
