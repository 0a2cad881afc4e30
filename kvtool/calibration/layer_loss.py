"""What compressing one layer costs: each layer's loss curve, measured on the choosing prompts.

For the `measured` ratio source (`kvtool.profiles.loss_budget`): on each choosing prompt, each
compressing layer alone keeps, per KV head, its top `ratio` of the prompt's entries, every other
layer keeping everything, and the rise of the reference's NLL per token over the full cache's is
that layer's loss at that ratio. Masking stands in for eviction (prompt-only compression, as
kvpress's presses are measured): the prompt runs once with full attention and is scored, then the
reference runs once per (layer, ratio), its rows seeing in that layer only the kept prompt columns.

What is kept: per KV head, the better of a column's ranks under its column sum and under the last
`WINDOW` rows' sums max-pooled over `POOL` columns (kvtool's `union` scorer, each list given half the
room), with the method's sinks and recent window always kept. The curves measure how much a layer's
prompt matters to the answer, not one recipe's scores: one measurement serves every recipe the
search tries with `ratios: measured`.

Cost: a variant that compresses layer l starts from the full run's hidden states at layer l's input,
so it runs only layers l and above (the layers below it see exactly the full run's inputs): about
half the work of a whole forward. Prompts with images are not measured (their inputs are more than
tokens); on such a model the source is not offered.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface

from kvtool.errors import KvtoolError
from kvtool.profiles import MethodSettings
from kvtool.profiles.loss_budget import LOSS_RATIOS, clean_curves
from kvtool.runtime.importance.logits import cap_, dense_attention, is_plain, layer_scale, sink_view, softmax_
from kvtool.runtime.importance.union import rank_share
from kvtool.runtime.storage import storage_format

# The kept fractions each quantized storage's loss is measured at: the lower precisions keep more
# entries at the same bytes (a float32 model's int8 entry costs 0.27 of a native one), so their
# points sit higher; at 1.0 nothing is dropped and the loss is the format's alone.
STORED_RATIOS = (0.2, 0.4, 1.0)
# kvtool's union scorer as the shipped recipes run it: a 32-row observation window, pooled over 15.
WINDOW, POOL = 32, 15
STAGE_LAYER_LOSS = "layer loss"
# The layer kinds whose prompt the reference reaches through attention alone (`measurable`).
MEASURED_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
_NAME = "kvtool_layer_loss"


@dataclass(frozen=True)
class LayerLosses:
    """Each measured layer's loss at each ratio: `deltas` per prompt, `curves` their mean cleaned
    (`loss_budget.clean_curves`; each prompt weighs the same). With storages, the same for each
    (keys, values) format pair at `stored_ratios` (1.0 among them: the format's own loss with
    nothing dropped)."""

    layers: tuple[int, ...]
    ratios: tuple[float, ...]
    deltas: np.ndarray  # [S, Lc, R]
    full_nll: tuple[float, ...]  # per prompt: the reference's NLL per token with nothing masked
    seconds: float
    stored_ratios: tuple[float, ...] = ()
    stored: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # storage -> [S, Lc, R']

    @property
    def curves(self) -> np.ndarray:
        return clean_curves(self.deltas.mean(axis=0))

    def stored_curves(self, storage: tuple[str, str]) -> np.ndarray:
        return clean_curves(self.stored[storage].mean(axis=0))


class _Attention:
    """The attention function of the measurement. 'score': a prompt forward without a cache; each
    layer's keys and values are kept, and the measured layers' per-head union scores recorded. 'mask':
    rows after that prompt (the reference, run without a cache), which see the prompt plus the
    reference up to themselves; in each layer of `keep` only its kept prompt columns: [Hkv, n], or
    [B, Hkv, n] for a batch of B variants of the reference (one mask each)."""

    def __init__(self, measured: Sequence[int], windows: dict[int, int], chunks: dict[int, int] | None = None) -> None:
        self.measured = set(measured)
        self.windows = windows  # sliding layers' windows (a row sees the columns less than this far back)
        self.chunks = chunks or {}  # chunked layers' chunk sizes (Llama 4: a row sees its own chunk's columns)
        self.mode = "score"
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.scores: dict[int, torch.Tensor] = {}
        self.keep: dict[int, torch.Tensor] = {}
        # layer -> one (keys, values) format pair per batch row (None: native), in 'mask' mode
        self.stored: dict[int, list[tuple[str, str] | None]] = {}

    def allowed(self, layer: int, first: int, rows: int, columns: int, device) -> torch.Tensor:
        """[rows, columns]: causal (row i sits at position first + i), within the layer's window."""
        position = torch.arange(first, first + rows, device=device)[:, None]
        column = torch.arange(columns, device=device)[None, :]
        allowed = column <= position
        if layer in self.windows:
            allowed &= position - column < self.windows[layer]
        if layer in self.chunks:
            allowed &= position // self.chunks[layer] == column // self.chunks[layer]
        return allowed

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        batch, hq, rows = query.shape[:3]
        layer, group = module.layer_idx, hq // key.shape[1]
        # The model's own logits: soft-capped (Gemma 2) and with sink logits (gpt-oss) where it has them.
        scaling = layer_scale(module, scaling, query, kwargs)
        if self.mode == "score":
            self.keys[layer], self.values[layer] = key, value
            first = 0
        else:
            key = torch.cat([self.keys[layer].expand(batch, -1, -1, -1), key], dim=2)
            value = torch.cat([self.values[layer].expand(batch, -1, -1, -1), value], dim=2)
            first = key.shape[2] - rows
            if layer in self.stored:
                key, value = _stored_rows(key, value, self.stored[layer])
        allowed = self.allowed(layer, first, rows, key.shape[2], query.device).expand(batch, hq, rows, key.shape[2])
        if self.mode == "mask" and layer in self.keep:
            keep = self.keep[layer]
            keep = keep[None] if keep.dim() == 2 else keep
            allowed = allowed.clone()
            allowed[..., :first] &= keep.repeat_interleave(group, dim=1)[:, :, None, :]
        if not is_plain(scaling) and not (self.mode == "score" and layer in self.measured):
            out = dense_attention(query, key, value, allowed, scaling)  # per-head kept columns: [B, Hq, q, k]
            return out, None
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        if self.mode == "score" and layer in self.measured:
            logits = cap_((query @ key.transpose(-1, -2)) * float(scaling), scaling)
            probs = softmax_(logits.masked_fill(~allowed, float("-inf")), sink_view(scaling, (1, hq, 1, 1), logits.dtype, logits.device))
            per_kv = probs[0].float().view(-1, group, rows, rows)
            sums = per_kv.sum(dim=2).mean(dim=1)  # [Hkv, n]
            window = per_kv[:, :, -WINDOW:, :].sum(dim=2).mean(dim=1)
            window = torch.nn.functional.max_pool1d(window[:, None, :], POOL, stride=1, padding=POOL // 2)[:, 0]
            valid = torch.ones(1, rows, dtype=torch.bool, device=query.device)
            self.scores[layer] = torch.maximum(rank_share(sums[None], valid), rank_share(window[None], valid))[0]
            out = probs @ value
        else:
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=float(scaling))
        return out.transpose(1, 2).contiguous(), None


