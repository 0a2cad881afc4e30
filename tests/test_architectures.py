"""Other architectures: each compresses exactly (budget 1.0 is the model, a padded batch is its rows
alone, every layer holds its share). Families with their own attention math or cache structure have
their own files (test_family_attention.py: Gemma 2, gpt-oss; test_family_mla.py; test_family_hybrid.py:
linear-attention and Mamba hybrids, Llama 4; test_family_vlm.py), and test_auto_families.py walks every
auto-mapped architecture, each compressing exactly or refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from kvtool.models.forward import with_cache
from kvtool.runtime import attach, uniform_profile
from tiny_models import GREEDY, VOCAB, left_pad, prompts

NEW = 16
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def build(config_cls, model_cls, attn="sdpa", **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).to(torch.float64).eval()
    model.set_attn_implementation(attn)
    return model


def qwen3():  # QK-norm, full attention
    return build(tf.Qwen3Config, tf.Qwen3ForCausalLM, head_dim=16)


def phi3():  # fused qkv projection, full attention
    return build(tf.Phi3Config, tf.Phi3ForCausalLM)


def mistral():  # a sliding window on every layer
    return build(tf.MistralConfig, tf.MistralForCausalLM, sliding_window=12)


@pytest.mark.parametrize("make", [qwen3, phi3, mistral], ids=["qwen3", "phi3", "mistral"])
def test_compresses_exactly(make):
    model = make()
    inputs = left_pad(prompts([40, 23, 31]))
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
        with attach(model, uniform_profile(model, 1.0)) as handle:
            out = model.generate(**inputs, max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
        assert torch.equal(ref.sequences, out.sequences)
        assert max((a - b).abs().max().item() for a, b in zip(ref.scores, out.scores)) < 1e-9
        seqs = prompts([41, 17, 30])
        with attach(model, uniform_profile(model, 0.4)) as handle:
            cache = handle.new_cache()
            batch = model.generate(**left_pad(seqs), max_new_tokens=NEW, **with_cache(model, cache), **GREEDY)
            for layer in cache.compressing_layers().values():
                assert np.array_equal(layer.kept, layer.plan.keep(layer.tokens))
            for i, seq in enumerate(seqs):
                single = model.generate(**left_pad([seq]), max_new_tokens=NEW, **with_cache(model, handle.new_cache()), **GREEDY)
                alone = single.sequences[0, len(seq):]
                assert torch.equal(alone, batch.sequences[i, -NEW:][: len(alone)]), f"sequence {i}"
