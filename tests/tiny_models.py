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