def _stored_rows(key: torch.Tensor, value: torch.Tensor, storages: list[tuple[str, str] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, N, D] keys and values with row b's entries (the prompt's and the reference's own) as
    they read back from storage b: the runtime stores every entry it keeps, the new tokens' too."""
    key, value = key.clone(), value.clone()
    trips: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for row, storage in enumerate(storages):
        if storage is None:
            continue
        if storage not in trips:  # every row of one storage reads the same round trip
            k_fmt, v_fmt = (storage_format(name) for name in storage)
            trips[storage] = (k_fmt.decode(k_fmt.encode(key[row]), key.dtype), v_fmt.decode(v_fmt.encode(value[row]), value.dtype))
        key[row], value[row] = trips[storage]
    return key, value


def keep_mask(score: torch.Tensor, ratio: float, method: MethodSettings) -> torch.Tensor:
    """[Hkv, n] each head's top ceil(ratio · n) columns by `score`, sinks and recent window first."""
    n = score.shape[-1]
    protected = torch.zeros(n, dtype=torch.bool, device=score.device)
    protected[: method.sink_tokens] = True
    protected[max(0, n - method.recent_window) :] = True
    ranked = score.masked_fill(protected[None], float("inf"))
    k = min(n, math.ceil(ratio * n - 1e-9))
    return torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ranked.topk(k, dim=1).indices, True)


