"""`kvtool serve` as a command: one-line errors before the model loads, and SIGTERM lets the
requests in flight finish before the process exits (a real subprocess on loopback)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cli_runner import run
from conftest import make_word_tokenizer
from kvtool.profiles import save_profile
from test_serve_http import free_port, prompt
from tiny_models import profile_with


def test_a_bad_kv_memory_or_budget_is_one_line_before_the_model_loads(monkeypatch, capsys) -> None:
    code, _, err = run(monkeypatch, capsys, "serve", "no-such-model", "--kv-memory", "lots")
    assert code == 2 and err.strip().startswith("error: --kv-memory: cannot read 'lots'") and len(err.strip().splitlines()) == 1
    code, _, err = run(monkeypatch, capsys, "serve", "no-such-model", "--budget", "1.5")
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1
    code, _, err = run(monkeypatch, capsys, "serve", "no-such-model", "--budget", "0.2", "--kv-format", "int3")
    assert code == 2 and err.startswith("error: --kv-format takes") and len(err.strip().splitlines()) == 1
    code, _, err = run(monkeypatch, capsys, "serve", "no-such-model", "--kv-format", "int8")
    assert code == 2 and "--kv-format needs --budget or --profile" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(monkeypatch, capsys, "serve", "no-such-model", "--min-kept", "-1")
    assert code == 2 and "Invalid value for '--min-kept'" in err  # the option parser's own usage error


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> tuple[Path, Path]:
    """A random Llama a little larger than the others (so a 150-token reply takes a while) and a
    budget-0.5 profile for it."""
    tokenizer = make_word_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    directory = tmp_path_factory.mktemp("serve-llama")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    profile = save_profile(profile_with(model, 0.5), directory / "profile.yaml")
    return directory, profile


def _stream(url: str, words: int, out: dict, first: threading.Event) -> None:
    body = {"prompt": prompt(words), "max_tokens": 150, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client:
        body["model"] = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                out.setdefault("lines", []).append((time.monotonic(), line[5:].strip()))
                first.set()


def test_sigterm_finishes_the_requests_in_flight_then_exits(model_dir) -> None:
    directory, profile = model_dir
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from kvtool.cli.app import main; main()", "serve", str(directory),
         "--profile", str(profile), "--port", str(port), "--kv-memory", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # bounded: up to 60 s for the interpreter, torch and the model
            if process.poll() is not None:
                pytest.fail(f"the server exited: {process.communicate()[1][-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        replies = [{} for _ in range(2)]
        started = [threading.Event() for _ in replies]
        threads = [threading.Thread(target=_stream, args=(url, 20 + 5 * i, r, s)) for i, (r, s) in enumerate(zip(replies, started))]
        for thread in threads:
            thread.start()
        assert all(s.wait(60) for s in started)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    # uvicorn exits by the signal it caught (-15) once the replies are done; 0 where it does not re-raise.
    assert code in (0, -signal.SIGTERM), code
    for reply in replies:
        assert reply["status"] == 200
        lines = reply["lines"]
        assert lines[-1][1] == "[DONE]"
        last = json.loads(lines[-2][1])
        assert last["choices"][0]["finish_reason"] in ("length", "stop") and last["usage"]["completion_tokens"] >= 1
        assert any(at > signalled for at, _ in lines)  # it was still generating when the signal came
