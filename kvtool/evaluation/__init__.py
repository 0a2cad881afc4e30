"""`kvtool eval`: what a budget costs in quality, per method, with the papers' protocol."""

from kvtool.evaluation.results import EvalReport, MethodResult
from kvtool.evaluation.runner import EvalConfig, evaluate

__all__ = ["EvalConfig", "EvalReport", "MethodResult", "evaluate"]