class _Layers:
    """The decoder's layers run from any one of them on a recorded input: each layer's call (its
    arguments besides the hidden states) is captured by a forward pre-hook during a whole forward,
    then replayed, followed by the final norm and the output head."""

    def __init__(self, model: Any) -> None:
        self.model = model
        decoder = model.get_decoder()
        if not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):  # Llama 4's is the model itself
            decoder = next(m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
        self.layers = decoder.layers
        self.norm = next(getattr(decoder, name) for name in ("norm", "final_layernorm", "norm_f") if hasattr(decoder, name))
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        self.calls: list[tuple[tuple, dict]] = []
        self.inputs: list[torch.Tensor] = []

    def record(self, **forward: Any) -> torch.Tensor:
        """A whole forward of the model with `forward`'s arguments, every layer's call and input kept;
        its logits."""
        self.calls, self.inputs = [None] * len(self.layers), [None] * len(self.layers)

        def capture(index):
            def hook(module, args, kwargs):
                self.inputs[index] = args[0] if args else kwargs["hidden_states"]
                self.calls[index] = (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})
            return hook

        handles = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        try:
            return self.model(**forward).logits
        finally:
            for handle in handles:
                handle.remove()

    def from_layer(self, first: int, batch: int = 1) -> torch.Tensor:
        """The logits when the layers from `first` up run again on the recorded input of `first`
        (`batch` copies of it side by side: [batch, m, V])."""
        hidden = self.inputs[first].expand(batch, -1, -1)
        for index in range(first, len(self.layers)):
            args, kwargs = self.calls[index]
            hidden = self.layers[index](hidden, *args, **kwargs)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        logits = self.head(self.norm(hidden))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def nll_per_token(logits: torch.Tensor, reference: torch.Tensor) -> float | list[float]:
    """The reference's NLL per token after its first (whose logits are the prompt's last row's, the
    same under every variant); logits [B, m, V] of the reference's own rows: a float for B = 1,
    else one per row."""
    target = reference[1:].expand(logits.shape[0], -1)
    scored = logits[:, :-1]
    # The logsumexp at the logits' own precision, the difference in float64: a float64 log-softmax over
    # SmolLM2's 49,152 words cost 36 ms a call against 6 ms, for NLLs equal to 1e-7, about 5 s of
    # `kvtool calibrate smollm2 --budget 0.2`'s 180 calls.
    total = torch.logsumexp(scored, dim=-1).double() - scored.gather(2, target[..., None])[..., 0].double()
    nll = total.mean(dim=1)
    return float(nll[0]) if len(nll) == 1 else nll.tolist()


def measurable(model: Any) -> str | None:
    """Why this model's layer losses cannot be measured here (None: they can)."""
    text = model.config.get_text_config(decoder=True)
    if text is not model.config:
        return "the measured ratio source runs on text models only"
    # A reference run after the prompt without a cache sees the prompt only through attention: a
    # linear-attention or Mamba layer would have carried it in a state this measurement does not replay.
    other = sorted(set(getattr(text, "layer_types", None) or ()) - set(MEASURED_KINDS))
    if other:
        return f"the measured ratio source runs on attention layers only (this model has {', '.join(other)} layers)"
    return None


