"""Tiny random vision-language models and image prompts for the runtime tests (built offline).

Each builder returns a `TinyVLM`: the model (float64, sdpa) and a `batch(lengths)` function that makes
a left-padded batch of prompts with one image each, in the form `model.generate(**inputs)` takes:
`input_ids` with the image placeholder already expanded to the image's token count (as processors
do), `attention_mask`, `pixel_values` and whatever else the model needs (`image_grid_thw` and
`mm_token_type_ids` for Qwen2-VL's mrope positions, `token_type_ids` for Gemma 3's bidirectional
image blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    SiglipVisionConfig,
)

VOCAB = 97
IMAGE_TOKEN = 90  # inside the vocabulary; text tokens are drawn from [3, IMAGE_TOKEN)
IMAGE_START = 91  # Qwen2-VL's <|vision_start|>, Gemma 3's <start_of_image>
IMAGE_END = 92
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass
class TinyVLM:
    name: str
    model: torch.nn.Module
    image_tokens: int  # language-model positions one image takes
    pixels: Callable[[int, torch.Generator], dict]  # images -> pixel inputs for that many images
    wrap: Callable[[torch.Tensor], torch.Tensor]  # image token block -> the block as it sits in the prompt

    def prompt(self, length: int, seed: int) -> torch.Tensor:
        """`length` text tokens with one image block after the first third (real tokens only)."""
        g = torch.Generator().manual_seed(seed)
        text = torch.randint(3, IMAGE_TOKEN, (length,), generator=g)
        block = self.wrap(torch.full((self.image_tokens,), IMAGE_TOKEN))
        cut = max(1, length // 3)
        return torch.cat([text[:cut], block, text[cut:]])

    def batch(self, lengths: list[int], seed: int = 1) -> dict[str, torch.Tensor]:
        seqs = [self.prompt(n, seed + i) for i, n in enumerate(lengths)]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = s
            mask[i, width - len(s):] = 1
        inputs = {"input_ids": ids, "attention_mask": mask}
        # Prompt i is drawn from seed + i, text and image alike, so `batch([n], seed + i)` is
        # exactly row i of `batch(lengths, seed)` without its padding.
        per_prompt = [self.pixels(1, torch.Generator().manual_seed(1000 + seed + i)) for i in range(len(seqs))]
        for key in per_prompt[0]:
            inputs[key] = torch.cat([p[key] for p in per_prompt])
        image = ids == IMAGE_TOKEN
        if self.name == "qwen2-vl":
            inputs["mm_token_type_ids"] = image.int()
        if self.name == "gemma3":
            inputs["token_type_ids"] = image.long()
        return inputs


def _finish(model: torch.nn.Module) -> torch.nn.Module:
    model = model.to(torch.float64).eval()
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None  # random weights: never stop early, every step compares
    return model


def tiny_llava(seed: int = 0) -> TinyVLM:
    """LLaVA: 2-layer CLIP tower (32-px images, 8-px patches: 16 image tokens), 3-layer GQA Llama."""
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **SPECIAL,
    )
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, image_seq_length=16,
                      vision_feature_layer=-1, **SPECIAL)
    model = _finish(LlavaForConditionalGeneration(cfg))

    def pixels(n: int, g: torch.Generator) -> dict:
        return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)}

    return TinyVLM("llava", model, 16, pixels, lambda block: block)


QWEN_PATCH, QWEN_TEMPORAL, QWEN_MERGE = 4, 2, 2
QWEN_GRID = (1, 4, 4)  # t, h, w patches: 16 patches, 4 image tokens after 2x2 merging


def tiny_qwen2_vl(seed: int = 0) -> TinyVLM:
    """Qwen2-VL: 2-block vision tower (4x4 patch grid merged 2x2: 4 image tokens), 3-layer text model
    with mrope (sections sum to head_dim / 2)."""
    torch.manual_seed(seed)
    vision = dict(
        depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, in_channels=3,
        patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=QWEN_TEMPORAL,
    )
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}, **SPECIAL,
    )
    cfg = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 3,
        vision_start_token_id=IMAGE_START, vision_end_token_id=IMAGE_END, **SPECIAL,
    )
    model = _finish(Qwen2VLForConditionalGeneration(cfg))
    t, h, w = QWEN_GRID
    patch_dim = 3 * QWEN_TEMPORAL * QWEN_PATCH * QWEN_PATCH

    def pixels(n: int, g: torch.Generator) -> dict:
        return {
            "pixel_values": torch.randn(n * t * h * w, patch_dim, generator=g, dtype=torch.float64),
            "image_grid_thw": torch.tensor([QWEN_GRID] * n),
        }

    def wrap(block: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tensor([IMAGE_START]), block, torch.tensor([IMAGE_END])])

    return TinyVLM("qwen2-vl", model, t * h * w // QWEN_MERGE**2, pixels, wrap)


def tiny_gemma3_vlm(seed: int = 0) -> TinyVLM:
    """Gemma 3 with vision: 1-layer SigLIP tower (32-px images, 8-px patches, pooled to 4 image tokens),
    4-layer text model (sliding, full, sliding, full)."""
    torch.manual_seed(seed)
    vision = SiglipVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2,
    )
    text = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        **SPECIAL,
    )
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN,
        boi_token_index=IMAGE_START, eoi_token_index=IMAGE_END, **SPECIAL,
    )
    model = _finish(Gemma3ForConditionalGeneration(cfg))

    def pixels(n: int, g: torch.Generator) -> dict:
        return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)}

    def wrap(block: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tensor([IMAGE_START]), block, torch.tensor([IMAGE_END])])

    return TinyVLM("gemma3", model, 4, pixels, wrap)


BUILDERS = {"llava": tiny_llava, "qwen2-vl": tiny_qwen2_vl, "gemma3": tiny_gemma3_vlm}


def save_tiny_llava(directory, tokenizer, seed: int = 0):
    """A tiny random LLaVA saved as a normal model directory with its processor, all built offline.

    `tokenizer` must have an `<image>` special token. The processor's CLIP image processor resizes and
    crops to the tower's 32 px, and `patch_size` 8 with one extra (CLS) token under the "default"
    feature strategy (which drops it) expands each `<image>` to the 16 tokens the model fills.
    Float32, as `load_model` loads it. Returns the directory.
    """
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_token = tokenizer.convert_tokens_to_ids("<image>")
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **special,
    )
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token, image_seq_length=16,
                      vision_feature_layer=-1, vision_feature_select_strategy="default", **special)
    model = LlavaForConditionalGeneration(cfg).eval()
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


# ----- more families: Qwen2.5-VL, Qwen3-VL, Idefics3 / SmolVLM, LLaVA-OneVision, Mistral 3 (Pixtral)


@dataclass
class TinyVLMInputs(TinyVLM):
    """A TinyVLM whose prompts carry more inputs than the ids and pixels: `extra(ids)` gives them."""

    extra: Callable[[torch.Tensor], dict] | None = None

    def batch(self, lengths: list[int], seed: int = 1) -> dict[str, torch.Tensor]:
        inputs = super().batch(lengths, seed)
        if self.extra is not None:
            inputs.update(self.extra(inputs["input_ids"]))
        return inputs


def _qwen_pixels(n: int, g: torch.Generator) -> dict:
    t, h, w = QWEN_GRID
    patch_dim = 3 * QWEN_TEMPORAL * QWEN_PATCH * QWEN_PATCH
    return {
        "pixel_values": torch.randn(n * t * h * w, patch_dim, generator=g, dtype=torch.float64),
        "image_grid_thw": torch.tensor([QWEN_GRID] * n),
    }


def _qwen_wrap(block: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([IMAGE_START]), block, torch.tensor([IMAGE_END])])


def _mm_token_types(ids: torch.Tensor) -> dict:
    return {"mm_token_type_ids": (ids == IMAGE_TOKEN).int()}


def _qwen_text(**rope) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], **rope}, **SPECIAL,
    )


def tiny_qwen2_5_vl(seed: int = 0) -> TinyVLM:
    """Qwen2.5-VL: 2-block windowed vision tower (the second block full attention), 4 image tokens, mrope text model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, in_channels=3,
        patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=QWEN_TEMPORAL,
        window_size=16, fullatt_block_indexes=[1],
    )
    cfg = Qwen2_5_VLConfig(
        text_config=_qwen_text(), vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 3,
        vision_start_token_id=IMAGE_START, vision_end_token_id=IMAGE_END, **SPECIAL,
    )
    model = _finish(Qwen2_5_VLForConditionalGeneration(cfg))
    t, h, w = QWEN_GRID
    return TinyVLMInputs("qwen2.5-vl", model, t * h * w // QWEN_MERGE**2, _qwen_pixels, _qwen_wrap, _mm_token_types)


def tiny_qwen3_vl(seed: int = 0) -> TinyVLM:
    """Qwen3-VL: 2-block vision tower with one deepstack layer, 4 image tokens, interleaved-mrope text model."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, in_channels=3,
        patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=QWEN_TEMPORAL,
        num_position_embeddings=16, deepstack_visual_indexes=[0],
    )
    cfg = Qwen3VLConfig(
        text_config=_qwen_text(mrope_interleaved=True), vision_config=vision, image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 3, vision_start_token_id=IMAGE_START, vision_end_token_id=IMAGE_END, **SPECIAL,
    )
    model = _finish(Qwen3VLForConditionalGeneration(cfg))
    t, h, w = QWEN_GRID
    return TinyVLMInputs("qwen3-vl", model, t * h * w // QWEN_MERGE**2, _qwen_pixels, _qwen_wrap, _mm_token_types)


def _llama_text(**extra) -> dict:
    return dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **SPECIAL, **extra,
    )


def _square_pixels(*shape: int) -> Callable[[int, torch.Generator], dict]:
    """`n` random 32-px RGB images as a [n, *shape, 3, 32, 32] `pixel_values`."""
    return lambda n, g: {"pixel_values": torch.randn(n, *shape, 3, 32, 32, generator=g, dtype=torch.float64)}


def tiny_mistral3(seed: int = 0) -> TinyVLM:
    """Mistral 3: 1-layer Pixtral tower (32-px images, 8-px patches merged 2x2: 4 image tokens), 3-layer Mistral."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=32, patch_size=8, head_dim=16)
    text = {**_llama_text(), "model_type": "mistral", "sliding_window": None}
    cfg = Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, spatial_merge_size=2,
                         **SPECIAL)
    model = _finish(Mistral3ForConditionalGeneration(cfg))

    def pixels(n: int, g: torch.Generator) -> dict:
        return {**_square_pixels()(n, g), "image_sizes": torch.tensor([[32, 32]] * n)}

    return TinyVLM("mistral3", model, 4, pixels, lambda block: torch.cat([block, torch.tensor([IMAGE_END])]))


