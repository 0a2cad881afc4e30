"""kvtool's version, written into every profile it makes."""

__version__ = "0.1.0"
