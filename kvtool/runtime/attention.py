"""The `kvtool` attention implementation, registered through transformers' AttentionInterface.

For layers whose cache is a kvtool CompressingLayer it runs the normal sdpa kernel and then:
- on the prompt forward, scores and compresses that layer's cache;
- on later forwards, masks by the layer's own slot validity and evicts once the token is attended;
- for a draft's rows over a held prompt (held.py), sdpa plus the column sums those rows give.
Every other call (no cache, a plain DynamicCache, sliding-window layers) is exactly sdpa.

Soft-capping (Gemma 2: the `softcap` argument) and learned sink logits (gpt-oss: `s_aux`) change
the softmax itself, which sdpa cannot compute: the scale becomes a LogitScale that carries them
(importance/logits.py) into every score and kernel, and where this module would run sdpa it runs
the families' own eager arithmetic instead (`logits.dense_attention`), so budget 1.0 is still the model.

How the function finds its cache layer. transformers calls an AttentionInterface function with the
attention module, query/key/value, the mask, and the extra keyword arguments the model's forward
was called with (its documented way to give an attention function new inputs: "models supporting
AttentionInterface propagate kwargs to attention layers and the attention function"). The cache
itself does not arrive: the attention module takes it as a named argument (`cache`, or
`past_key_values` before transformers 5.24) and only calls its `update(key, value, self.layer_idx)`. So `attach` registers a forward
pre-hook on the model (torch's public hook API) that passes each call's KvtoolCache on under
`CACHE_KWARG`, and the attention function reads `cache.layers[module.layer_idx]`: the layer the
module has just updated, by the very index it updated it with. Each call carries its own cache, so
threads or interleaved caches cannot mix layers up. Some families' models do not pass their
forward's keyword arguments on to the attention (Falcon since transformers 5.25): for them the hook
also sets `FORWARD_CACHE`, a context variable (one value per thread) that holds the cache of the
model forward in progress and is cleared when it returns, and the function reads it when the
keyword is missing. A forward on a sub-module (say `model.model`) bypasses the hook: its kvtool
cache stays uncompressed and the next forward refuses it with a one-line error
(CompressingLayer.update).
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvtool.runtime.layer.grouped import GroupedLayer
from kvtool.runtime.layer.held import HeldLayer
from kvtool.runtime.importance import ScoreRequest, attention_with_scores, decode_attention_with_scores, prompt_scores
from kvtool.runtime.importance import chunked
from kvtool.runtime.importance.logits import dense_attention, is_plain, layer_scale
from kvtool.runtime.importance.scores import accumulation_dtype
from kvtool.runtime.layer import CompressingLayer
from kvtool.runtime.layer.recorded_window import RecordedWindowLayer

ATTENTION_NAME = "kvtool"
# The forward keyword argument that carries the KvtoolCache from the model's forward to this function.
CACHE_KWARG = "kvtool_cache"
# The same cache for models whose forward drops keyword arguments before the attention (see above).
FORWARD_CACHE: ContextVar = ContextVar("kvtool_forward_cache", default=None)


def kvtool_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    passed = kwargs.pop(CACHE_KWARG, None)
    layer = _cache_layer(module, FORWARD_CACHE.get() if passed is None else passed)
    scale = layer_scale(module, scaling, query, kwargs)
    if not is_plain(scale):
        # Honoured through `scale` from here on; sdpa_attention_forward must not see them.
        kwargs = {key: item for key, item in kwargs.items() if key not in ("softcap", "s_aux", "sinks")}
        scaling = scale
    if isinstance(layer, GroupedLayer) and layer.compressing:
        # Each block of rows attends to its own cache's slots (grouped.py).
        outputs = [
            _attend(unit, module, query[rows], unit.keys, unit.values, _rows(attention_mask, rows), dropout, scaling, kwargs)
            for unit, rows in layer.units()
        ]
        return layer.assemble([output for output, _ in outputs]), None
    if isinstance(layer, HeldLayer):
        return _attend_held(layer, module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if isinstance(layer, RecordedWindowLayer):
        layer.record_rows(query, scale)
    if not isinstance(layer, CompressingLayer):
        return _dense(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    return _attend(layer, module, query, key, value, attention_mask, dropout, scaling, kwargs)


def _attend(
    layer: CompressingLayer,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """Attention through one compressing layer that has just been updated with this call's states."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if not layer.compressed:
        scores = None
        request = layer.score_request
        if layer.compresses and _plain_softmax_attention(dropout, kwargs):
            # One pass over the probabilities gives the output and every score the layer needs.
            output, scores = attention_with_scores(query, key, value, attention_mask, scaling, request)
            out = (output, None)
        else:
            # Budget 1.0 keeps sdpa's own output bit for bit; scoring (if any) runs beside it.
            out = _dense(module, query, key, value, attention_mask, dropout, scaling, kwargs)
            if layer.scores_last_rows_only:
                scores = layer.last_rows_scores(query, key, attention_mask, scaling)
            elif layer.needs_importance:
                scores = prompt_scores(query, key, attention_mask, scaling, request)
        if layer.plan.record_importance:
            layer.record_rows(query, scaling)
        layer.compress_prompt(attention_mask, scores)
        return out
    # A window-shaped layer holds its window itself: the step attends to every entry it holds.
    kwargs.pop("sliding_window", None)
    if layer.step_token is not None:  # fixed slots stepping through triton_step
        if _plain_softmax_attention(dropout, kwargs):
            return layer.fused_step(query, scaling), None
        layer.place_step_token()
    layer.discard_padded_token(attention_mask)
    plain = _plain_softmax_attention(dropout, kwargs)
    # A folding storage hands over codes and scales straight from its rows: no decoded copy of every
    # entry each step. Only where attention runs in float32, as the decoded entries are: a float64
    # model (the tests' exact arithmetic) decodes them, so its attention is brute force's to 1e-9.
    folds = plain and layer.storage.folds and accumulation_dtype(query.dtype) == torch.float32
    key_scale = value_scale = None
    if folds:
        key, key_scale, value, value_scale, mask = layer.decode_view_scaled(torch.float32)
    else:
        key, value, mask = layer.decode_view()
    if plain and (folds or layer.needs_decode_scores):
        output, received = decode_attention_with_scores(
            query, key, value, mask, scaling, per_head=layer.decode_per_head, key_scale=key_scale, value_scale=value_scale
        )
        if layer.needs_decode_scores:
            layer.add_scores(received)
        out = (output, None)
    else:
        out = _dense(module, query, key, value, mask, dropout, scaling, kwargs)
    layer.evict_over_budget()
    return out


