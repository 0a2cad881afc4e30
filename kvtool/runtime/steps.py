"""The prompt forward and the one-token steps after it, through any cache (full or compressed).

A `Prompt` is left-padded rows as a model's forward takes them. `prompt_logits` runs its forward into
a cache; `step_tokens` then feeds one token per row per step, with the attention mask and positions
the rows continue from. The draft (`runtime.draft`) and the scoring engine (`kvtool.scoring`) both
run on these two, so a drafted cache is the same whoever drafts it.

Positions follow `generate`: each row counts its own real tokens (cumsum of the attention mask), so
a padded row sees the same positions as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtool.models.forward import with_cache
from kvtool.runtime.graphed import Decoder, default_mode

StepHook = Callable[[], None]
# Given the step and the logits [B, V] that predict its tokens, the [B] tokens to feed next, or
# None when nothing more needs to be fed.
StepAction = Callable[[int, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class Prompt:
    """Left-padded prompt rows and the positions the model gives them."""

    input_ids: torch.Tensor  # [B, W]
    attention_mask: torch.Tensor  # [B, W]
    position_ids: torch.Tensor  # [B, W]; [3, B, W] for multimodal rope
    # Further inputs of the prompt forward (pixel values and the like); empty for text prompts.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # [B, 1] added to the text positions of new tokens: Qwen2-VL's mrope delta (an image block takes
    # fewer positions than tokens); None elsewhere.
    position_offset: torch.Tensor | None = None

    @property
    def next_positions(self) -> torch.Tensor:
        """[B, 1] position of each row's first new token."""
        following = self.attention_mask.sum(dim=1, keepdim=True)
        return following if self.position_offset is None else following + self.position_offset

    def row_slice(self, index: slice) -> "Prompt":
        """The prompt of rows `index` alone, at the batch's width (text prompts: `extras` stay whole)."""
        offset = None if self.position_offset is None else self.position_offset[index]
        return Prompt(
            input_ids=self.input_ids[index], attention_mask=self.attention_mask[index],
            position_ids=self.position_ids[..., index, :], extras=self.extras, position_offset=offset,
        )

    @classmethod
    def of(cls, inputs: Mapping[str, Any]) -> "Prompt":
        """A tokenizer's output (`input_ids`, `attention_mask` if padded; other tensors go to the prompt
        forward as they are) with `generate`'s positions."""
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        extras = {
            key: value for key, value in inputs.items()
            if key not in ("input_ids", "attention_mask") and isinstance(value, torch.Tensor)
        }
        return cls(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0), extras=extras)


def prompt_forward(model: Any, prompt: Prompt, cache: Any) -> torch.Tensor:
    """The prompt forward of `prompt` into `cache`; returns the [B, V] logits of its last position."""
    return prompt_logits(model, prompt, cache, 1)[:, -1]


def prompt_extras(model: Any, prompt: Prompt) -> dict[str, torch.Tensor]:
    """The prompt-only inputs on the model's device: pixels (vision-language prompts) in its dtype,
    index tensors as they are."""
    return {
        key: value.to(device=model.device, dtype=model.dtype) if value.is_floating_point() else value.to(model.device)
        for key, value in prompt.extras.items()
    }


def prompt_logits(model: Any, prompt: Prompt, cache: Any, keep: int) -> torch.Tensor:
    """The prompt forward of `prompt` into `cache`; returns the logits of its last `keep` positions [B, keep, V]."""
    device = model.device
    extras = prompt_extras(model, prompt)
    # Only the last `keep` positions' logits are needed; the full [B, W, vocab] tensor is most of
    # a small model's prompt cost.
    out = model(
        input_ids=prompt.input_ids.to(device),
        attention_mask=prompt.attention_mask.to(device),
        position_ids=prompt.position_ids.to(device),
        **with_cache(model, cache),
        use_cache=True,
        logits_to_keep=keep,
        **extras,
    )
    return out.logits


def step_tokens(
    model: Any,
    cache: Any,
    first_logits: torch.Tensor,
    prompt: Prompt,
    steps: int,
    action: StepAction,
    on_step: StepHook | None = None,
) -> None:
    """Run up to `steps` steps after the prompt forward, feeding one token per row through `cache`.

    Step t hands `action` the logits that predict its tokens (the prompt's last logits at t = 0);
    the tokens `action` returns are fed, with the attention mask and positions the rows continue
    from, except after the last step (nothing would use the logits) or when it returns None.
    `on_step` is called after every forward.
    """
    rows = first_logits.shape[0]
    device = first_logits.device
    mask, position = prompt.attention_mask.to(device), prompt.next_positions.to(device)
    logits = first_logits
    # A kvtool cache on a GPU steps as a CUDA graph (runtime.graphed): the draft's steps are decode
    # steps, launch-bound like the answer's. It needs no mask: the layers mask by their own slots.
    mode = default_mode(cache, device) if steps > 1 else "eager"
    decoder = Decoder(model, cache, steps - 1, mode) if mode != "eager" else None
    try:
        for t in range(steps):
            token = action(t, logits)
            if token is None or t == steps - 1:
                break
            if decoder is not None:
                logits = decoder(token[:, None], position)
            else:
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                logits = _forward(model, token[:, None], mask, position, cache)
            position = position + 1
            if on_step:
                on_step()
    finally:
        if decoder is not None:
            decoder.close()


def _forward(model: Any, token: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
    out = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True, **with_cache(model, cache))
    return out.logits[:, -1]
