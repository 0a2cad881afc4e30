"""Capacity of `kvtool serve`: the full cache against a compressed profile in the same KV memory.

Starts `kvtool serve MODEL --budget 1.0` and then `kvtool serve MODEL --budget B` (or `--profile P`),
each with the same `--kv-memory`, and sends `--requests` long prompts (`--prompt-tokens` ids, distinct
windows of the same English text, `kvtool.bench.prompts`) from `--clients` concurrent streaming
clients, `--new-tokens` each (greedy). A refused request (429) waits its Retry-After and tries again,
so every request is answered. Reports, per server: the most sequences it held at once (its
`/health` `peak_running`), requests per minute, time to first token (from the request's first
attempt, waits after refusals included) and per-token latency (the gaps between streamed tokens),
p50 and p99, and the KV bytes a reply kept; as a table, and as JSON with `--out`.

`--kv-memory` defaults to what `--full-seqs` (2) full-cache requests reserve (`serve.admission`):
the full cache then holds two sequences, and the profile as many as its smaller caches fit.

    .venv/bin/python benchmarks/serve_capacity.py smollm2 --budget 0.2 --prompt-tokens 4096 \\
        --new-tokens 256 --clients 16 --requests 32 --out serve-capacity.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package uses

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_kv_memory(loaded, prompt_tokens: int, new_tokens: int, sequences: int) -> int:
    """What `sequences` full-cache requests of this size reserve on the model."""
    from kvtool.serve import ServedModel

    served = ServedModel(loaded, None)
    try:
        return sequences * served.projected_bytes(prompt_tokens, new_tokens)
    finally:
        served.close()


class Server:
    """`kvtool serve` in a subprocess on a free loopback port (stopped with SIGTERM)."""

    def __init__(self, model: str, cache: list[str], kv_memory: int, max_batch: int):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-c", "from kvtool.cli.app import main; main()", "serve", model, *cache,
                   "--port", str(self.port), "--kv-memory", str(kv_memory), "--max-batch", str(max_batch)]
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 900) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited: {self.process.stderr.read()[-2000:]}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2).json()
                return health["model"]
            except httpx.TransportError:
                time.sleep(0.5)
        raise SystemExit("the server did not come up in time")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


def one_request(url: str, model: str, ids: list[int], new_tokens: int, deadline: float) -> dict:
    """One streamed request, retried after each 429 until `deadline`; its timings."""
    body = {"model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    first_attempt = time.monotonic()
    refusals = 0
    with httpx.Client(timeout=3600) as client:
        while time.monotonic() < deadline:
            with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code == 429:
                    refusals += 1
                    response.read()
                    time.sleep(float(response.headers.get("retry-after", 1)))
                    continue
                if response.status_code != 200:
                    return {"error": f"{response.status_code}: {response.read()[:200]!r}"}
                admitted = time.monotonic()
                stamps, usage = [], None
                for line in response.iter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk["choices"] and chunk["choices"][0].get("text"):
                        stamps.append(time.monotonic())
                end = time.monotonic()
                return {"first_attempt": first_attempt, "admitted": admitted, "stamps": stamps, "end": end,
                        "usage": usage, "refusals": refusals}
    return {"error": "deadline passed before the request was admitted", "refusals": refusals}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def load(server: Server, model: str, requests: list[list[int]], clients: int, new_tokens: int, limit_s: float) -> dict:
    deadline = time.monotonic() + limit_s
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda ids: one_request(server.url, model, ids, new_tokens, deadline), requests))
    wall = time.monotonic() - started
    done = [r for r in results if "error" not in r]
    ttft = [r["stamps"][0] - r["first_attempt"] for r in done if r["stamps"]]
    ttft_admitted = [r["stamps"][0] - r["admitted"] for r in done if r["stamps"]]
    gaps = [b - a for r in done for a, b in zip(r["stamps"], r["stamps"][1:])]
    health = server.health()
    kv = [r["usage"]["kv_bytes"] for r in done if r["usage"]]
    kv_full = [r["usage"]["kv_bytes_full"] for r in done if r["usage"]]
    tokens = sum(r["usage"]["completion_tokens"] for r in done if r["usage"])
    return {
        "requests": len(requests), "answered": len(done), "errors": [r["error"] for r in results if "error" in r],
        "refusals": sum(r.get("refusals", 0) for r in results),
        "concurrent_sequences": health["peak_running"],
        "wall_s": wall, "requests_per_min": 60 * len(done) / wall, "tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "ttft_after_admission_p50_s": percentile(ttft_admitted, 50),
        "token_latency_p50_s": percentile(gaps, 50), "token_latency_p99_s": percentile(gaps, 99),
        "kv_bytes_mean": statistics.fmean(kv) if kv else None,
        "kv_bytes_full_mean": statistics.fmean(kv_full) if kv_full else None,
        "cache": health["cache"],
    }


def table(rows: dict[str, dict]) -> str:
    def f(value, spec):
        return "—" if value is None else format(value, spec)

    lines = ["| server | sequences held | req/min | tok/s | TTFT p50 / p99 (s) | per-token p50 / p99 (ms) | KV kept | refusals |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        kept = r["kv_bytes_mean"] / r["kv_bytes_full_mean"] if r["kv_bytes_full_mean"] else None
        lines.append(
            f"| {name} | {r['concurrent_sequences']} | {f(r['requests_per_min'], '.2f')} | {f(r['tokens_per_s'], '.2f')} | "
            f"{f(r['ttft_p50_s'], '.2f')} / {f(r['ttft_p99_s'], '.2f')} | "
            f"{f(r['token_latency_p50_s'] and r['token_latency_p50_s'] * 1000, '.0f')} / "
            f"{f(r['token_latency_p99_s'] and r['token_latency_p99_s'] * 1000, '.0f')} | {f(kept, '.1%')} | {r['refusals']} |"
        )
    full = rows.get("full cache")
    for name, other in rows.items():
        if not full or other is full:
            continue

        def ratio(key, other=other):
            return other[key] / full[key] if full[key] and other[key] is not None else float("nan")
        lines.append("")
        lines.append(f"{name} / full: {ratio('concurrent_sequences'):.2f}x sequences, {ratio('requests_per_min'):.2f}x "
                     f"requests per minute, TTFT p50 {ratio('ttft_p50_s'):.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.2, help="the compressed server's budget")
    parser.add_argument("--profile", help="the compressed server's profile file (instead of --budget)")
    parser.add_argument("--also-profile", action="append", default=[], type=Path, metavar="PROFILE",
                        help="one more compressed server, with this profile (repeatable; a row named by the file)")
    parser.add_argument("--kv-format", help="the compressed server's storage of kept entries (kvtool serve --kv-format)")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32, help="requests sent to each server")
    parser.add_argument("--kv-memory", type=int, help="bytes (default: what --full-seqs full-cache requests reserve)")
    parser.add_argument("--full-seqs", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--limit-s", type=float, default=3600, help="give up on requests not admitted by then")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kvtool.bench.prompts import long_prompts
    from kvtool.models import load_model

    loaded = load_model(args.model)
    kv_memory = args.kv_memory or default_kv_memory(loaded, args.prompt_tokens, args.new_tokens, args.full_seqs)
    requests = long_prompts(loaded.tokenizer, args.prompt_tokens, args.requests).tolist()
    del loaded
    compressed = ["--profile", args.profile] if args.profile else ["--budget", str(args.budget)]
    if args.kv_format:
        compressed += ["--kv-format", args.kv_format]
    rows = {}
    arms = [("full cache", ["--budget", "1.0"]), ("compressed", compressed)]
    arms += [(path.stem, ["--profile", str(path)]) for path in args.also_profile]
    for name, cache in arms:
        server = Server(args.model, cache, kv_memory, args.max_batch)
        try:
            served_name = server.wait_ready()
            print(f"{name}: {' '.join(cache)}, --kv-memory {kv_memory} ...", file=sys.stderr, flush=True)
            rows[name] = load(server, served_name, requests, args.clients, args.new_tokens, args.limit_s)
        finally:
            server.stop()
    settings = {key: ([str(v) for v in value] if isinstance(value, list) else str(value) if isinstance(value, Path) else value)
                for key, value in vars(args).items()}
    result = {"settings": {**settings, "kv_memory": kv_memory}, "servers": rows}
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
