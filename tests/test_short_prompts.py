"""A prompt too short for compression to save memory runs through a plain full cache: no scoring, no draft.

Short means the longest row's whole KV cache is under `SHORT_PROMPT_SHARE` of the weights' bytes
(runtime.memory). Such a generation is then exactly the unmodified model's, and holds exactly the
full cache's memory.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import DynamicCache

from kvtool.models.forward import with_cache
from kvtool.profiles import Draft
from kvtool.runtime import attach, memory
from test_cli_generate import run_cli
from tiny_models import profile_with, tiny_llama


def test_the_threshold_is_the_kv_of_the_longest_row_against_the_weights():
    model = tiny_llama()
    size = model.dtype.itemsize
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * model.config.head_dim * size
    assert memory.kv_bytes_per_token(model) == per_token
    weights = sum(p.numel() * size for p in model.parameters())
    longest_short = -(-int(memory.SHORT_PROMPT_SHARE * weights) // per_token) - 1  # the longest row still short
    mask = torch.zeros(2, longest_short + 1, dtype=torch.long)
    mask[0, 1:] = 1  # longest_short tokens, left-padded
    mask[1, -3:] = 1
    assert memory.too_short_to_compress(model, mask)
    mask[0, 0] = 1  # one token more in the longest row
    assert not memory.too_short_to_compress(model, mask)


def test_a_short_prompt_generates_exactly_what_the_full_cache_generates(monkeypatch):
    model = tiny_llama()
    profile = profile_with(model, 0.3, heads="per-head", scorer="window", window=2, pool=1, eviction="tova",
                           sink_tokens=0, recent_window=1)
    profile = dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=Draft(3, 2, True)))
    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs["attention_mask"][1, :4] = 0
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        full = model.generate(**inputs, **with_cache(model, DynamicCache(config=model.config)), **kwargs)
        with attach(model, profile) as handle:
            compressed = handle.generate(**inputs, **kwargs)
            monkeypatch.setattr(memory, "SHORT_PROMPT_SHARE", 1e9)  # every prompt is short now
            short = handle.generate(**inputs, **kwargs)
    assert torch.equal(short, full)
    assert not torch.equal(compressed, full)  # at the default threshold this prompt is compressed


@pytest.mark.slow
def test_a_short_chat_on_smollm2_holds_the_full_cache_and_says_so(smollm2: str) -> None:
    done = run_cli("generate", smollm2, "Name three colours.", "--budget", "0.2", "--max-new-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["compressed"] is False and "too short" in payload["cache"]
    assert payload["kv_bytes"] == payload["kv_bytes_full"]
