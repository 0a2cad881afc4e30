"""The HTTP face: OpenAI's `/v1/chat/completions` and `/v1/completions` (streamed as server-sent
events or not), `/v1/models` and `/health`, on FastAPI.

A route checks the request (one-line 4xx for anything wrong: bad JSON, unknown fields, a prompt
over the model's context, another model's name, n > 1), asks the scheduler for a place (429 with
Retry-After when the KV memory or the batch is full, 503 while the server shuts down) and relays the
scheduler's events. A client that goes away cancels its request; the scheduler drops its rows
before its next step. Each reply's `usage` adds `kv_bytes` (what its cache held at the end) and
`kv_bytes_full` (what the full cache would hold for the same tokens) to OpenAI's token counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvtool.errors import KvtoolError
from kvtool.serve.schema import DEFAULT_MAX_TOKENS, ChatRequest, CompletionRequest, one_line
from kvtool.serve.scheduler import Job, Scheduler
from kvtool.units import human_bytes

# Seconds a refused client is told to wait: about one reply's worth of decode steps on a CPU.
RETRY_AFTER_S = 1
# How often a waiting non-streamed reply checks that its client is still there.
DISCONNECT_POLL_S = 0.25


def error(status: int, message: str, code: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    """OpenAI's error body with a one-line message."""
    body = {"error": {"message": message, "type": code, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(scheduler: Scheduler) -> FastAPI:
    served = scheduler.served

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Shutdown (SIGTERM): uvicorn has let the in-flight replies finish; the thread ends with them.
        await asyncio.to_thread(scheduler.stop)
        served.close()

    app = FastAPI(title="kvtool serve", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "stopping" if scheduler.stopping else "ok", "model": served.name, "cache": served.cache_note,
                **scheduler.status()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "kvtool"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(request, ChatRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, CompletionRequest, "text")

    async def _complete(request: Request, schema: type, kind: str):
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(data, dict):
            return error(400, "the request body must be a JSON object")
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            return error(400, one_line(exc))
        if body.model != served.name:
            return error(404, f"model {body.model!r} is not served here; this server serves {served.name!r}", "model_not_found")
        try:
            if kind == "chat":
                ids = served.chat_ids([m.model_dump(exclude_none=True) for m in body.messages])
            else:
                ids = list(body.prompt) if isinstance(body.prompt, list) else served.text_ids(body.prompt)
            limit = body.limit
            if limit is None:
                room = served.context - len(ids) if served.context else DEFAULT_MAX_TOKENS
                limit = max(1, min(DEFAULT_MAX_TOKENS, room))
            served.check_ids(ids, limit)
        except KvtoolError as exc:
            return error(400, str(exc))
        job = Job(ids=ids, max_tokens=limit, temperature=body.temperature, top_p=body.top_p, seed=body.seed, stops=body.stops)
        need, prompt = scheduler.needs(job)
        capacity = scheduler.ledger.capacity
        if capacity is not None and need + prompt > capacity:
            during = f" ({human_bytes(need + prompt)} while its prompt is processed)" if prompt else ""
            return error(400, f"this request needs {human_bytes(need)} of KV memory{during}, more than the server's "
                              f"--kv-memory of {human_bytes(capacity)}: shorten the prompt or max_tokens")
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(kind_: str, payload: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, (kind_, payload))

        job.emit = emit
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if scheduler.stopping:
            return error(503, "the server is shutting down", "unavailable", retry)
        if not scheduler.submit(job):
            status = scheduler.status()
            return error(429, f"KV memory full ({human_bytes(status['kv_reserved'])} reserved by {status['running'] + status['waiting']} "
                              f"requests); retry after {RETRY_AFTER_S} s", "rate_limit_exceeded", retry)
        reply = Reply(kind, served.name)
        if body.stream:
            return StreamingResponse(_streamed(job, events, reply), media_type="text/event-stream")
        return await _whole(request, job, events, reply)

    return app


class Reply:
    """One reply's OpenAI objects, whole or as chunks."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _choice(self, text: str | None, finish: str | None, whole: bool) -> dict[str, Any]:
        if self.kind == "text":
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    def whole(self, text: str, usage: dict[str, Any]) -> dict[str, Any]:
        usage = dict(usage)
        finish = usage.pop("finish_reason")
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [self._choice(text, finish, True)], "usage": usage}

    def chunk(self, text: str | None, finish: str | None = None, usage: dict | None = None, role: bool = False) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choice = self._choice(text, finish, False)
        if role:
            choice["delta"] = {"role": "assistant", "content": ""}
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _whole(request: Request, job: Job, events: asyncio.Queue, reply: Reply):
    pieces: list[str] = []
    while True:
        try:
            kind, payload = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return error(499, "client closed the request")
            continue
        if kind == "text":
            pieces.append(payload)
        elif kind == "error":
            return error(500, payload, "server_error")
        else:
            return reply.whole("".join(pieces), payload)


async def _streamed(job: Job, events: asyncio.Queue, reply: Reply):
    finished = False
    try:
        if reply.kind == "chat":
            yield reply.chunk(None, role=True)
        while True:
            kind, payload = await events.get()
            if kind == "text":
                yield reply.chunk(payload)
            elif kind == "error":
                finished = True
                yield f"data: {json.dumps({'error': {'message': payload, 'type': 'server_error'}})}\n\n"
                return
            else:
                usage = dict(payload)
                finish = usage.pop("finish_reason")
                finished = True
                yield reply.chunk(None, finish, usage)
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:
            job.cancel()  # the client went away mid-reply: its rows go before the next step
