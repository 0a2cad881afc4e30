"""What a budget means on a model whose layers store different lengths: the whole cache's share.

A sliding-window layer (Gemma 2/3, Mistral) stores at most window - 1 entries while a full-attention
layer stores every token, so "keep 20%" of a hybrid model is a statement about the sum. A profile's
`budget` is the kept share of the whole cache's bytes at `budget_tokens` prompt tokens, each layer
counted as it stores:

    sum_l kept_l(L) * share_l = budget * sum_l stored_l(L),   L = budget_tokens

with stored_l(L) = min(L, W - 1) for a sliding layer (min(L, C - 1) for a chunked one, Llama 4, which
kvtool leaves as transformers keeps it) and L for a full one; kept_l(L) is min(L, w_l)
for a window-shaped layer (its first `sinks` tokens and the most recent, w_l entries at most: what
engines accept as a per-layer window), ceil(R_l * L) for a layer kept by ratio, stored_l(L) for one
kvtool leaves alone. Given the windows, the full-attention layers' mean ratio is what is left
(`global_budget`); their per-layer ratios then come from the profile's curves as on any model.
Every layer holds the same KV heads and head size in the models kvtool names, so a layer's bytes are
its entries times `share_l`, what one of its kept entries costs over a native one
(`entry_bytes.entry_share` of its formats): 1 at the model's own precision, less where kvtool's
layer stores them quantized (a ratio layer or a window; a sliding layer keeping the model's own
window is transformers' and native). The same bytes then keep longer windows and more global
entries (`rebudget_whole`'s `from_cost`, what `runtime.precision.at_storage` uses). No torch here:
`inspect profile` reads it without loading a model.
"""

from __future__ import annotations

import dataclasses
import math

from kvtool.errors import KvtoolError
import numpy as np

from kvtool.profiles.allocation import Allocation
from kvtool.profiles.budget import MIN_RATIO, rebudget_ratios
from kvtool.profiles.byte_budget import is_quantized, rebudget_bytes
from kvtool.profiles.entry_bytes import entry_share, quantized
from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.fingerprint import CHUNKED_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION
from kvtool.profiles.schema import LayerProfile, ModelFingerprint, Profile

# Where people compress: the prompt length a hybrid profile's budget is held at unless calibration is told otherwise.
DEFAULT_BUDGET_TOKENS = 4096
# Attention sinks a window-shaped layer keeps before its most recent (or top-scored) entries: none.
# The model's own sliding layers never attend to the first tokens of a prompt longer than their
# window, so kept sinks are targets it has not met at that distance. On Gemma 3 270M, windows of 32
# with 4 sinks measured PPL 10.214 against 2.500 without on calibration's prompts
# (`benchmarks/window_rules.py gemma3-270m --variants "scored r1 p1 + window-tova,the same without
# sinks"`), and on the ~4k-token evaluation prompts `tova`'s recent windows with 4 sinks measured
# 6.492 at 0.2 against 2.027 without (`kvtool eval gemma3-270m --long-prompts 4096 --per-kind 1`).
WINDOW_SINKS = 0
# No window goes below this many entries: its sinks and a short recent queue.
MIN_WINDOW = 32


def is_hybrid(fingerprint: ModelFingerprint) -> bool:
    """True for models with sliding-window layers (every layer of a Mistral-style model, or some)."""
    return fingerprint.sliding_window is not None and SLIDING_ATTENTION in fingerprint.layer_types


def native_window(fingerprint: ModelFingerprint) -> int:
    """Entries transformers' sliding layer stores at most (window - 1)."""
    return int(fingerprint.sliding_window) - 1


