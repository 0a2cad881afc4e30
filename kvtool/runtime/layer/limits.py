"""What a profile may not ask of the layers some families have, refused in one line at `attach`.

A draft (runtime.draft) runs its rows through every layer and then drops them, which kvtool's own
layers can do and transformers' cannot: a chunked layer (Llama 4) would keep the rows in its window,
and a linear-attention or Mamba layer (Qwen3-Next, Jamba, Bamba, Granite 4, Nemotron-H) would have
folded them into its recurrent state for good. A latent-attention layer (layer/latent.py) is
kvtool's own and drafts over its held latents (layer/held.py), but a batch whose prompt phase runs a
group of rows at a time (runtime.row_groups, the default on a CPU) is joined into plain compressing
layers, which would hand attention the latents unexpanded. Each such profile is refused before any
forward, naming what is missing (`draft_refusal`; calibration leaves the default draft out there).
"""

from __future__ import annotations

from kvtool.errors import KvtoolError
from kvtool.runtime.layer.latent import latent_expanders, latent_refusal
from kvtool.runtime.layer.plan import LayerPlan

# Layer types whose cache transformers keeps and a draft's rows would stay in.
NO_DRAFT_LAYER_TYPES = ("chunked_attention", "linear_attention")


def draft_refusal(model, layer_types) -> str | None:
    """Why a draft cannot run on `model`, whose decoder layers are of `layer_types` (one line), or None."""
    kinds = sorted(set(layer_types) & set(NO_DRAFT_LAYER_TYPES))
    if kinds:
        return f"a draft is not supported on a model with {', '.join(kinds)} layers (its rows would stay in what transformers keeps there)"
    if latent_expanders(model):
        return ("a draft is not supported on a model with multi-head latent attention (a batch prepared a group of "
                "rows at a time cannot be joined into latent layers)")
    return None


def check_plans(model, profile, plans: list[LayerPlan | None]) -> None:
    """One-line KvtoolError for what `profile` asks of layers that cannot do it: a draft on a model
    with chunked or linear-attention layers or latent attention (MLA), and in MLA layers what
    `latent_refusal` names."""
    why = draft_refusal(model, profile.model.layer_types) if profile.method.draft is not None else None
    if why is not None:
        raise KvtoolError(f"{profile.model.model_type}: {why}; use a profile without one (--draft none)")
    for index in latent_expanders(model):
        why = latent_refusal(plans[index]) if index < len(plans) and plans[index] is not None else None
        if why is not None:
            raise KvtoolError(f"{profile.model.model_type}: multi-head latent attention layers do not support {why}")
