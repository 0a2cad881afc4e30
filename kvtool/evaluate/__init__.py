"""`kvtool eval`: what a budget costs in quality, per method, with the papers' protocol."""

from kvtool.evaluate.results import EvalReport, MethodResult
from kvtool.evaluate.runner import EvalConfig, evaluate

__all__ = ["EvalConfig", "EvalReport", "MethodResult", "evaluate"]
