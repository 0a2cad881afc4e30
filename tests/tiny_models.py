"""Tiny random models and batching helpers shared by the runtime tests (built offline)."""

from __future__ import annotations

import dataclasses

import torch
from transformers import Gemma3TextConfig, Gemma3ForCausalLM, LlamaConfig, LlamaForCausalLM

from kvtool.profiles import MethodSettings, Profile
from kvtool.runtime import uniform_profile

VOCAB = 97


def tiny_llama(dtype=torch.float64, layers: int = 3, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def tiny_gemma3(dtype=torch.float64, seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = Gemma3ForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def prompts(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


def left_pad(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def profile_with(model, ratios: list[float] | float, **method) -> "Profile":
    """A profile with given per-layer ratios (or one ratio) and method settings."""
    base = uniform_profile(model, 1.0, MethodSettings(**method))
    if isinstance(ratios, float):
        ratios = [ratios] * len(base.layers)
    layers = tuple(
        dataclasses.replace(layer, ratio=r if layer.compress else 1.0) for layer, r in zip(base.layers, ratios)
    )
    return dataclasses.replace(base, layers=layers, budget=sum(ratios) / len(ratios))


GREEDY = dict(do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)


# ----- other families' cache structures: latent attention, linear-attention and Mamba hybrids, chunked layers


def _tiny(config_cls, model_cls, dtype=torch.float64, seed: int = 0, **extra):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = model_cls(config_cls(**{**common, **extra})).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


def tiny_deepseek(version: int = 3, dtype=torch.float64, seed: int = 0):
    """DeepSeek-V2/V3 (Kimi K2 is V3's architecture): multi-head latent attention caching a 32-wide
    latent and an 8-wide rotary key per token; dense MLPs (the MoE kernels take no float64)."""
    import transformers as tf

    config_cls, model_cls = {2: (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
                             3: (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)}[version]
    return _tiny(config_cls, model_cls, dtype, seed, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4, head_dim=8, first_k_dense_replace=4)


def tiny_qwen3_next(dtype=torch.float64, seed: int = 0):
    """Qwen3-Next: gated delta-net linear-attention layers between gated full-attention ones; dense MLPs."""
    import transformers as tf

    return _tiny(tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dtype, seed, head_dim=16, linear_num_value_heads=4,
                 linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, mlp_only_layers=[0, 1, 2, 3],
                 layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def tiny_mamba_hybrid(name: str, dtype=torch.float64, seed: int = 0):
    """Mamba layers between attention ones: "jamba", "bamba", "granitemoehybrid" (Granite 4), "nemotron_h"."""
    import transformers as tf

    if name == "jamba":
        return _tiny(tf.JambaConfig, tf.JambaForCausalLM, dtype, seed, attn_layer_period=2, attn_layer_offset=1,
                     expert_layer_period=2, num_experts=1)
    if name == "bamba":
        return _tiny(tf.BambaConfig, tf.BambaForCausalLM, dtype, seed, attn_layer_indices=[1, 3], mamba_chunk_size=16)
    if name == "granitemoehybrid":
        return _tiny(tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM, dtype, seed,
                     layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8, mamba_d_head=16,
                     mamba_expand=2, mamba_d_state=8, mamba_n_groups=1, num_local_experts=0, shared_intermediate_size=32)
    if name == "nemotron_h":
        return _tiny(tf.NemotronHConfig, tf.NemotronHForCausalLM, dtype, seed,
                     layers_block_type=["mamba", "attention", "mlp", "attention"], mamba_num_heads=8, mamba_head_dim=16,
                     ssm_state_size=8, n_groups=1, chunk_size=16)
    raise ValueError(name)


def tiny_llama4(dtype=torch.float64, seed: int = 0):
    """Llama 4 text: three chunked-attention layers (chunks of 8) and a global NoPE layer."""
    import transformers as tf

    return _tiny(tf.Llama4TextConfig, tf.Llama4ForCausalLM, dtype, seed, attention_chunk_size=8,
                 intermediate_size_mlp=128, num_local_experts=1, head_dim=16)


def tiny_gemma2(dtype=torch.float32, seed: int = 0, softcap: float = 2.0, sharpen: float = 60.0):
    """Gemma 2: logit soft-capping (a small cap, and queries `sharpen`ed so most logits reach it),
    sliding-window layers of 8 between global ones. float32: its eager attention gives NaN for padded
    rows in float64 (its float mask's minimum overflows the float32 softmax), which kvtool matches."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=8, attn_logit_softcapping=softcap,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = Gemma2ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharpen)
    model.set_attn_implementation("eager")
    return model


def tiny_gpt_oss(dtype=torch.float32, seed: int = 0, sink_scale: float = 2.0):
    """gpt-oss: learned attention sinks (drawn at `sink_scale`, so they take a real share of each
    row), sliding-window layers of 8 between global ones, a two-expert MoE."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_local_experts=2, num_experts_per_tok=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = GptOssForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, sink_scale)
    model.set_attn_implementation("eager")
    return model


def calibration_run(model, budget: float, **settings):
    """`kvtool.calibrate` on a tiny model with the word tokenizer and four short word prompts, small
    settings (three samples, 6-token references, D in {0, 8}), no draft unless `settings` give one."""
    import random

    from conftest import make_word_tokenizer
    from kvtool.calibration.runner import calibrate
    from kvtool.data import Record
    from kvtool.models import LoadedModel, prepare_tokenizer

    words = "the cat dog sat on mat and it ran away to house big small red blue green one two three".split()
    rng = random.Random(0)
    records = [Record(prompt=" ".join(rng.choice(words) for _ in range(rng.randint(30, 50))), where=f"test {i + 1}")
               for i in range(4)]
    loaded = LoadedModel(model=model, tokenizer=prepare_tokenizer(make_word_tokenizer()), name="tiny", source="test")
    return calibrate(loaded, budget, data=records, **{"samples": 3, "reference_tokens": 6, "candidates": (0, 8),
                                                      "draft": None, **settings})
