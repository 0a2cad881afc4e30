"""Offline calibration: importance statistics, Lorenz curves, per-layer ratios, truncation tuning."""