def prompt_rows(states: Sequence[Any], tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt ids, reference ids) of every row of the choosing batches with a reference of at least
    two scored tokens (the first `tokens` of them) and no image inputs."""
    rows = []
    for state in states:
        batch, refs = state.batch, state.references
        if getattr(batch, "extras", None):
            continue
        for r in range(batch.input_ids.shape[0]):
            ids = batch.input_ids[r][batch.attention_mask[r].bool()]
            ref = refs.tokens[r][refs.scored[r]][:tokens]
            if len(ref) >= 2:
                rows.append((ids, ref))
    return rows


@torch.no_grad()
def measure_layer_losses(
    model: Any,
    states: Sequence[Any],
    method: MethodSettings,
    layers: Sequence[int],
    *,
    ratios: Sequence[float] = LOSS_RATIOS,
    tokens: int = 32,
    progress: Callable[[str, int, int], None] | None = None,
    storages: Sequence[tuple[str, str]] = (),
    stored_ratios: Sequence[float] = STORED_RATIOS,
) -> LayerLosses:
    """`LayerLosses` of `layers` at `ratios` over the choosing batches `states` (`passes.PromptState`:
    their prompts and references, the first `tokens` of each), and at `stored_ratios` for each
    quantized (keys, values) format pair of `storages`: the same masks, the layer's entries read
    back from that storage."""
    storages = [tuple(s) for s in storages if tuple(s) != ("native", "native")]
    variants = [(None, float(r)) for r in ratios] + [(s, float(r)) for s in storages for r in stored_ratios]
    started = time.perf_counter()
    rows = prompt_rows(states, tokens)
    if not rows:
        raise KvtoolError(
            "ratios from measured loss need a choosing prompt without images whose reference has 2 tokens or more; "
            "leave them out with --space ratio_sources=scorer,attention-sum,uniform"
        )
    config = model.config.get_text_config(decoder=True)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    windows = {i: config.sliding_window for i, kind in enumerate(kinds) if kind == "sliding_attention"}
    chunks = {i: config.attention_chunk_size for i, kind in enumerate(kinds) if kind == "chunked_attention"}
    attention = _Attention(layers, windows, chunks)
    AttentionInterface.register(_NAME, attention)
    previous = config._attn_implementation
    runner = _Layers(model)
    deltas, full = [], []
    report = progress or (lambda *_: None)
    report(STAGE_LAYER_LOSS, 0, len(rows))
    model.set_attn_implementation(_NAME)
    try:
        for done, (ids, ref) in enumerate(rows, start=1):
            n, m = len(ids), len(ref)
            attention.mode = "score"
            model(input_ids=ids[None], use_cache=False, logits_to_keep=1)  # only its keys, values and scores are read
            attention.mode, attention.keep = "mask", {}
            positions = torch.arange(n, n + m, device=ids.device)[None]
            logits = runner.record(input_ids=ref[None], position_ids=positions, use_cache=False)
            base = nll_per_token(logits, ref)
            per_layer = []
            for layer in layers:
                # Every ratio of a layer at once, as a batch (one row per ratio): the same sums, fewer calls.
                attention.keep = {layer: torch.stack([keep_mask(attention.scores[layer], ratio, method) for _, ratio in variants])}
                if storages:
                    attention.stored = {layer: [storage for storage, _ in variants]}
                nll = nll_per_token(runner.from_layer(layer, batch=len(variants)), ref)
                per_layer.append([v - base for v in (nll if isinstance(nll, list) else [nll])])
                attention.stored = {}
            deltas.append(per_layer)
            full.append(base)
            attention.keys.clear(), attention.values.clear(), attention.scores.clear()
            report(STAGE_LAYER_LOSS, done, len(rows))
    finally:
        model.set_attn_implementation(previous)
    measured = np.array(deltas, dtype=np.float64)  # [S, Lc, variants]
    native, per = len(ratios), len(stored_ratios)
    return LayerLosses(
        layers=tuple(layers), ratios=tuple(float(r) for r in ratios), deltas=measured[:, :, :native],
        full_nll=tuple(full), seconds=time.perf_counter() - started,
        stored_ratios=tuple(float(r) for r in stored_ratios) if storages else (),
        stored={s: measured[:, :, native + k * per: native + (k + 1) * per] for k, s in enumerate(storages)},
    )