def _attend_held(layer: HeldLayer, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """New rows over a held prompt (held.py): the output, and the probabilities the rows give every
    column summed per KV head (k rows against n columns: a small part of a prompt pass)."""
    request = ScoreRequest(heads=True)
    if _plain_softmax_attention(dropout, kwargs):
        # One pass gives both, as in a prompt pass; on the CPU, one sequence at a time (cpu_path),
        # several times faster than the portable chunks (a draft's 64 rows over 4,160 columns: 40 ms a
        # layer against 130 ms, in `draft.prepare` at 4096 x 4 on a 2-core CPU).
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        output, scores = attention_with_scores(query, key, value, attention_mask, scaling, request)
        layer.read(scores, key, value)
        return output, None
    out = _dense(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    _, scores = chunked.chunked_scores(query, key, None, attention_mask, scaling, chunked.chunk_elements(query.device), request)
    layer.read(scores, key, value)
    return out


def _cache_layer(module: torch.nn.Module, cache):
    """The layer of `cache` this attention module just updated (kvtool's, grouped, or one kvtool
    leaves alone such as a sliding window); None for calls that carry no kvtool cache."""
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or layer_idx is None:
        return None
    return cache.layers[layer_idx]


def _rows(mask: torch.Tensor | None, rows: slice | torch.Tensor) -> torch.Tensor | None:
    return None if mask is None else mask[rows]


def _plain_softmax_attention(dropout: float, kwargs: dict) -> bool:
    """True when the fused path computes the layer's attention: softmax(l(q k^T) + mask) v with no
    dropout, sliding window or position bias, l the scale's logit map (a soft-cap and sink logits
    come in the scale, `kvtool_attention_forward`, and the fused path honours them)."""
    extras = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias")
    return dropout == 0.0 and all(kwargs.get(name) is None for name in extras)


def _dense(module, query, key, value, mask, dropout, scaling, kwargs):
    """The attention output where kvtool scores nothing: sdpa's for plain attention, else the
    soft-capping and sink families' own eager arithmetic (`logits.dense_attention`), with the causal
    mask sdpa would have implied when the mask was left out (rows the last of the keys)."""
    if is_plain(scaling):
        return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, **kwargs)
    if mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True):
        rows, columns = query.shape[2], key.shape[2]
        position = torch.arange(columns - rows, columns, device=query.device)
        mask = (torch.arange(columns, device=query.device)[None, :] <= position[:, None])[None, None]
    return dense_attention(query, key, value, mask, scaling, dropout), None


def register() -> str:
    """Make `kvtool` a valid attn_implementation; idempotent."""
    AttentionInterface.register(ATTENTION_NAME, kvtool_attention_forward)
    # Without a registered mask function the attention receives no mask, even for padded batches.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