def _idefics_pixels(n: int, g: torch.Generator) -> dict:
    return {**_square_pixels(1)(n, g), "pixel_attention_mask": torch.ones(n, 1, 32, 32, dtype=torch.bool)}


def tiny_idefics3(seed: int = 0) -> TinyVLM:
    """Idefics3: 1-layer SigLIP-style tower (32-px images, 8-px patches, pixel-shuffled by 2: 4 image tokens), 3-layer Llama."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    cfg = Idefics3Config(vision_config=vision, text_config=_llama_text(), image_token_id=IMAGE_TOKEN, scale_factor=2,
                         **SPECIAL)
    model = _finish(Idefics3ForConditionalGeneration(cfg))
    return TinyVLM("idefics3", model, 4, _idefics_pixels, _qwen_wrap)


def tiny_smolvlm(seed: int = 0) -> TinyVLM:
    """SmolVLM: Idefics3's shape (4 image tokens), its own model classes."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    cfg = SmolVLMConfig(vision_config=vision, text_config=_llama_text(), image_token_id=IMAGE_TOKEN, scale_factor=2,
                        **SPECIAL)
    model = _finish(SmolVLMForConditionalGeneration(cfg))
    return TinyVLM("smolvlm", model, 4, _idefics_pixels, _qwen_wrap)


def tiny_llava_onevision(seed: int = 0) -> TinyVLM:
    """LLaVA-OneVision: 1-layer SigLIP tower, any-resolution with one 32-px tile (the base image and the
    tile, 16 patches each, the tile's rows each ended by a newline feature: 36 image tokens), 3-layer Qwen2."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    text = {**_llama_text(), "model_type": "qwen2"}
    cfg = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                               video_token_index=IMAGE_TOKEN + 3, image_grid_pinpoints=[[32, 32]],
                               vision_feature_layer=-1, **SPECIAL)
    model = _finish(LlavaOnevisionForConditionalGeneration(cfg))

    def pixels(n: int, g: torch.Generator) -> dict:
        return {**_square_pixels(2)(n, g), "image_sizes": torch.tensor([[32, 32]] * n)}

    return TinyVLM("llava-onevision", model, 36, pixels, lambda block: block)


MORE_BUILDERS = {
    "qwen2.5-vl": tiny_qwen2_5_vl, "qwen3-vl": tiny_qwen3_vl, "idefics3": tiny_idefics3, "smolvlm": tiny_smolvlm,
    "llava-onevision": tiny_llava_onevision, "mistral3": tiny_mistral3,
}
