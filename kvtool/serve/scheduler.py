"""The one inference thread: requests join the running batch, decode in it, and leave when done.

The HTTP side admits a request (`Scheduler.submit`: its KV bytes reserved, `serve.admission`) and
waits on its events; everything that touches the model runs here, one thing at a time:

1. requests whose client went away are dropped: their caches and reservations go before the next
   step, so a disconnect frees its rows within a step;
2. the waiting group runs its prompt phase: the oldest waiting request and the waiting ones that
   run with the same cache and draft (`ServedModel.cache_for`: compressed or, for a short prompt,
   the full cache; a sampled request's draft is not verified; the draft is capped by max_tokens),
   up to PROMPT_GROUP_ROWS of them and PROMPT_GROUP_TOKENS padded tokens. One
   `runtime.draft.prepare` over their left-padded batch (prefill, the draft if the profile has one,
   compression), then its cache is split into one cache per request (`runtime.split`), each
   holding its row as that request's own prompt phase would; each request picks its first token;
3. one decode step feeds every running request its latest token (`serve.batch.decode_step`), each
   row through its own cache; finished requests report their usage and leave.

One prompt phase per step keeps the running requests' tokens coming while others join; running the
waiting requests' prompt phases as one batch pays a draft's decode-like steps once for the group
instead of once per request. Each request's tokens depend on its own cache and logits only, so at
temperature 0 its reply is what `kvtool generate` gives it alone, whatever else is in the batch
(tests/test_serve_scheduler.py): a padded row's layers hold what its prompt alone leaves them, and
its values differ only by the float rounding a batch's matrix products and masked attention give
(the tiny test model in float32: compressed layers' kept entries bit for bit, budget-1.0 layers'
within 4e-6, first logits within 5e-6; the batched decode step's own rounding is 6e-6), which
changes no greedy token or kept entry unless two values tie that closely.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.draft import Verified, prepare
from kvtool.runtime.memory import kv_bytes, kv_bytes_full
from kvtool.runtime.split import split_rows
from kvtool.runtime.steps import Prompt
from kvtool.scoring.batches import left_pad
from kvtool.serve.admission import Ledger
from kvtool.serve.batch import decode_step
from kvtool.serve.sampling import Picker, StopText
from kvtool.serve.served import RequestCache, ServedModel

log = logging.getLogger("kvtool.serve")

_ids = itertools.count(1)

# The most requests one prompt phase runs at once, and the most padded tokens (rows x the longest
# prompt) it takes: a prompt phase's activations (and, with a draft, its held prompts) grow with the
# batch, and admission reserves only what the caches keep. A prompt longer than this runs alone.
PROMPT_GROUP_ROWS = 8
PROMPT_GROUP_TOKENS = 8192


@dataclass
class Job:
    """One request as the scheduler runs it. `emit(kind, payload)` hands events to the HTTP side
    (from this thread): ("text", str) pieces, then ("done", usage dict) or ("error", message)."""

    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    emit: Callable[[str, Any], None] = lambda kind, payload: None
    key: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False  # set by the HTTP side when its client goes away
    # Filled while it runs:
    generated: list[int] = field(default_factory=list)
    cache: Any = None
    picker: Picker | None = None
    text: StopText | None = None
    finish: str | None = None

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """Owns the model's thread. `submit` admits or refuses; `stop` lets the running requests finish."""

    def __init__(self, served: ServedModel, ledger: Ledger):
        self.served = served
        self.ledger = ledger
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._wake = threading.Condition()
        self._stopping = False
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0}
        self.held_bytes = 0  # KV bytes the running caches hold, after the latest step
        self.peak_rows = 0
        self._thread = threading.Thread(target=self._run, name="kvtool-scheduler", daemon=True)
        self._thread.start()

    # ----- HTTP side ---------------------------------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Queue `job` if its KV bytes, its prompt phase's and a row fit now (False: refused, nothing held)."""
        need, prompt = self.needs(job)
        with self._wake:
            if self._stopping or not self.ledger.admit(job.key, need, prompt):
                self.counts["refused"] += 1
                return False
            self._waiting.append(job)
            self._wake.notify()
        return True

    def needs(self, job: Job) -> tuple[int, int]:
        """The KV bytes `job`'s cache may come to hold, and what its prompt phase alone holds beyond them."""
        served = self.served
        return served.projected_bytes(len(job.ids), job.max_tokens), served.prompt_bytes(len(job.ids), job.max_tokens, job.temperature > 0)

    def status(self) -> dict[str, Any]:
        with self._wake:
            return {
                "running": len(self._running), "waiting": len(self._waiting), "kv_reserved": self.ledger.reserved,
                "kv_held": self.held_bytes, "kv_memory": self.ledger.capacity, "max_batch": self.ledger.max_rows,
                "peak_running": self.peak_rows, **self.counts,
            }

    def stop(self, timeout: float | None = None) -> None:
        """No new requests; returns once every admitted one has finished (or `timeout` passed)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ----- the model's thread ------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._waiting and not self._running and not self._stopping:
                        self._wake.wait()
                    if self._stopping and not self._waiting and not self._running:
                        return
                    group = self._take_group()
                self._drop_cancelled()
                if group:
                    self._start(group)
                if self._running:
                    self._step()

    def _take_group(self) -> list[tuple[Job, RequestCache]]:
        """The oldest waiting request and the waiting ones after it whose prompt phase can share its
        batch (the same cache and draft, `RequestCache.kind`), up to PROMPT_GROUP_ROWS rows,
        PROMPT_GROUP_TOKENS padded tokens and the prompt-phase bytes that fit beside every reservation
        (`Ledger.room`; the oldest alone always does, by admission); they leave the queue (called
        holding the lock)."""
        if not self._waiting:
            return []
        oldest = self._waiting.popleft()
        first = self._cache_for(oldest)
        group = [(oldest, first)]
        if not first.shares_prompt:
            return group
        width = len(oldest.ids)
        room = self.ledger.room
        for job in list(self._waiting):
            if len(group) >= PROMPT_GROUP_ROWS:
                break
            chosen = self._cache_for(job)
            wider = max(width, len(job.ids))
            if chosen.kind != first.kind or wider * (len(group) + 1) > PROMPT_GROUP_TOKENS:
                continue
            if first.prompt_bytes(len(group) + 1, wider) > room:
                continue
            self._waiting.remove(job)
            group.append((job, chosen))
            width = wider
        return group

    def _cache_for(self, job: Job) -> RequestCache:
        return self.served.cache_for(len(job.ids), job.max_tokens, job.temperature > 0)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._running if j.cancelled]:
            self._leave(job, "cancelled")

    def _start(self, group: list[tuple[Job, RequestCache]]) -> None:
        """One prompt phase for every job of `group` (one kind, `_take_group`): a left-padded batch
        through `prepare`, its cache split into one per request (`runtime.split`); a job alone runs
        its own row, unpadded."""
        for job, _ in group:
            if job.cancelled:
                self._leave(job, "cancelled")
        group = [(job, chosen) for job, chosen in group if not job.cancelled]
        if not group:
            return
        jobs, chosen = [job for job, _ in group], group[0][1]
        try:
            ready = prepare(self.served.model, self._prompt(jobs), chosen.make, chosen.draft)
            caches = [ready.cache] if len(jobs) == 1 else split_rows(ready.cache, chosen.make)
        except KvtoolError as exc:
            for job in jobs:
                self._leave(job, "failed", str(exc))
            return
        except Exception as exc:  # a request must never take the server down
            log.exception("prompt phase failed")
            for job in jobs:
                self._leave(job, "failed", f"internal error in the prompt phase: {type(exc).__name__}: {exc}")
            return
        first, prefix = ready.first_logits, ready.prefix
        del ready  # a split batch's own cache goes now: each request holds its row
        for job in jobs:
            self.ledger.started(job.key)
        for row, (job, cache) in enumerate(zip(jobs, caches)):
            try:
                job.cache = cache
                mine = None if prefix is None else Verified(prefix.tokens[row : row + 1], prefix.lengths[row : row + 1])
                job.picker = Picker(job.temperature, job.top_p, job.seed, mine)
                job.text = StopText(self.served.decode, job.stops)
                self._running.append(job)
                self.peak_rows = max(self.peak_rows, len(self._running))
                self._advance(job, first[row])
            except Exception as exc:
                log.exception("first token failed")
                self._leave(job, "failed", f"internal error after the prompt phase: {type(exc).__name__}: {exc}")

    def _prompt(self, jobs: list[Job]) -> Prompt:
        """The jobs' prompts as one left-padded batch (one row: the prompt as it is)."""
        pad = self.served.tokenizer.pad_token_id
        batch = left_pad([job.ids for job in jobs], tuple(range(len(jobs))), 0 if pad is None else pad)
        device = self.served.model.device
        return Prompt.of({"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device)})

    def _step(self) -> None:
        running = [j for j in self._running if not j.cancelled]
        if not running:
            self._drop_cancelled()
            return
        try:
            logits = decode_step(
                self.served.model, [j.cache for j in running], [j.generated[-1] for j in running],
                [len(j.ids) + len(j.generated) - 1 for j in running],
            )
        except Exception as exc:
            log.exception("decode step failed")
            for job in running:
                self._leave(job, "failed", f"internal error in a decode step: {type(exc).__name__}: {exc}")
            return
        for row, job in enumerate(running):
            self._advance(job, logits[row])
        self.held_bytes = sum(kv_bytes(j.cache) for j in self._running)

    def _advance(self, job: Job, logits: torch.Tensor) -> None:
        """Pick the job's next token from `logits`, hand out its text, and finish it if it is done."""
        token = job.picker.pick(len(job.generated), logits)
        job.generated.append(token)
        piece = job.text.add(job.generated)
        if piece:
            job.emit("text", piece)
        if job.text.stopped or token in self.served.eos:
            job.finish = "stop"
        elif len(job.generated) >= job.max_tokens:
            job.finish = "length"
        if job.finish is not None:
            rest = job.text.flush()
            if rest:
                job.emit("text", rest)
            self._leave(job, "completed")

    def _leave(self, job: Job, outcome: str, message: str | None = None) -> None:
        if job in self._running:
            self._running.remove(job)
        if outcome == "completed":
            job.emit("done", {
                "finish_reason": job.finish,
                "prompt_tokens": len(job.ids),
                "completion_tokens": len(job.generated),
                "total_tokens": len(job.ids) + len(job.generated),
                "kv_bytes": kv_bytes(job.cache),
                "kv_bytes_full": kv_bytes_full(job.cache),
            })
        elif outcome == "failed":
            job.emit("error", message)
        job.cache = None
        self.ledger.release(job.key)
        with self._wake:
            self.counts[outcome] += 1
