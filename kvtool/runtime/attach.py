"""Attach a profile to a loaded model: the public runtime API."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtool.version import __version__
from kvtool.errors import KvtoolError
from kvtool.models.forward import CACHE_NAMES, passed_cache
from kvtool.models.queries import future_rotations, output_grams
from kvtool.models.vision import image_token_ids
from kvtool.profiles import (
    LayerProfile,
    MethodSettings,
    Profile,
    fingerprint_of,
    read_profile,
)
from kvtool.profiles import whole_cache
from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.whole_cache import rebudget
from kvtool.profiles.fingerprint import FULL_ATTENTION, SLIDING_ATTENTION
from kvtool.runtime import architectures, attention
from kvtool.runtime.attention import CACHE_KWARG, FORWARD_CACHE
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.draft import generate as draft_generate
from kvtool.runtime.grouped import GroupedCache
from kvtool.runtime.held import HeldCache
from kvtool.runtime.importance import LayerQueries
from kvtool.runtime.importance.logits import LogitScale, logit_terms
from kvtool.runtime.layer import LayerPlan
from kvtool.runtime.layer.kinds import LAYER_KINDS
from kvtool.runtime.layer.latent import latent_expanders
from kvtool.runtime.layer.limits import check_plans
from kvtool.runtime.layer.plan import SCORED_WINDOW_POOL, SCORED_WINDOW_ROWS
from kvtool.runtime.eviction.window_tova import WindowTova
from kvtool.runtime.eviction import EVICT_RULES, evict_rule
from kvtool.runtime.merge import merge_rule
from kvtool.runtime.selection import select_rule

log = logging.getLogger("kvtool")


def load_profile(path: str | Path, budget: float | None = None) -> Profile:
    """Read and validate a profile file (one-line KvtoolError on any problem).

    With a `budget` other than the profile's, the per-layer ratios are re-derived for it from the
    stored priority curves (no model run) and a warning line says so; a profile without curves
    cannot be re-budgeted.
    """
    profile = read_profile(path)
    check_rule_names(profile, str(path))
    if budget is None or float(budget) == profile.budget:
        return profile
    updated, allocation = rebudget(profile, budget, source=str(path))
    log.warning(
        "kvtool: %s was calibrated for budget %g; re-derived its per-layer ratios for budget %g "
        "from the stored priority curves (retention p %.4f)",
        path, profile.budget, updated.budget, allocation.p,
    )
    return updated


def check_rule_names(profile: Profile, source: str = "profile") -> None:
    """One-line KvtoolError unless every eviction rule `profile` names is registered: the profile
    layer stores the name, the registry (kvtool.runtime.eviction.EVICT_RULES) says which exist."""
    named = [("method.eviction", profile.method.eviction)]
    trials = profile.calibration.recipes if profile.calibration is not None else None
    named += [(f"calibration.recipes[{i}].eviction", trial.eviction) for i, trial in enumerate(trials or ())]
    for where, name in named:
        if name not in EVICT_RULES:
            raise KvtoolError(f"{source}: {where} must be one of {', '.join(EVICT_RULES)}, got {name!r}")
    if EVICT_RULES[profile.method.eviction].needs_queries and profile.query_stats is None:
        raise KvtoolError(
            f"{source}: the {profile.method.eviction} eviction rule needs the query statistics a calibrated profile "
            "carries (kvtool calibrate records them)"
        )


def uniform_profile(model, budget: float, method: MethodSettings | None = None) -> Profile:
    """The same kept share in every layer (Elastic Cache's setting): each full-attention layer keeps
    `budget` of its entries; on a hybrid model each sliding layer keeps a window of `budget` of its
    own (sinks and the most recent tokens), so the whole cache keeps `budget` at any length past the
    window (whole_cache.py)."""
    budget = check_budget(budget)
    fingerprint = fingerprint_of(model)
    layers = tuple(
        LayerProfile(ratio=budget if kind == FULL_ATTENTION else 1.0, compress=kind == FULL_ATTENTION)
        for kind in fingerprint.layer_types
    )
    profile = Profile(
        budget=budget,
        model=fingerprint,
        method=method or MethodSettings(),
        layers=layers,
        kvtool_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    if not whole_cache.is_hybrid(fingerprint):
        return profile
    tokens = whole_cache.DEFAULT_BUDGET_TOKENS
    window = whole_cache.uniform_window(budget, fingerprint)
    shaped = whole_cache.with_windows(
        dataclasses.replace(profile, method=dataclasses.replace(profile.method, ratios="uniform")), budget, window,
        tokens=tokens, source="uniform profile",
    )
    return dataclasses.replace(shaped, method=profile.method)


def layer_queries(model, profile: Profile) -> dict[int, LayerQueries]:
    """Each described layer's query statistics with the model's RoPE for it and the Gram matrices of
    its output projection's heads (empty without statistics)."""
    stats = profile.query_stats
    if stats is None:
        return {}
    rotations, grams = future_rotations(model), output_grams(model)
    terms = logit_terms(model)
    out = {}
    for index in stats.layers:
        mean, cov = stats.layer(index)
        rotation = rotations[index]
        if index in terms:
            # A soft-capping or sink layer's expected attention is its own softmax's (importance.expected).
            rotation = dataclasses.replace(rotation, scaling=LogitScale(rotation.scaling, *terms[index]))
        # On the layer's device (its output projection's): the expected-attention generation rule
        # reads them at every step.
        queries = LayerQueries(mean, cov, rotation, stats.future, grams.get(index), stats.pair_norms(index))
        out[index] = queries if index not in grams else queries.to(grams[index].device)
    return out


def layer_plans(profile: Profile, min_kept: int = 0, queries: dict[int, LayerQueries] | None = None) -> list[LayerPlan | None]:
    """The plan of every layer (None: left to transformers); `queries` from `layer_queries`."""
    method = profile.method
    queries = queries or {}
    rule, select, evict = merge_rule(method.merge), select_rule(method.selection), evict_rule(method.eviction)
    plans: list[LayerPlan | None] = []
    # A draft needs every layer to be kvtool's (runtime.cache): a sliding layer that keeps the model's own
    # window becomes a window of that size without sinks, which is transformers' layer entry for entry.
    own_window = LayerProfile(ratio=1.0, compress=False, window=whole_cache.native_window(profile.model), sinks=0) \
        if whole_cache.is_hybrid(profile.model) else None
    for index, (kind, layer) in enumerate(zip(profile.model.layer_types, profile.layers)):
        if kind == SLIDING_ATTENTION and layer.window is None and method.draft is not None and own_window is not None:
            layer = own_window
        if kind == SLIDING_ATTENTION and layer.window is not None:
            plans.append(window_plan(layer, profile.model))
            continue
        if layer.scored:
            raise KvtoolError(f"layer {index}: only a sliding layer given a window of its own can keep scored entries (scored: true)")
        if kind != FULL_ATTENTION or not layer.compress:
            plans.append(None)
            continue
        plans.append(
            LayerPlan(
                ratio=layer.ratio,
                merge=rule,
                sink_tokens=profile.method.sink_tokens,
                recent_window=profile.method.recent_window,
                truncation_distance=profile.method.truncation_distance,
                select=select,
                evict=evict,
                scorer=method.scorer,
                window=method.window,
                pool=method.pool,
                window_share=method.window_share,
                heads=method.heads,
                recent_share=method.recent_share,
                min_kept=min_kept,
                queries=queries.get(index),
                storage=(layer.keys_format, layer.values_format),
            )
        )
    return plans


def window_plan(layer: LayerProfile, model) -> LayerPlan:
    """A window-shaped layer: its first `sinks` tokens and a queue of the most recent, `window` in all.
    A scored one (`LayerProfile.scored`) keeps the top-scored entries of the model's own window
    instead (the layer never ranks older ones: `PromptCompression._rank_by`), and generation drops
    the entry the new token attended least, or the one leaving the model's window (`WindowTova`)."""
    native = whole_cache.native_window(model)
    rules = dict(select=select_rule("recent"), evict=evict_rule("sliding"))
    if layer.scored:
        rules = dict(select=select_rule("importance"), evict=WindowTova(native), scorer="window",
                     window=SCORED_WINDOW_ROWS, pool=SCORED_WINDOW_POOL)
    return LayerPlan(
        ratio=1.0, merge=merge_rule("none"), sink_tokens=layer.sinks or 0, recent_window=0, truncation_distance=0,
        cap=layer.window, native_window=native, storage=(layer.keys_format, layer.values_format), **rules,
    )


@dataclass
class KvtoolHandle:
    """A model switched to kvtool attention; `generate(...)` (or `model.generate` with `new_cache()`
    for a profile without a draft) per generate call, `detach()` when done."""

    model: object
    profile: Profile
    _previous: dict = field(default_factory=dict)
    _plans: list = field(default_factory=list)
    _hooks: tuple = ()  # the forward hooks that hand each call's kvtool cache to the attention
    attached: bool = True
    min_kept: int = 0  # the floor `attach` was given; caches for other profiles keep it too

    def new_cache(self, *, record_importance: bool = False) -> KvtoolCache:
        """A fresh cache for one `model.generate` call. A profile whose method drafts its answer
        (`MethodSettings.draft`) refuses: a bare cache would silently skip the draft; `generate` applies it.
        `record_importance` keeps each layer's prompt importance on the cache (calibration reads it)."""
        if self.profile.method.draft is not None:
            raise KvtoolError(
                "this profile drafts its answer before generating, which a bare cache would skip: "
                "call handle.generate(**inputs, ...) instead of model.generate(..., cache=handle.new_cache())"
            )
        return self.bare_cache(record_importance=record_importance)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """`model.generate(**kwargs)` with this profile's cache, as `kvtool generate` runs it: a fresh
        kvtool cache, the prompt first compressed with the profile's draft where it has one
        (`kvtool.runtime.draft.generate`). Tensor arguments are the model inputs (`**tokenizer(...)`),
        the rest generate's own (`max_new_tokens`, `do_sample`, ...)."""
        if any(key in kwargs for key in CACHE_NAMES):
            raise KvtoolError("handle.generate makes its own kvtool cache; leave out cache= / past_key_values=")
        inputs = {key: value for key, value in kwargs.items() if isinstance(value, torch.Tensor)}
        rest = {key: value for key, value in kwargs.items() if key not in inputs}
        return draft_generate(self.model, inputs, self.bare_cache, self.profile.method.draft, **rest)[0]

    def bare_cache(self, *, record_importance: bool = False) -> KvtoolCache:
        """A fresh cache that compresses the prompt by its own attention, whatever the profile's draft:
        for callers that run the draft themselves (`kvtool.runtime.draft.prepare`) or measure without it
        (calibration)."""
        if not self.attached:
            raise KvtoolError("this kvtool handle was detached; attach the profile again")
        plans = self._plans
        if record_importance:
            plans = [p if p is None else dataclasses.replace(p, record_importance=True) for p in plans]
        cache = KvtoolCache(self.model.config, plans, latent_expanders(self.model))
        if record_importance:
            cache.record_sliding_prompts()
        return cache

    def cache_for(self, profile: Profile) -> KvtoolCache:
        """A fresh cache that follows another profile of the same model (attention and hook serve
        every kvtool cache alike, with the handle's floor): calibration runs several recipes' caches side by side."""
        if not self.attached:
            raise KvtoolError("this kvtool handle was detached; attach the profile again")
        _check_fits(profile, self.model)
        plans = layer_plans(profile, self.min_kept, layer_queries(self.model, profile))
        check_plans(self.model, profile, plans)
        return KvtoolCache(self.model.config, plans, latent_expanders(self.model))

    def detach(self) -> None:
        if self.attached:
            for hook in self._hooks:
                hook.remove()
            self._hooks = ()
            self.model.set_attn_implementation(self._previous)
            self.attached = False

    def __enter__(self) -> "KvtoolHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


def _implementations(model) -> dict:
    """Current attn_implementation of the model and its sub-configs, in set_attn_implementation's format."""
    config = model.config
    current: dict = {"": config._attn_implementation}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and getattr(sub, "_attn_implementation", None):
            current[name] = sub._attn_implementation
    return current


def _forward_pre_hook(image_tokens: tuple[int, ...]):
    """The hook `attach` registers on the model (torch's public `register_forward_pre_hook(...,
    with_kwargs=True)`). For a call whose cache (`cache` or `past_key_values`) is a KvtoolCache it passes the cache on to
    the attention function under CACHE_KWARG (attention.py says why), and on the forward that fills
    the cache hands it the prompt's image-token mask: `input_ids` in `image_tokens` and not padding
    (vision-language models; `image_tokens` is empty for text models). Calls with any other cache
    pass through untouched. The cache is also the forward's FORWARD_CACHE until `_forward_done`."""

    def hook(module, args, kwargs):
        cache = passed_cache(kwargs)
        if not isinstance(cache, (KvtoolCache, GroupedCache, HeldCache)):
            FORWARD_CACHE.set(None)
            return None
        FORWARD_CACHE.set(cache)
        if image_tokens and isinstance(cache, KvtoolCache) and cache.awaiting_prompt:
            cache.set_image_mask(_image_mask(args, kwargs, image_tokens))
        return args, {**kwargs, CACHE_KWARG: cache}

    return hook


def _forward_done(module, args, output):
    """Clears FORWARD_CACHE when the model's forward returns or raises (`always_call`)."""
    FORWARD_CACHE.set(None)


def _image_mask(args: tuple, kwargs: dict, image_tokens: tuple[int, ...]) -> torch.Tensor | None:
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return None
    mask = torch.isin(input_ids, torch.tensor(image_tokens, device=input_ids.device))
    attention_mask = kwargs.get("attention_mask")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape:
        mask &= attention_mask.to(torch.bool)
    return mask


def _check_fits(profile: Profile, model) -> None:
    mismatches = profile.model.mismatches(fingerprint_of(model))
    if mismatches:
        raise KvtoolError(
            f"profile is for {profile.model.name} and does not fit this model ({'; '.join(mismatches)})"
        )


SUPPORTED_LAYER_TYPES = tuple(LAYER_KINDS)


def check_supported(model) -> None:
    """One-line KvtoolError for attention kvtool's function would compute differently from the model's
    own. It runs softmax(l(q k^T) + mask) v, l the layer's logit map: the scale, Gemma 2's logit
    soft-capping and gpt-oss's learned sink logits (importance/logits.py). Layer types kvtool does not
    store (`layer.kinds.LAYER_KINDS`: full, sliding-window, chunked and linear-attention layers and
    layers without attention) are refused rather than run silently wrong: Falcon-H1's and Zamba2's
    "hybrid" layers, an attention cache and a Mamba state in one, are among them."""
    fingerprint = fingerprint_of(model)
    other = sorted(set(fingerprint.layer_types) - set(SUPPORTED_LAYER_TYPES))
    if other:
        raise KvtoolError(
            f"{fingerprint.model_type}: kvtool stores {', '.join(SUPPORTED_LAYER_TYPES)} layers; this model has "
            f"{', '.join(other)} layers, which it does not support"
        )
    reason = architectures.refusal(model)  # attention kvtool's function never sees, or computes otherwise
    if reason is not None:
        raise KvtoolError(reason)


def attach(model, profile: Profile, *, min_kept: int = 0) -> KvtoolHandle:
    """Switch `model` to kvtool attention for `profile`; refuses a profile made for another model and
    attention kvtool does not compute (`check_supported`).

    `min_kept` > 0 lets every compressing layer keep at least that many entries per sequence (all of
    a shorter one): a floor for short prompts, above the budget only while ratio * T is below it."""
    _check_fits(profile, model)
    check_supported(model)
    check_rule_names(profile)
    plans = layer_plans(profile, min_kept, layer_queries(model, profile))
    check_plans(model, profile, plans)
    name = attention.register()
    previous = _implementations(model)
    config = model.config
    text_config = config.get_text_config(decoder=True)
    if text_config is config:
        model.set_attn_implementation(name)
    else:
        # Vision-language models: the language model gets kvtool attention, the vision tower keeps its own.
        target = {key: value for key, value in previous.items() if key}
        for key in target:
            if getattr(config, key, None) is text_config:
                target[key] = name
        if name not in target.values():
            raise KvtoolError(
                f"cannot find the language model's config among {config.model_type}'s sub-configs "
                f"({', '.join(target) or 'none'}); kvtool cannot switch its attention"
            )
        model.set_attn_implementation(target)
    hooks = (
        model.register_forward_pre_hook(_forward_pre_hook(image_token_ids(config)), with_kwargs=True),
        model.register_forward_hook(_forward_done, always_call=True),
    )
    return KvtoolHandle(model=model, profile=profile, _previous=previous, _plans=plans, _hooks=hooks, min_kept=min_kept)
