"""What a vision-language model's config says about its image tokens."""

from __future__ import annotations

from typing import Any


def image_token_ids(config: Any) -> tuple[int, ...]:
    """The token ids a vision-language model's processor puts at image (and video frame) positions.

    Read from the top-level config (`image_token_id`, LLaVA's and Gemma 3's `image_token_index`,
    Qwen2-VL's `video_token_id`); empty for text-only models.
    """
    ids: list[int] = []
    for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value not in ids:
            ids.append(value)
    return tuple(ids)
