"""`kvtool serve`: an OpenAI-compatible server whose compressed caches turn into concurrency.

    served = ServedModel(loaded, profile)              # the model, attached to the profile
    scheduler = Scheduler(served, Ledger(capacity, max_rows))  # the one inference thread
    app = build_app(scheduler)                         # FastAPI routes; uvicorn runs it

Modules: `served` (the model, prompts, one cache per request), `admission` (KV bytes a request will
hold, against `--kv-memory`), `batch` (one decode step over every request's own cache), `sampling`
(token choice, stop sequences), `scheduler` (the thread), `schema` and `app` (HTTP).
"""

from kvtool.serve.admission import Ledger, parse_size
from kvtool.serve.app import build_app
from kvtool.serve.scheduler import Job, Scheduler
from kvtool.serve.served import ServedModel

__all__ = ["Job", "Ledger", "Scheduler", "ServedModel", "build_app", "parse_size"]
