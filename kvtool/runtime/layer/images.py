"""Image tokens: which prompt positions are image tokens, and how many kept entries came from them.

Vision-language prompts hand the layer their image-token mask before the prompt forward
(`KvtoolCache.set_image_mask`); selection rules that treat image tokens apart (LOOK-M's text prior)
read it, and each kept entry remembers whether it came from an image token (`image`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvtool.errors import KvtoolError


class ImageEntries:
    """CompressingLayer's image-token bookkeeping (state declared in `CompressingLayer._clear`):
    `prompt_image` before the prompt is compressed, `image` per slot after."""

    def set_prompt_image(self, image_mask: torch.Tensor | None) -> None:
        """Which prompt positions are image tokens ([B, n] bool); before the prompt forward only."""
        if self.is_initialized:
            raise KvtoolError("the image-token mask must be set before the prompt is processed")
        self.prompt_image = None if image_mask is None else image_mask.to(torch.bool)

    def _image_mask(self, token_valid: torch.Tensor) -> torch.Tensor | None:
        image = self.prompt_image
        if image is None:
            return None
        if image.shape != token_valid.shape:
            raise KvtoolError(
                f"the image-token mask has shape {tuple(image.shape)} but the prompt reached the cache as "
                f"{tuple(token_valid.shape)} (batch, tokens): the input ids must map 1:1 to language-model positions"
            )
        return image.to(token_valid.device) & token_valid  # padding is never an image token

    @property
    def kept_image(self) -> np.ndarray:
        """Kept (valid) entries per sequence that came from image tokens of the prompt ([B] int64).

        Zeros for text-only prompts and before the prompt is compressed. Generated tokens are text.
        """
        if self.image is None or self.valid is None:
            return np.zeros(len(self.kept), dtype=np.int64)
        if self.per_head:
            # Heads keep different entries: the count averaged over KV heads, rounded.
            per_row = (self.image & self.entry_valid).sum(dim=(1, 2)).double() / self.image.shape[1]
            return per_row.round().cpu().numpy().astype(np.int64)
        return (self.image & self.valid).sum(dim=1).cpu().numpy().astype(np.int64)
