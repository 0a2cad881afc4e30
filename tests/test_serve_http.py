"""`kvtool serve` over HTTP on loopback: the real `openai` client, bad requests, load, disconnects."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import torch
import uvicorn

from kvtool.serve import Ledger, Scheduler, ServedModel, build_app
from kvtool.serve import scheduler as scheduler_module
from test_serve_helpers import WORDS, tiny_loaded
from tiny_models import profile_with


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(kv_memory: int | None = None, max_batch: int = 16, budget: float = 0.5):
    """A server on a tiny random Llama at `budget`, on loopback in a thread; yields (base url, scheduler)."""
    loaded = tiny_loaded()
    served = ServedModel(loaded, profile_with(loaded.model, budget), f"uniform budget {budget}")
    scheduler = Scheduler(served, Ledger(kv_memory, max_batch))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(scheduler), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):  # bounded: up to 10 s
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        time.sleep(0.05)
    try:
        yield url, scheduler
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server():
    with serving() as running:
        yield running


def prompt(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i * 7) % len(WORDS)] for i in range(words))


def test_the_openai_client_works_unchanged(server) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt(30)}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 30
    assert 0 < chat.usage.kv_bytes < chat.usage.kv_bytes_full  # a 30-word prompt at budget 0.5 is compressed

    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt(30)}],
                                                max_tokens=8, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish, usage = chunk.choices[0].finish_reason, chunk.usage
    assert "".join(pieces) == chat.choices[0].message.content  # streamed or not, greedy is greedy
    assert finish == chat.choices[0].finish_reason and usage.kv_bytes == chat.usage.kv_bytes

    text = client.completions.create(model="tiny", prompt=prompt(20), max_tokens=5, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt(20), max_tokens=5, temperature=0, stream=True))
    assert text.choices[0].text == streamed and text.usage.kv_bytes_full > 0

    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_bad_requests_get_one_line_4xx_and_the_server_keeps_serving(server) -> None:
    url, _ = server
    chat = f"{url}/v1/chat/completions"
    good = {"model": "tiny", "messages": [{"role": "user", "content": prompt(10)}], "max_tokens": 2}
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({**good, "logprobs": True}).encode(), 400, "unknown field"),
        (json.dumps({**good, "n": 2}).encode(), 400, "n must be 1"),
        (json.dumps({**good, "model": "other"}).encode(), 404, "not served here"),
        (json.dumps({**good, "messages": [{"role": "user", "content": prompt(300)}]}).encode(), 400, "context"),
        (json.dumps({**good, "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({**good, "messages": []}).encode(), 400, "messages"),
        (json.dumps({"model": "tiny", "prompt": [10**6]}).encode(), 400, "token ids"),
    ]
    for body, status, words in cases:
        response = httpx.post(chat if b"prompt" not in body else f"{url}/v1/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=30)
        message = response.json()["error"]["message"]
        assert response.status_code == status and words in message, (body, response.text)
        assert "\n" not in message and "Traceback" not in message
    assert httpx.post(chat, json=good, timeout=30).status_code == 200
    assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"


def test_200_requests_from_32_clients_are_answered_or_refused_at_once() -> None:
    loaded = tiny_loaded()
    need = ServedModel(loaded, None).projected_bytes(20, 3)  # about one request's reservation, full cache
    with serving(kv_memory=6 * need) as (url, scheduler):
        local = threading.local()  # one keep-alive connection per client

        def one(i: int) -> tuple[int, str | None, dict]:
            if not hasattr(local, "client"):
                local.client = httpx.Client(timeout=60)
            body = {"model": "tiny", "prompt": prompt(4 + i % 9, i), "max_tokens": 3, "temperature": 0}
            response = local.client.post(f"{url}/v1/completions", json=body)
            return response.status_code, response.headers.get("retry-after"), response.json()

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(200)))
        answered = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(answered) + len(refused) == 200, {r[0] for r in results}
        assert answered and refused  # memory filled up, and requests still got through
        assert all(r[1] is not None and int(r[1]) >= 1 for r in refused)
        assert all(r[2]["choices"][0]["finish_reason"] in ("length", "stop") for r in answered)
        status = httpx.get(f"{url}/health", timeout=5).json()
        assert status["completed"] == len(answered) and status["refused"] == len(refused)
        assert status["running"] == status["waiting"] == status["kv_reserved"] == 0  # nothing held on to
        assert status["peak_running"] >= 2


def test_a_client_that_disconnects_mid_stream_frees_its_rows(monkeypatch) -> None:
    steps: list[int] = []
    step = scheduler_module.decode_step

    def slow_step(*args):
        steps.append(len(args[1]))
        time.sleep(0.02)  # long enough that the reply is far from done when the client leaves
        return step(*args)

    monkeypatch.setattr(scheduler_module, "decode_step", slow_step)
    with serving() as (url, scheduler):
        body = {"model": "tiny", "prompt": prompt(20), "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data:")
                if chunks == 3:
                    break
        closed_at = len(steps)
        for _ in range(200):  # bounded: up to 10 s
            status = httpx.get(f"{url}/health", timeout=5).json()
            if status["running"] == 0:
                break
            time.sleep(0.05)
        assert status["running"] == 0 and status["kv_reserved"] == 0
        assert status["cancelled"] == 1 and status["completed"] == 0
        assert len(steps) - closed_at <= 3  # gone within a step or so of the next token
        assert len(steps) < 100


def test_a_request_whose_prompt_phase_cannot_fit_gets_a_400_that_says_so() -> None:
    """--kv-memory bounds the prompt phase too: a request whose cache fits but whose prompt phase
    (its whole prompt for one layer at a time) does not is refused with one line; at its size it runs."""
    loaded = tiny_loaded()
    served = ServedModel(loaded, profile_with(loaded.model, 0.5), "test")
    ids = [int(t) for t in torch.randint(5, 60, (80,), generator=torch.Generator().manual_seed(0))]
    need, held = served.projected_bytes(len(ids), 3), served.prompt_bytes(len(ids), 3)
    served.close()
    assert held > 0
    body = {"model": "tiny", "prompt": ids, "max_tokens": 3, "temperature": 0}
    with serving(kv_memory=need + held - 1) as (url, _):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and "while its prompt is processed" in message and "\n" not in message
    with serving(kv_memory=need + held) as (url, _):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
