"""A compressing layer for multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2).

transformers' DeepSeek attention caches, per token, what it computes before the heads exist: the
compressed latent (`kv_lora_rank` wide, passed to `update` as the keys) and the shared rotary key
(`qk_rope_head_dim` wide, passed as the values), one "head" each. After reading the cache it expands
them into per-head keys and values (`expand_kv`: the `kv_b_proj` projection and the rotary part
copied into every head) and attends to those. So this layer holds exactly what transformers holds,
and its slots are tokens: placing, evicting and moving an entry moves one token's latent and rotary
key together, whatever their widths.

Scores come from the attention the model computes: the prompt forward's attention function gets
the expanded keys and values, and every later step attends to the held entries expanded by the
module's own `expand_kv` (`_read`, which `decode_view` and the re-scoring of a recorded prompt use). A merge of two entries averages their latents, which is
the average of their expanded keys and values, since the expansion is linear in the latent.

What is refused in one line: per-head entries (the latent has one head for all of them), storage
formats other than native (the formats' entries are one head size wide), query statistics (the
expected-attention rules read keys, and these keys are latents), and fixed slots (the fused step
reads keys it never expands). A draft's rows read the held latents (layer/held.py compresses the
refilled layer from the latents, not from the expansion attention read); a profile with a draft is
still refused at `attach` (layer/limits.py: row groups would be joined into plain layers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtool.errors import KvtoolError
from kvtool.runtime.layer.compressing import CompressingLayer
from kvtool.runtime.layer.plan import LayerPlan

Expand = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def latent_expanders(model) -> dict[int, Expand]:
    """Per decoder layer index, the `expand_kv` of that layer's latent-attention module (empty for
    models without one): transformers' DeepSeek-V2/V3 attention modules define it."""
    found = {}
    for module in model.modules():
        expand, index = getattr(module, "expand_kv", None), getattr(module, "layer_idx", None)
        if callable(expand) and isinstance(index, int):
            found[index] = expand
    return found


def latent_refusal(plan: LayerPlan) -> str | None:
    """Why a latent layer cannot follow `plan` (None: it can)."""
    if plan.heads == "per-head":
        return "per-head entries (the latent is one head shared by every query head)"
    if tuple(plan.storage) != ("native", "native"):
        return f"stored entries ({'/'.join(plan.storage)}; the latent and rotary key are kept as the model computes them)"
    if plan.queries is not None:
        return "rules that read query statistics against the keys (the cached keys are latents)"
    return None


class LatentLayer(CompressingLayer):
    """A CompressingLayer over MLA's cached latents; `expand` is the attention module's `expand_kv`."""

    def __init__(self, plan: LayerPlan, expand: Expand):
        why = latent_refusal(plan)
        if why is not None:
            raise KvtoolError(f"multi-head latent attention layers do not support {why}")
        super().__init__(plan)
        self.expand = expand

    def _read(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries as attention reads them (`decode_view`, re-scoring a recorded prompt): the
        latents and rotary keys expanded to per-head keys and values."""
        return self.expand(*super()._read(keys, values))

    @property
    def decode_kind(self) -> None:
        """Never merged with other recipes' layers (runtime.grouped): a merged layer is a plain
        CompressingLayer, which would hand attention the latents unexpanded; each recipe's latent
        layer decodes its own rows."""
        return None

    def fix_slots(self, steps: int) -> None:
        raise KvtoolError("fixed slots (CUDA graphs) are not supported on multi-head latent attention models")
