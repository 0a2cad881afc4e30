"""Other architectures: each compresses exactly (budget 1.0 is the model, a padded batch is its rows
alone, every layer holds its share) or refuses in one line that names what kvtool does not support."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from kvtool.errors import KvtoolError
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


def llama4():  # chunked attention layers
    return build(tf.Llama4TextConfig, tf.Llama4ForCausalLM, attention_chunk_size=8, intermediate_size_mlp=128,
                 num_local_experts=1, head_dim=16)


def gpt_oss():  # learned attention sinks, 128-token windows
    return build(tf.GptOssConfig, tf.GptOssForCausalLM, attn="eager", head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                 sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def gemma2():  # logit soft-capping
    return build(tf.Gemma2Config, tf.Gemma2ForCausalLM, attn="eager", head_dim=16, sliding_window=8)


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


@pytest.mark.parametrize(
    "make,named",
    [(llama4, "chunked_attention"), (gpt_oss, "attention sinks"), (gemma2, "soft-capping")],
    ids=["llama4", "gpt-oss", "gemma2"],
)
def test_refuses_in_one_line(make, named):
    model = make()
    profile = uniform_profile(model, 1.0) if named != "chunked_attention" else None
    with pytest.raises(KvtoolError) as err:
        attach(model, profile or uniform_profile(model, 1.0))
    assert named in str(err.value) and "\n" not in str(err.value)
