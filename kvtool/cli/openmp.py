"""How idle OpenMP threads wait, chosen from what the CPU is doing when a long command starts.

Calibration and evaluation run hundreds of one-token forwards of a small model whose matrix products
are small, so torch's OpenMP threads meet at a barrier thousands of times a second. Spinning there
(libgomp's default: a few hundred thousand iterations before sleeping) is fastest on an otherwise
idle CPU. With another busy process on the same cores, a spinning thread holds a core the other
process wants and the barrier waits for a thread that is not running; sleeping at once
(OMP_WAIT_POLICY=PASSIVE) is then the better choice. Measured on the 2-core development machine
with `calibrate("smollm2", 0.2)`: docs/results.md, "Calibration time".

So the threads keep libgomp's default when the CPU is idle as the command starts, and sleep at
once when something else is already running. An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
The choice must be made before torch is imported: libgomp reads it once, when it is loaded.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

# Cores other processes keep busy, above which the threads sleep instead of spinning.
BUSY_CORES = 0.25
# How long the CPU is watched before the choice (the command does nothing else meanwhile).
SAMPLE_SECONDS = 0.25


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (None where it cannot be read)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - idle, total


def cores_in_use(seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores busy over the next `seconds` (this process sleeps meanwhile, so it is the others' use);
    None where /proc/stat cannot be read."""
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return None
    share = (after[0] - before[0]) / (after[1] - before[1])
    return share * (os.cpu_count() or 1)


def choose_openmp_wait(measure: Callable[[], float | None] = cores_in_use) -> str:
    """Set this process's OpenMP wait policy from the CPU's load (before torch is imported) and say
    which: "spin" (libgomp's default), "passive", "as set" when the environment already says, or
    "too late" when torch (and with it libgomp) is already loaded, as in a test process."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return "as set"
    if "torch" in sys.modules:
        return "too late"
    busy = measure()
    if busy is not None and busy < BUSY_CORES:
        return "spin"
    # Busy, or unknown (no /proc/stat): sleeping never costs more than about a quarter.
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "passive"
