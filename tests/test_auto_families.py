"""Every architecture transformers maps to a causal LM (and to image-text-to-text), at a tiny random size.

Each model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`
gets its default config shrunk (`tiny_config`: widths, layers, heads, experts, vocabulary and windows,
under the field names configs commonly use) and is held to one rule: `attach` with a uniform profile
at budget 1.0 generates token for token what the unmodified model generates and at 0.5 runs, or
`attach` refuses with a one-line KvtoolError. Any other exception fails the test.

The default run walks REPRESENTATIVE, a fixed list covering each kind of attention and cache kvtool
meets (compressing, windowed, soft-capping, sink, chunked, refused and encoder-decoder types); the full
walk of both mappings runs only with KVTOOL_FULL_FAMILIES=1 set (`KVTOOL_FULL_FAMILIES=1 pytest
tests/test_auto_families.py`; marked `slow` too), about three minutes on a 2-core CPU. Types the walk cannot build at a
tiny size or run without kvtool are listed in UNBUILT with the error, and skipped; a type outside
that list that does not build fails the full walk. EXPECTED lists the families whose failure inside
kvtool's cache is known, with the reason (xfail).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.runtime import attach, uniform_profile

VOCAB = 97
NEW = 4
# What each common field name becomes (the first of each group a config has is set).
SIZES = {
    ("hidden_size", "n_embd", "d_model", "embed_dim", "hidden_dim", "dim"): 64,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"): 2,
    ("num_attention_heads", "n_head", "num_heads", "n_heads"): 4,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"): 2,
    ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "intermediate_size_mlp"): 128,
    ("head_dim", "kv_channels"): 16,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"): 512,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "moe_k", "num_selected_experts", "moe_topk"): 2,
    ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"): 32,
    ("n_group", "topk_group"): 1,
    ("sliding_window", "attention_chunk_size"): 8,
    ("encoder_attention_heads",): 4,
    ("decoder_attention_heads",): 4,
    ("encoder_ffn_dim",): 128,
    ("decoder_ffn_dim",): 128,
    ("encoder_layers",): 2,
    ("decoder_layers",): 2,
    ("rotary_dim",): 16,
    # Latent attention (DeepSeek-V2/V3, Kimi): the latent and the rotary and plain parts of a head.
    ("kv_lora_rank",): 32,
    ("q_lora_rank",): 32,
    ("qk_rope_head_dim",): 8,
    ("qk_nope_head_dim",): 8,
    ("v_head_dim",): 16,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _shrink(fields: dict) -> dict:
    out = dict(fields)
    for names, size in SIZES.items():
        for name in names:
            if isinstance(out.get(name), int) and not isinstance(out.get(name), bool) and out[name] > size:
                out[name] = size
                break
    if "qk_rope_head_dim" in out and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]  # latent attention: the rotary part is the head dim
    original = next((fields[n] for n in LAYER_COUNTS if isinstance(fields.get(n), int)), None)
    layers = next((out[n] for n in LAYER_COUNTS if isinstance(out.get(n), int)), None)
    per_layer = [k for k, v in out.items() if k.endswith("_types") and isinstance(v, list) and len(v) == original and v]
    if layers is not None and per_layer:
        # Every kind the model mixes, in its order, each at least once: one list per layer field.
        kinds = {k: list(dict.fromkeys(out[k])) for k in per_layer}
        layers = max(layers, *(len(v) for v in kinds.values()))
        out[next(n for n in LAYER_COUNTS if n in out)] = layers
        for k, values in kinds.items():
            out[k] = [values[i % len(values)] for i in range(layers)]
    if isinstance(out.get("per_layer_config"), dict) and layers is not None:
        out["per_layer_config"] = {k: v for k, v in out["per_layer_config"].items() if int(k) < layers}
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and "num_attention_heads" in out:
        # Multimodal RoPE splits half a head's dimensions into sections: rescaled to the tiny head.
        head_dim = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
        section, half = rope["mrope_section"], head_dim // 2
        scaled = [max(1, round(x * half / sum(section))) for x in section]
        scaled[0] += half - sum(scaled)
        out["rope_parameters"] = {**rope, "mrope_section": scaled}
    for name, value in list(out.items()):
        if isinstance(value, dict) and "model_type" in value:
            out[name] = _shrink(value)
    if "vocab_size" in out:
        out["vocab_size"] = max(VOCAB, _largest_token_id(fields) + 1)
        out.update({k: v for k, v in TOKEN_IDS.items() if k in out})
    return out


def _largest_token_id(fields: dict) -> int:
    ids = [v for k, v in fields.items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)
           and k not in TOKEN_IDS]
    return max(ids, default=0)


def tiny_config(model_type: str):
    """The model type's default config, shrunk; its text config gets the shrunk vocabulary too."""
    default = CONFIG_MAPPING[model_type]()
    fields = _shrink(default.to_dict())
    return type(default).from_dict(fields)


