"""Prompts with images for vision-language models: open the files, place the images, run the processor.

A prompt marks where its images go with `<image>` (kvtool's placeholder, whatever the model's own
image token is), one per image, in the order of the record's `images`. A prompt without any
placeholder gets all its images before its text. More placeholders than images is an error, and so
is fewer (but some): which images would go where is then a guess.

The prompt is wrapped as one user turn: the processor's chat template when it has one (text and
image parts in the prompt's order), else `USER: ... ASSISTANT:` with the processor's image token at
each placeholder (LLaVA-1.5's form). The processor then expands each image token to the image's
language-model positions and computes the pixel inputs. Every problem is a one-line KvtoolError
naming the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtool.errors import KvtoolError
from kvtool.models.prompts import default_bos
from kvtool.models.vision import image_token_ids

IMAGE_PLACEHOLDER = "<image>"
_PLAIN = "USER: {body} ASSISTANT:"


def open_images(paths: Sequence[str], where: str) -> list[Any]:
    """The images as RGB PIL images; a missing or unreadable file is a KvtoolError naming `where`."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - Pillow is a dependency
        raise KvtoolError("prompts with images need Pillow (pip install pillow)") from None

    images = []
    for path in paths:
        if not Path(path).exists():
            raise KvtoolError(f"{where}: image {path} does not exist")
        try:
            with Image.open(path) as image:
                image.load()
                images.append(image.convert("RGB"))
        except UnidentifiedImageError:
            raise KvtoolError(f"{where}: image {path} is not an image file Pillow can read") from None
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise KvtoolError(f"{where}: image {path} cannot be read ({reason})") from None
    return images


def split_at_placeholders(prompt: str, images: int, where: str) -> list[str]:
    """The prompt's text pieces, one more than `images`; image i goes between pieces i and i + 1."""
    count = prompt.count(IMAGE_PLACEHOLDER)
    if count == 0:
        return [""] * images + [prompt]
    if count != images:
        more = "more" if count > images else "fewer"
        raise KvtoolError(
            f"{where}: the prompt has {count} {IMAGE_PLACEHOLDER} placeholder{'s' if count != 1 else ''} but "
            f"{images} image{'s' if images != 1 else ''} ({more} placeholders than images); put one "
            f"{IMAGE_PLACEHOLDER} where each image goes, or none to put all images before the text"
        )
    return prompt.split(IMAGE_PLACEHOLDER)


def format_image_prompt(processor: Any, prompt: str, images: int, where: str) -> str:
    """The rendered user turn, with the processor's image token at each image's place."""
    pieces = split_at_placeholders(prompt, images, where)
    if getattr(processor, "chat_template", None):
        content: list[dict[str, str]] = []
        for i, piece in enumerate(pieces):
            if i:
                content.append({"type": "image"})
            if piece.strip():
                content.append({"type": "text", "text": piece.strip()})
        messages = [{"role": "user", "content": content}]
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    token = processor.image_token
    if prompt.count(IMAGE_PLACEHOLDER):
        body = token.join(pieces)
    else:
        body = token * images + "\n" + prompt
    return default_bos(processor.tokenizer) + _PLAIN.format(body=body)


def encode_image_prompt(processor: Any, prompt: str, paths: Sequence[str], where: str) -> tuple[list[int], dict[str, Any]]:
    """Token ids (image tokens expanded) and the processor's other outputs ([1, ...] tensors)."""
    images = open_images(paths, where)
    text = format_image_prompt(processor, prompt, len(images), where)
    try:
        inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    except (ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvtoolError(f"{where}: the processor rejected the prompt and its images ({first})") from None
    ids = inputs["input_ids"][0].tolist()
    extras = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    return ids, extras


def no_image_support(config: Any, name: str, where: str) -> KvtoolError:
    """The error for a record with images on a model loaded without a processor."""
    if not image_token_ids(config):
        return KvtoolError(
            f"{where}: has \"images\" but {name} is a text-only model (its config has no image token); "
            "drop the images or use a vision-language model directory with its processor"
        )
    return KvtoolError(
        f"{where}: has \"images\" but no processor was found with {name} (AutoProcessor found none offline); "
        "save the processor into the model directory (processor.save_pretrained(DIR))"
    )
