"""The compressing cache layer, in parts of one purpose each.

    kinds        the layer types kvtool knows (full attention, sliding window, chunked, linear
                 attention, none): the registry, and what kvtool keeps of each
    plan         LayerPlan: what one compressing layer does, built from a profile
    compressing  CompressingLayer: its state and transformers' cache-layer interface
    prompt       prompt compression: rank, select (shared or per KV head), merge, freeze
    slots        slot storage: placing a new token, growing the buffer, what attention reads
    evict        decode-time eviction: the new token's attention and the rule's victim
    fixed        fixed slots: a decode step of one static shape, for CUDA graphs
    images       image tokens of vision-language prompts
    stacking     several layers' rows as one (calibration's side-by-side recipes)
    recorded_window  a sliding layer that also records its whole prompt (calibration)
    held         HeldLayer: a layer's held prompt, read by one forward of a draft's rows
    grouped      GroupedLayer: several caches' layers as one batch (calibration's recipe search);
                 transformers' linear-attention layers there are stacked by rows instead
    latent       LatentLayer: a CompressingLayer over multi-head latent attention's cached latents
                 (DeepSeek-V2/V3), expanded by the model's own `expand_kv` where attention reads them
    limits       what a profile may not ask of some families' layers (a draft where transformers'
                 layers would keep its rows, per-head entries on latents), refused at `attach`

As in transformers' cache_utils, a cache (cache.py) is a list of such layers, one per decoder layer:
kvtool's own for the attention layers it compresses, transformers' own for the rest (chunked
windows, linear-attention and Mamba states, layers without attention). Eviction rules receive a read-only view of the entries (`eviction.EntryView`), never
the layer, so the rules import nothing from here.
"""

from kvtool.runtime.layer.compressing import CompressingLayer
from kvtool.runtime.layer.plan import HEAD_MODES, LayerPlan
from kvtool.runtime.layer.slots import ENTRY_STATE, GROWTH_SLOTS

__all__ = ["ENTRY_STATE", "GROWTH_SLOTS", "HEAD_MODES", "CompressingLayer", "LayerPlan"]
