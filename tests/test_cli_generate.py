"""`kvtool generate`: the runtime generate() + KV accounting, and the CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtool.models import load_model
from kvtool.runtime.generate import _until_eos, generate
from kvtool.runtime.memory import kv_bytes, kv_bytes_full

JSON_KEYS = {"outputs", "kv_bytes", "kv_bytes_full", "prompt_tokens", "new_tokens", "prefill_s", "decode_tok_s", "model"}


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from kvtool.cli.app import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    return load_model(str(tiny_llama_dir))


def plain_kv_bytes(config, batch: int, tokens: int, element_size: int = 4) -> int:
    """Keys + values of a plain cache: layers * 2 * batch * kv_heads * tokens * head_dim * bytes."""
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * batch * config.num_key_value_heads * tokens * head_dim * element_size


# --- runtime -------------------------------------------------------------------------------


def test_generate_reports_tokens_timing_and_cache_bytes(tiny) -> None:
    result = generate(tiny.model, tiny.tokenizer, ["hi", "tell me a story"], max_new_tokens=5)
    assert len(result.outputs) == 2 and all(isinstance(o, str) for o in result.outputs)
    # "<s> User : hi \n Assistant :" -> 6 tokens; the longer prompt has 3 more words.
    assert result.prompt_tokens == [6, 9]
    assert all(1 <= n <= 5 for n in result.new_tokens)
    assert result.prefill_s > 0 and result.total_s >= result.prefill_s
    # The cache holds the padded prompt plus every generated token but the last one.
    cached_tokens = max(result.prompt_tokens) + max(result.new_tokens) - 1
    assert result.kv_bytes == plain_kv_bytes(tiny.model.config, 2, cached_tokens)
    assert result.kv_bytes_full == result.kv_bytes


def test_greedy_is_deterministic_and_one_token_has_no_decode_rate(tiny) -> None:
    first = generate(tiny.model, tiny.tokenizer, ["hi"], max_new_tokens=1)
    again = generate(tiny.model, tiny.tokenizer, ["hi"], max_new_tokens=1)
    assert first.outputs == again.outputs
    assert first.new_tokens == [1]
    assert first.decode_tok_s == 0.0


def test_sampling_is_reproducible_with_a_seed(tiny) -> None:
    runs = [
        generate(tiny.model, tiny.tokenizer, ["hi", "the cat"], max_new_tokens=6, temperature=1.5, seed=7).outputs
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_cache_factory_supplies_the_cache(tiny) -> None:
    from transformers import DynamicCache

    made = []

    def factory():
        made.append(DynamicCache(config=tiny.model.config))
        return made[-1]

    result = generate(tiny.model, tiny.tokenizer, ["hi"], max_new_tokens=3, cache_factory=factory)
    assert len(made) == 1
    assert result.kv_bytes == kv_bytes(made[0]) > 0


def test_generated_tokens_count_up_to_and_including_eos() -> None:
    assert _until_eos([5, 6, 2, 2, 2], {2}) == [5, 6, 2]
    assert _until_eos([5, 6, 7], {2}) == [5, 6, 7]
    assert _until_eos([9, 5], {2, 9}) == [9]


def test_kv_bytes_prefers_the_layers_own_accounting() -> None:
    plain = SimpleNamespace(keys=torch.zeros(1, 2, 3, 4), values=torch.zeros(1, 2, 3, 4))  # 24 floats each
    empty = SimpleNamespace(keys=None, values=None)
    compressing = SimpleNamespace(physical_bytes=lambda: 100, full_bytes=lambda: 1000)
    cache = SimpleNamespace(layers=[plain, empty, compressing])
    assert kv_bytes(cache) == 2 * 24 * 4 + 0 + 100
    assert kv_bytes_full(cache) == 2 * 24 * 4 + 0 + 1000


# --- CLI -----------------------------------------------------------------------------------


def test_cli_json_on_a_model_directory(tiny_llama_dir: Path) -> None:
    done = run_cli("generate", str(tiny_llama_dir), "hi", "the cat sat", "--max-new-tokens", "3", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)  # the whole of stdout is one JSON object
    assert JSON_KEYS <= payload.keys()
    assert payload["model"] == str(tiny_llama_dir)
    assert len(payload["outputs"]) == len(payload["new_tokens"]) == len(payload["prompt_tokens"]) == 2


def test_cli_human_output(tiny_llama_dir: Path) -> None:
    done = run_cli("generate", str(tiny_llama_dir), "the [bold]cat", "--max-new-tokens", "2")
    assert done.returncode == 0, done.stderr
    assert "the [bold]cat" in done.stdout  # user text is printed literally, not as rich markup
    for label in ("prompt tokens", "new tokens", "prefill", "decode", "KV cache", "full cache"):
        assert label in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "smollm2", "hi", "  "], "error: prompt 2 is empty"),
        (["generate", "no-such-model", "hi"], "error: model 'no-such-model' is not a known alias"),
        (["generate", "missing/model.gguf", "hi"], "error: model file missing/model.gguf does not exist"),
    ],
)
def test_cli_bad_input_is_one_line_on_stderr(args: list[str], message: str) -> None:
    done = run_cli(*args)
    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.startswith(message)
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_cli_end_to_end_on_smollm2(smollm2: str) -> None:
    done = run_cli("generate", smollm2, "Hi", "Tell me a story", "--max-new-tokens", "4", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert JSON_KEYS <= payload.keys()
    assert payload["model"] == "smollm2"
    assert len(payload["outputs"]) == 2 and all(isinstance(o, str) for o in payload["outputs"])
    assert all(isinstance(n, int) and n > 0 for n in payload["prompt_tokens"])
    assert payload["prompt_tokens"][1] > payload["prompt_tokens"][0]
    assert all(isinstance(n, int) and 1 <= n <= 4 for n in payload["new_tokens"])
    assert isinstance(payload["prefill_s"], float) and payload["prefill_s"] > 0
    assert isinstance(payload["decode_tok_s"], float)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, float32, plain cache.
    cached_tokens = max(payload["prompt_tokens"]) + max(payload["new_tokens"]) - 1
    assert payload["kv_bytes"] == 30 * 2 * 2 * 3 * cached_tokens * 64 * 4
    assert payload["kv_bytes"] == payload["kv_bytes_full"]