def tiny_model(model_type: str, class_name: str):
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(tiny_config(model_type)).float().eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


def _inputs(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # one left-padded row
    return {"input_ids": ids, "attention_mask": mask}


GREEDY = dict(do_sample=False, max_new_tokens=NEW, pad_token_id=0)
# The full walk of both mappings: minutes, so only when asked (it also carries the `slow` marker).
FULL = os.environ.get("KVTOOL_FULL_FAMILIES", "") not in ("", "0")


def check_family(model_type: str, class_name: str) -> str:
    """'compresses' or 'refused: ...'; raises on anything else."""
    try:
        model = tiny_model(model_type, class_name)
        inputs = _inputs(model)
        with torch.no_grad():
            reference = model.generate(**inputs, **GREEDY)
    except Exception as error:  # the walk's own build, or the model without kvtool
        raise AssertionError(f"{model_type} ({class_name}) did not build or run at a tiny size: {error!r}") from error
    try:
        handle = attach(model, uniform_profile(model, 1.0))
    except KvtoolError as error:
        message = str(error)
        assert message and "\n" not in message, f"{model_type}: a refusal must be one line: {message!r}"
        return f"refused: {message}"
    with torch.no_grad(), handle:
        out = model.generate(**inputs, **GREEDY, **with_cache(model, handle.new_cache()))
    assert torch.equal(out, reference), f"{model_type}: budget 1.0 generated other tokens than the model"
    try:
        profile = uniform_profile(model, 0.5)
    except KvtoolError as error:  # a budget the model's windows cannot reach: refused in one line
        assert "\n" not in str(error), f"{model_type}: a refusal must be one line: {error}"
        return f"compresses at 1.0; 0.5 refused: {error}"
    with torch.no_grad(), attach(model, profile) as handle:
        half = model.generate(**inputs, **GREEDY, **with_cache(model, handle.new_cache()))
    assert half.shape == reference.shape
    return "compresses"


# Types the walk does not build at a tiny size, or whose tiny model does not generate even without
# kvtool: the error its shrunk default config raised (a validator of the config, a model that needs
# pixel inputs or a missing package, sizes `_shrink` does not keep consistent). Encoder-decoder
# models and architectures whose attention kvtool refuses are not here: they build, and `attach`
# refuses them in one line (runtime/architectures.py).
UNBUILT: dict[str, str] = {
    "apertus1p5": "StrictDataclassClassValidationError('validator 'validate_architecture': ValueError: WavTokenizer use",
    "axk1": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "axk2": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "bailing_hybrid": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "bamba": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: The dimensions for the Mamba head state do not match",
    "beam": "RuntimeError: selected index k out of range",
    "blip": "TypeError: BlipForConditionalGeneration.generate() missing 1 required positional argument: 'pixel_values",
    "blip-2": "TypeError: Blip2ForConditionalGeneration.generate() missing 1 required positional argument: 'pixel_values",
    "blt": "timeout: over a minute at the tiny size",
    "chameleon": "AttributeError: NoneType' object has no attribute 'get",
    "cohere_compass": "KeyError: full_attention",
    "cohere_compass_text": "KeyError: full_attention",
    "dbrx": "AttributeError: DbrxAttentionConfig' object has no attribute 'rope_theta",
    "deepseek_ocr2": "TypeError: NoneType' object is not subscriptable",
    "deepseek_v2": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "deepseek_v3": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "deepseek_v32": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "diffusion_gemma": "TypeError: empty(): argument 'size' (position 1) must be tuple of ints, but found element of type NoneType at p",
    "dory": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: n_input_layers + n_recurrent_layers + n_output_layers",
    "dots1": "TypeError: empty() takes 1 positional argument but 3 were given",
    "dots3_note": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: num_key_value_heads must match num_attention_heads",
    "dots3_note_text": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: num_key_value_heads must match num_attention_heads",
    "emu3": "AttributeError: Emu3Config' object has no attribute 'pad_token_id",
    "ernie4_5_vl_moe": "RuntimeError: The expanded size of the tensor (8) must match the existing size (0) at non-singleton dimension 0. T",
    "fast_vlm": "ImportError(' TimmWrapperModel requires the timm library but it was not found in your environment. Y",
    "gemma3n": "ValueError: intermediate_size must have an explicit intermediate size for every layer or one for all layers. Exp",
    "gemma3n_text": "ValueError: intermediate_size must have an explicit intermediate size for every layer or one for all layers. Exp",
    "gemma4_assistant": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: hidden_size_per_layer_input must be 0, got 256",
    "gemma4_unified_assistant": "ValueError: The set of layer types producing a cache is different than the set of layer types using them",
    "glm46v": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 8 (input tensor's size at dimension -1), but",
    "glm4_moe_lite": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "glm4v": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 8 (input tensor's size at dimension -1), but",
    "glm4v_moe": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 4 (input tensor's size at dimension -1), but",
    "glm5_next": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: num_attention_heads (4) must be the same as num_key_v",
    "glm_moe_dsa": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "glm_ocr": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 8 (input tensor's size at dimension -1), but",
    "glmga": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 8 (input tensor's size at dimension -1), but",
    "gpt_neo": "StrictDataclassClassValidationError('validator 'validate_architecture': ValueError: Configuration fo",
    "granite4_vision": "TypeError: object of type 'NoneType' has no len()",
    "granite_docling": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: vision_config.out_hidden_size (1024) must equal text_",
    "granitemoehybrid": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: The dimensions for the Mamba head state do not match",
    "hrm_text": "IndexError: list index out of range",
    "hunyuan_v1_dense": "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float",
    "hunyuan_v1_moe": "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float",
    "hunyuan_vl": "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float",
    "idefics": "ValueError: Exactly 1 of pixel_values, image_encoder_embeddings or perceiver_embeddings has to be not-None.",
    "inkling2": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: `vision_config.text_hidden_size` (4608) must match `t",
    "inkling2_loop": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: `vision_config.text_hidden_size` (2304) must match `t",
    "inkling2_loop_text": "IndexError: index out of range in self",
    "inkling2_text": "IndexError: index out of range in self",
    "inkling_mm_model": "ModuleNotFoundError: No module named 'scipy",
    "instructblip": "TypeError: InstructBlipForConditionalGeneration.generate() missing 1 required positional argument: 'pixel_value",
    "instructblipvideo": "TypeError: InstructBlipVideoForConditionalGeneration.generate() missing 1 required positional argument: 'pixel_",
    "jamba": "ValueError: `get_seq_length` can only be called on Attention layers, and the current Cache seem to only contain",
    "kimi_k25": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "kimi_linear": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "laguna": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: num_attention_heads_per_layer length (40) must equal",
    "lfm2_moe": "TypeError: NoneType' object is not subscriptable",
    "llama4": "AttributeError: Llama4Config' object has no attribute 'pad_token_id",
    "longcat_flash": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 192 (input tensor's size at dimension -1), bu",
    "mamba2": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: Inconsistent configuration: hidden_size * expand (128",
    "minicpm3": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "ministral": "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float",
    "mistral4": "RuntimeError: The size of tensor a (4) must match the size of tensor b (2) at non-singleton dimension 3",
    "mistral_large4": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: `kv_source_layers` must have one entry per layer (2),",
    "molmo2": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: `adapter_config.vision_feature_layer` [24, 18] must i",
    "muse_spark": "StrictDataclassClassValidationError('validator 'validate_architecture': ValueError: `patch_sizes`, `",
    "musicgen": "AttributeError: MusicgenConfig' object has no attribute 'dropout",
    "musicgen_melody": "AttributeError: MusicgenMelodyConfig' object has no attribute 'dropout",
    "nemotron": "TypeError: unsupported operand type(s) for //: 'int' and 'NoneType",
    "paddleocr_vl": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 8 (input tensor's size at dimension -1), but",
    "perception_lm": "ImportError(' TimmWrapperModel requires the timm library but it was not found in your environment. Y",
    "pi0": "AttributeError: PI0ForConditionalGeneration' object has no attribute 'generation_config",
    "pix2struct": "IndexError: too many indices for tensor of dimension 2",
    "pp_formulanet": "ValueError: not enough values to unpack (expected 4, got 2)",
    "qwen2_5_omni_thinker": "AttributeError: Qwen2_5OmniThinkerConfig' object has no attribute 'vision_start_token_id",
    "qwen2_5_vl": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 8 (input tensor's size at dimension -1), but",
    "qwen2_vl": "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 8 (input tensor's size at dimension -1), but",
    "qwen3_5": "AttributeError: Qwen3_5Config' object has no attribute 'vocab_size",
    "qwen3_5_moe": "AttributeError: Qwen3_5MoeConfig' object has no attribute 'vocab_size",
    "qwen3_omni_moe_thinker": "AttributeError: Qwen3OmniMoeThinkerConfig' object has no attribute 'vision_start_token_id",
    "qwen4_exp": "AttributeError: Qwen4ExpConfig' object has no attribute 'vocab_size",
    "qwen4_exp_text": "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType",
    "recurrent_gemma": "ValueError: `get_seq_length` can only be called on Attention layers, and the current Cache seem to only contain",
    "reformer": "AssertionError: If you want to use `ReformerModelWithLMHead` make sure that `is_decoder=True`.",
    "rwkv": "RuntimeError: The size of tensor a (64) must match the size of tensor b (4096) at non-singleton dimension 1",
    "sarvam_mla": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "step3p7": "ValueError: Could not find a `sliding_window` argument in the config, or it is not set",
    "udop": "ValueError: `decoder_start_token_id` or `bos_token_id` has to be defined for encoder-decoder generation.",
    "vision-encoder-decoder": "ValueError: not enough values to unpack (expected 4, got 2)",
    "xlnet": "StrictDataclassClassValidationError: validator 'validate_architecture': ValueError: `d_head` (64) should be equal to `d_model // n_head`",
    "xlstm": "RuntimeError: The size of tensor a (4096) must match the size of tensor b (64) at non-singleton dimension 2",
    "xmod": "ValueError: Input language unknown. Please call `XmodPreTrainedModel.set_default_language()`",
    "youtu": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
    "zamba": "StrictDataclassClassValidationError: validator 'validate_layer_type': ValueError: `num_hidden_layers` (2) must be equal to the number of",
    "zamba2": "StrictDataclassClassValidationError: validator 'validate_layer_type': ValueError: `num_hidden_layers` (2) must be equal to the number of",
}

# Families that fail inside kvtool's cache, with the reason (their cache structures are another
# part of kvtool's work: latent attention, linear-attention and Mamba hybrids, chunked layers, VLMs).
EXPECTED: dict[str, str] = {
    "minimax": "a linear-attention hybrid whose model refuses any cache but its own (MiniMaxCache) at generate",
}

REPRESENTATIVE = (
    "llama", "qwen3_moe", "mistral", "phi3", "gemma2", "gemma3_text", "cohere2", "gpt_oss", "llama4_text",
    "gpt2", "falcon", "t5gemma2",
)


def _all_types() -> list[tuple[str, str]]:
    walked = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for model_type, name in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items():
        walked.setdefault(model_type, name)
    return sorted(walked.items())


def _run(model_type: str, class_name: str) -> None:
    if model_type in UNBUILT:
        pytest.skip(f"{model_type}: {UNBUILT[model_type]}")
    if model_type in EXPECTED:
        pytest.xfail(f"{model_type}: {EXPECTED[model_type]}")
    check_family(model_type, class_name)


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_families_compress_exactly_or_refuse_in_one_line(model_type):
    _run(model_type, dict(_all_types())[model_type])


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the full walk runs with KVTOOL_FULL_FAMILIES=1 (about three minutes)")
@pytest.mark.parametrize("model_type,class_name", _all_types(), ids=[t for t, _ in _all_types()])
def test_every_auto_mapped_family_compresses_exactly_or_refuses_in_one_line(model_type, class_name):
    _run(model_type, class_name)
