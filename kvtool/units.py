"""Human-readable quantities for reports (standard library only, so any layer may use it)."""

from __future__ import annotations


def human_bytes(count: int) -> str:
    """`count` bytes in B, KiB, MiB or GiB (binary units; two decimals above bytes)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
