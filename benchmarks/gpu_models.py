"""The models and recipes of benchmarks/gpu_bench.py: random-weight models of real shapes, the shipped recipe's rules.

`build_model(shape, device)` makes a model of one of `SHAPES` (Llama-3.1-8B, Gemma-3-12B, SmolLM2-135M
and two tiny CPU smoke shapes) with random weights: the timings and memory of a real shape without its
download. `recipe_method()` is the shipped recipe's method, which the kvtool cells apply at one ratio in
every layer (`without_draft` and `jacobi_rounds` give its variants).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvtool.models import use_offline_defaults

use_offline_defaults()  # before transformers is imported: it reads them once

from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtool.profiles import read_profile  # noqa: E402
from kvtool.profiles.builtin import builtin_profile  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B: 32 layers, 32 query / 8 KV heads of dim 128.
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=5e5, max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    # SmolLM2-135M (the embedded default model), for the CPU's picture of `--parts`.
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # Gemma-3-12B: a hybrid, 5 sliding-window layers (window 1024) to each global one, 16 query / 8 KV
    # heads of dim 256; kvtool's uniform profile gives each sliding layer a window of the budget's share.
    "gemma3-12b": dict(
        family="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        max_position_embeddings=131072, rms_norm_eps=1e-6,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
    ),
    # A CPU smoke run of the hybrid path.
    "tiny-gemma3": dict(
        family="gemma3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64, max_position_embeddings=8192,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    # A CPU smoke run of the script itself.
    "tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    ),
}
RECIPE = ("smollm2", 0.2)  # the shipped recipe whose rules the kvtool cells apply uniformly


def build_model(shape: str, device: torch.device) -> LlamaForCausalLM:
    """A random-weight LlamaForCausalLM of `shape`, made on `device` (bf16 on a GPU, float32 on a CPU), sdpa attention."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fields = dict(SHAPES[shape])
    family = fields.pop("family", "llama")
    config_cls, model_cls = (Gemma3TextConfig, Gemma3ForCausalLM) if family == "gemma3" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def recipe_method():
    """The shipped recipe's rules (the kvtool cells apply them at one ratio in every layer, as
    benchmarks/cuda_check.py does: a random-weight model has no calibrated per-layer ratios)."""
    return read_profile(builtin_profile(*RECIPE)).method


def without_draft(method):
    return dataclasses.replace(method, draft=None)


def jacobi_rounds(method):
    """`method` with its draft's later rounds taken from the last one's predictions (`Draft.jacobi`)."""
    draft = method.draft
    return method if draft is None else dataclasses.replace(method, draft=dataclasses.replace(draft, jacobi=True))
