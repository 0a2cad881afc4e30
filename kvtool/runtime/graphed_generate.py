"""transformers' `generate` with its decode steps through `Decoder`: on a GPU, one CUDA graph replayed.

`model.generate` runs one eager forward per new token, and a kvtool cache's eager step on a GPU is
launch-bound: 0.48x the full cache's decode at Llama-3.1-8B's shape, against 1.70x replayed as a graph
(`benchmarks/gpu_bench.py --shape llama3-8b --shapes 8192x4` on an H100). `generate` hands its
decoding loop to a callable (`custom_generate`, called once its own argument handling, logits
processors and stopping criteria are done); `loop_for`
gives that callable where it applies, and `_decode` is the loop: greedy search and sampling, with
transformers' processors, stopping criteria and padding after EOS, one `Decoder` step per token. It
chooses each token as transformers' own loop does, so the sequences are the same; the tests check it
with fixed slots on a CPU (`RuntimeSettings.generate_loop`), benchmarks/cuda_check.py with the graph
on a GPU.

It applies to a kvtool cache whose every layer compresses, on a CUDA device, for text inputs, when
nothing asks for what only transformers' loop returns (scores, attentions, hidden states, a streamer)
or another decoding mode (beams, an assistant). Everything else runs transformers' loop unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from transformers.generation.configuration_utils import GenerationMode

from kvtool.models.loader import is_vision_language
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.graphed import Decoder
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.settings import current_settings
from kvtool.runtime.steps import Prompt, prompt_forward

_OUTPUTS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions", "output_hidden_states")
_NEEDS_OWN_LOOP = ("streamer", "assistant_model", "synced_gpus", "negative_prompt_ids", "prefix_allowed_tokens_fn")


def loop_for(model: Any, cache: Any, inputs: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The `custom_generate` keyword for `model.generate(**inputs, cache, **kwargs)` where the graphed
    loop applies, else nothing (transformers' own loop)."""
    loop = current_settings().generate_loop  # "auto", "fixed" (the tests' CPU stand-in for the graph) or "off"
    mode = "fixed" if loop == "fixed" else "graph"
    if loop == "off" or (loop == "auto" and model.device.type != "cuda"):
        return {}
    if type(cache) is not KvtoolCache or not all(isinstance(layer, CompressingLayer) for layer in cache.layers):
        return {}
    if loop == "auto" and any(layer.storage.quantized for layer in cache.layers):
        # The fixed-slot step reads quantized slots (tested on the CPU, in Triton's interpreter), but the
        # captured graph over them has not run on a GPU yet: quantized layers decode eagerly there until it has.
        return {}
    if set(inputs) - {"input_ids", "attention_mask"} or any(kwargs.get(key) for key in _NEEDS_OWN_LOOP):
        return {}
    if is_vision_language(model.config):  # positions of its own (multimodal rope) after an image
        return {}
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{key: value for key, value in kwargs.items() if hasattr(config, key)})
    if any(getattr(config, key, False) for key in _OUTPUTS):
        return {}
    if config.get_generation_mode() not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return {}

    def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        return _decode(model, cache, mode, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)

    return {"custom_generate": custom_generate}


def _decode(model, cache, mode, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """transformers' greedy / sampling loop (`GenerationMixin._sample`), its forwards `Decoder` steps."""
    mask = model_kwargs.get("attention_mask")  # transformers drops an all-ones mask
    mask = torch.ones_like(input_ids) if mask is None else mask
    steps = generation_config.max_length - input_ids.shape[1]  # tokens to choose
    seen = cache.get_seq_length()
    if seen == 0:  # the prompt is not in the cache yet: its forward is the first
        logits = prompt_forward(model, Prompt.of({"input_ids": input_ids, "attention_mask": mask}), cache)
        forwards = steps - 1
    elif input_ids.shape[1] - seen == 1:  # a prepared prompt (runtime.draft) and its first token
        forwards = steps
        logits = None
    else:
        raise ValueError(f"the cache holds {seen} of {input_ids.shape[1]} input positions; one at most may be new")
    position = mask.sum(dim=1, keepdim=True)  # each row's next position
    pad = generation_config._pad_token_tensor
    eos_stops = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    decoder = Decoder(model, cache, forwards, mode) if forwards > 0 else None
    try:
        if logits is None:
            logits = decoder(input_ids[:, -1:], position - 1)
        while True:
            scores = logits_processor(input_ids, logits.to(copy=True, dtype=torch.float32, device=input_ids.device))
            if generation_config.do_sample:
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = torch.argmax(scores, dim=-1)
            if eos_stops:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, None)
            if unfinished.max() == 0 or decoder is None or decoder.left < 1:
                return input_ids
            logits = decoder(tokens[:, None], position)
            position = position + 1
    finally:
        if decoder is not None:
            decoder.close()