def smallest_window(fingerprint: ModelFingerprint) -> int:
    """The shortest window kvtool gives a sliding layer: MIN_WINDOW, or a quarter of a smaller model's own."""
    return min(MIN_WINDOW, max(2, native_window(fingerprint) // 4))


# Layer types that hold no per-token entries: the fixed-size conv and recurrent state of
# linear-attention and Mamba layers, and layers without attention. They are outside the budget's
# denominator (runtime/memory.py counts bytes the same way).
NO_ENTRIES = ("linear_attention", "moe", "mlp")


def stored(kind: str, tokens: int, fingerprint: ModelFingerprint) -> int:
    """Entries the full cache's layer of `kind` holds after `tokens` tokens."""
    if kind in NO_ENTRIES:
        return 0
    if kind == CHUNKED_ATTENTION and fingerprint.attention_chunk_size is not None:
        # transformers' chunked layer (Llama 4) keeps chunk - 1 entries, as a sliding one its window
        # - 1; kvtool leaves it so (it is never given a window).
        return min(tokens, fingerprint.attention_chunk_size - 1)
    return min(tokens, native_window(fingerprint)) if kind == SLIDING_ATTENTION and is_hybrid(fingerprint) else tokens


def kept(layer: LayerProfile, kind: str, tokens: int, fingerprint: ModelFingerprint) -> int:
    """Entries the layer keeps after `tokens` tokens under the profile (the runtime's count)."""
    if layer.window is not None:
        return min(tokens, layer.window)
    if not layer.compress or layer.ratio >= 1.0 or kind in NO_ENTRIES:
        return stored(kind, tokens, fingerprint)
    return min(tokens, max(1, math.ceil(layer.ratio * tokens - 1e-9)))


def in_kvtool(layer: LayerProfile) -> bool:
    """Whether kvtool's layer stores it (a ratio or a window), so its formats apply; else transformers' (native)."""
    return layer.compress or layer.window is not None


def cost(layer: LayerProfile, profile: Profile, source: str = "profile") -> float:
    """A kept entry's bytes over a native one's: its formats' where kvtool stores the layer, else 1."""
    if not (in_kvtool(layer) and quantized(layer)):
        return 1.0
    if profile.native_bytes is None:
        raise KvtoolError(f"{source}: its layers store quantized entries but it does not say the model's native_bytes")
    return entry_share(layer.keys_format, layer.values_format, profile.model.head_dim, profile.native_bytes)


def window_formats(profile: Profile) -> tuple[str, str]:
    """The (keys, values) formats a window of `profile` is stored in: its windows', else what its ratio
    layers store (a window is kvtool's layer too), else native."""
    windows = [layer for layer in profile.layers if layer.window is not None]
    for layer in (*windows, *[layer for layer in profile.layers if layer.compress]):
        return layer.keys_format, layer.values_format
    return "native", "native"


def window_cost(profile: Profile) -> float:
    """What one entry of `profile`'s sliding layers costs over a native one (1: they keep the model's own window)."""
    layer = next((layer for layer in profile.layers if layer.window is not None), None)
    return 1.0 if layer is None else cost(layer, profile)


def shares(profile: Profile, tokens: int | None = None) -> dict[str, float]:
    """Kept share of the whole cache's bytes ("all") and of each layer type's at `tokens` (default:
    the profile's reference length, or 4096)."""
    tokens = tokens or profile.budget_tokens or DEFAULT_BUDGET_TOKENS
    model = profile.model
    kinds = model.layer_types or (FULL_ATTENTION,) * len(profile.layers)
    totals: dict[str, list[float]] = {}
    for kind, layer in zip(kinds, profile.layers):
        row = totals.setdefault(kind, [0, 0])
        row[0] += kept(layer, kind, tokens, model) * cost(layer, profile)
        row[1] += stored(kind, tokens, model)
    result = {kind: k / s for kind, (k, s) in totals.items() if s}
    kept_all, stored_all = (sum(v[i] for v in totals.values()) for i in (0, 1))
    result["all"] = kept_all / stored_all if stored_all else 1.0
    return result


def global_budget(profile: Profile, budget: float, tokens: int) -> float:
    """The full-attention layers' mean ratio that makes the whole cache's bytes `budget` at `tokens`,
    given the windows `profile` gives its sliding layers (weighted by each layer's entry cost where
    their formats differ); above 1 where the windows alone leave more room."""
    model = profile.model
    total = sum(stored(kind, tokens, model) for kind in model.layer_types)
    fixed = sum(kept(layer, kind, tokens, model) * cost(layer, profile)
                for kind, layer in zip(model.layer_types, profile.layers) if not layer.compress)
    weight = sum(cost(layer, profile) for layer in profile.layers if layer.compress)
    if not weight:
        return math.inf if fixed <= budget * total else -math.inf
    return (budget * total - fixed) / (weight * tokens)


def floor(fingerprint: ModelFingerprint, tokens: int, costs: list[float] | None = None) -> float:
    """The smallest whole-cache budget kvtool reaches at `tokens`: every sliding layer at MIN_WINDOW,
    every full one at MIN_RATIO, each layer's entries at `costs` (its entry's bytes over a native
    one's; default 1: the model's own precision)."""
    total = sum(stored(kind, tokens, fingerprint) for kind in fingerprint.layer_types)
    smallest = smallest_window(fingerprint) if is_hybrid(fingerprint) else MIN_WINDOW
    costs = costs or [1.0] * len(fingerprint.layer_types)
    least = sum(
        (min(tokens, smallest) if kind == SLIDING_ATTENTION else max(1, math.ceil(MIN_RATIO * tokens))) * share
        for kind, share in zip(fingerprint.layer_types, costs)
    )
    return least / total


def with_windows(profile: Profile, budget: float, window: int | None, *, tokens: int, sinks: int = WINDOW_SINKS,
                 scored: bool = False, source: str = "profile", importance_curves: bool = False) -> Profile:
    """`profile` at whole-cache `budget`: every sliding layer window-shaped at `window` entries (None:
    the model's own), the full-attention layers' ratios re-derived for what is left (from the stored
    curves, or uniform; `importance_curves` as in `rebudget`); `scored`: the windows keep their
    top-scored entries of the model's own window (`LayerProfile.scored`). The windows are stored as
    `window_formats` says (a sliding layer at the model's own window is transformers', native) and the
    budget counts bytes (module docstring). A split the budget cannot pay for is a one-line error
    naming the floor."""
    model = profile.model
    native = native_window(model)
    if window is not None and not (1 <= window <= native):
        raise KvtoolError(f"{source}: a sliding layer's window must be in [1, {native}], got {window}")
    keep_native = window is None or window >= native
    keys, values = ("native", "native") if keep_native else window_formats(profile)
    layers = [
        dataclasses.replace(layer, ratio=1.0, compress=False, window=None if keep_native else int(window),
                            sinks=None if keep_native else min(sinks, int(window) - 1), scored=scored and not keep_native,
                            keys_format=keys, values_format=values)
        if kind == SLIDING_ATTENTION else layer
        for kind, layer in zip(model.layer_types, profile.layers)
    ]
    shaped = dataclasses.replace(profile, layers=tuple(layers))
    share = global_budget(shaped, budget, tokens)
    # The floor's windows are kvtool's layers, stored as these windows would be.
    smallest = LayerProfile(ratio=1.0, compress=False, window=1, keys_format=window_formats(profile)[0],
                            values_format=window_formats(profile)[1])
    least = floor(model, tokens, [cost(smallest if kind == SLIDING_ATTENTION else layer, profile)
                                  for kind, layer in zip(model.layer_types, layers)])
    if budget < least - 1e-12:
        raise KvtoolError(
            f"{source}: budget {budget:g} is below what kvtool keeps of this model's cache at {tokens} tokens "
            f"(floor {least:.3f}: sliding windows of {smallest_window(model)}, full-attention layers at {MIN_RATIO:g})"
        )
    if not any(layer.compress for layer in layers):
        # Every layer slides (Mistral-style): the windows are the budget, to a whole entry.
        return dataclasses.replace(shaped, budget=budget, budget_tokens=tokens)
    if share < MIN_RATIO - 1e-12:
        if budget < least:
            raise KvtoolError(
                f"{source}: budget {budget:g} is below what kvtool keeps of this model's cache at {tokens} tokens "
                f"(floor {least:.3f}: sliding windows of {smallest_window(model)}, full-attention layers at {MIN_RATIO:g})"
            )
        raise KvtoolError(
            f"{source}: sliding windows of {window if window is not None else native} leave the full-attention layers "
            f"{max(share, 0.0):.3f} of their entries at budget {budget:g} and {tokens} tokens; give the windows less"
        )
    plain = dataclasses.replace(shaped, budget_tokens=None)  # the full layers' mean ratio, as on any model
    costs = [cost(layer, shaped) for layer in layers if layer.compress]
    if len(set(costs)) == 1:  # one format in every full layer: the mean ratio is the share
        shaped, _ = rebudget_ratios(plain, min(share, 1.0), source=source, importance_curves=importance_curves)
    else:  # formats differ per layer: their bytes' mean, spent by the profile's own rule (byte_budget)
        shaped, _ = rebudget_bytes(plain, share * sum(costs) / len(costs), source, importance_curves=importance_curves)
    return dataclasses.replace(shaped, budget=budget, budget_tokens=tokens)


def profile_window(profile: Profile) -> int | None:
    """The window a profile gives its sliding layers (None: the model's own)."""
    return next((layer.window for kind, layer in zip(profile.model.layer_types, profile.layers)
                 if kind == SLIDING_ATTENTION and layer.window is not None), None)


def rebudget_whole(profile: Profile, budget: float, source: str = "profile", importance_curves: bool = False,
                   *, from_cost: float | None = None) -> Profile:
    """A hybrid profile at another whole-cache budget: its windows scaled by the budgets' ratio in
    entries (the split calibration chose, kept in proportion; the model's own window at most),
    narrowed down to the smallest where the full layers would fall under their floor, the full
    layers' ratios solved for the rest at the profile's reference length. `from_cost`: what an entry
    of the windows cost when the split was chosen (`window_cost`; None: what they cost now), so a
    profile whose formats were changed keeps the same share of entries per byte (longer windows at int8)."""
    tokens = profile.budget_tokens or DEFAULT_BUDGET_TOKENS
    native, least = native_window(profile.model), smallest_window(profile.model)
    window = profile_window(profile) or native
    sinks = next((layer.sinks for layer in profile.layers if layer.window is not None), None)
    scored = any(layer.scored for layer in profile.layers)
    keys, values = window_formats(profile)
    new_cost = cost(LayerProfile(ratio=1.0, compress=False, window=1, keys_format=keys, values_format=values), profile, source)
    old_cost = window_cost(profile) if from_cost is None else from_cost
    scaled = max(least, min(native, math.ceil(window * (budget / new_cost) / (profile.budget / old_cost) - 1e-9)))
    tried = sorted({scaled, *[w for w in (native // 2, native // 4, least) if w < scaled]}, reverse=True)
    error = None
    for candidate in tried:
        try:
            return with_windows(profile, budget, candidate, tokens=tokens, sinks=WINDOW_SINKS if sinks is None else sinks,
                                scored=scored, source=source, importance_curves=importance_curves)
        except KvtoolError as exc:
            error = exc
    raise error


def uniform_window(budget: float, fingerprint: ModelFingerprint) -> int | None:
    """The window that keeps `budget` of a sliding layer once it is full (None at budget 1: its own)."""
    native = native_window(fingerprint)
    window = max(smallest_window(fingerprint), math.ceil(budget * native - 1e-9))
    return None if window >= native else window


def rebudget(profile: Profile, budget: float, source: str = "profile", *, importance_curves: bool = False) -> tuple[Profile, Allocation]:
    """`profile` at another budget: a hybrid profile's whole cache (`rebudget_whole`), any other's
    ratios from its curves (`budget.rebudget_ratios`). What every caller that re-budgets a profile uses."""
    budget = check_budget(budget)
    if profile.budget_tokens is None or not is_hybrid(profile.model):
        if is_quantized(profile):  # the budget is bytes: formats kept, entries re-derived (byte_budget)
            return rebudget_bytes(profile, budget, source, importance_curves=importance_curves)
        return rebudget_ratios(profile, budget, source, importance_curves=importance_curves)
    updated = rebudget_whole(profile, budget, source, importance_curves)
    full = [layer.ratio for layer in updated.layers if layer.compress]
    level = updated.calibration.retention_p if updated.calibration and updated.calibration.retention_p else float("nan")
    return updated, Allocation(p=level, ratios=np.array(full), iterations=0)
