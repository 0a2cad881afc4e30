"""kvtool: calibrate per-layer KV-cache budgets offline, apply them at generation time."""

__version__ = "0.1.0"
