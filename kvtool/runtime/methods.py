"""Named compression methods: kvtool's own and the baselines the papers compare against.

A method is a recipe of runtime rules (which prompt tokens stay, how the rest are merged, which entry
goes during generation) plus where the per-layer ratios come from. `method_profile` turns a name and
a budget into a profile the runtime applies like any other, so every method runs through the same
cache, attention function and memory accounting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtool.errors import KvtoolError
from kvtool.profiles import MethodSettings, Profile
from kvtool.runtime.attach import uniform_profile
from kvtool.runtime.precision import NATIVE, KVStorage, at_storage, storage_of
from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.whole_cache import rebudget


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    per_layer: bool  # calibrated per-layer ratios (PrefixKV) instead of the same ratio in every layer
    selection: str
    merge: str | None  # None: the calibrated profile's merge mode (calibration picks it with D)
    eviction: str | None  # None: the calibrated profile's (recipe methods)
    # Query-aware methods score prompt tokens by the attention of the last `window` prompt rows.
    scorer: str = "attention-sum"
    window: int = 32
    pool: int = 7
    heads: str = "shared"
    # The calibrated recipe as it is: every rule and the ratios from the profile (`kvtool`).
    recipe: bool = False
    # Recipe methods: the prompt compressed once, by its own attention, without the profile's draft.
    no_draft: bool = False


# The calibrated recipe: what `generate`, `eval` and `bench` run by default.
DEFAULT_METHOD = "kvtool"

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            DEFAULT_METHOD,
            "kvtool's calibrated recipe: the rules (generation rule, scorer, heads, recent share, merge, D) "
            "and per-layer ratios calibration chose for this model and budget",
            True, "importance", None, None, recipe=True,
        ),
        Method(
            "kvtool-prompt-only",
            "kvtool's calibrated recipe compressing the prompt only: nothing is evicted while generating "
            "(the cache grows by the new tokens), like kvpress's presses",
            True, "importance", None, "prompt-only", recipe=True,
        ),
        Method(
            "kvtool-no-draft",
            "kvtool's calibrated recipe compressing the prompt once, by the prompt's own attention (no draft)",
            True, "importance", None, None, recipe=True, no_draft=True,
        ),
        Method("local", "StreamingLLM: sink tokens plus the most recent ones", False, "recent", "none", "sliding"),
        Method(
            "h2o",
            "Heavy-Hitter Oracle: half recent, half most accumulated attention (updated while generating)",
            False,
            "heavy-hitter",
            "none",
            "heavy-hitter",
        ),
        Method("elastic", "Elastic Cache: one ratio in every layer, importance anchors, merging", False, "importance", "position", "fixed-point"),
        Method(
            "prefixkv",
            "PrefixKV: per-layer ratios from attention-sum Lorenz curves, importance anchors shared by the heads, "
            "fixed-point eviction, the calibrated merge mode and D",
            True,
            "importance",
            None,
            "fixed-point",
        ),
        Method("prefixkv-merge", "PrefixKV ratios with Elastic Cache's position merging", True, "importance", "position", "fixed-point"),
        Method("prefixkv-evict", "PrefixKV: calibrated per-layer ratios, eviction only", True, "importance", "none", "fixed-point"),
        Method(
            "tova",
            "TOVA: one ratio in every layer; the last prompt token's attention picks the prompt entries, "
            "then the entry the current token attends least goes (averaged over heads)",
            False, "importance", "none", "tova", scorer="window", window=1, pool=1,
        ),
        Method(
            "snapkv",
            "SnapKV (prompt-only): each KV head keeps the entries the last 32 prompt rows attend most "
            "(max-pooled over 7 positions); nothing is evicted while generating",
            False, "importance", "none", "prompt-only", scorer="window", window=32, pool=7, heads="per-head",
        ),
        Method(
            "lookm",
            "LOOK-M: one ratio in every layer, text-prior anchors, pivotal merging by key similarity",
            False,
            "text-prior",
            "similarity-pivot",
            "fixed-point",
        ),
    )
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KvtoolError(f"unknown method {name!r} (known: {', '.join(METHODS)})") from None


def method_profile(name: str, model, budget: float, calibrated: Profile | None = None, storage: KVStorage | None = None) -> Profile:
    """The profile that applies method `name` at `budget` to `model`, its kept entries stored as
    `storage` says (at the same bytes: `precision.at_storage`). Without a `storage`, `kvtool`'s
    recipe keeps the formats it was calibrated with and every other method the model's own.

    Per-layer methods need `calibrated` (its ratios are re-derived for `budget` from the stored curves:
    `kvtool` from its scorer's, the PrefixKV methods from the attention-sum ones); the others use the
    same ratio in every layer. Sinks, recent window and truncation distance come from `calibrated`
    when given, so methods differ only in what their names say. `kvtool` is the profile's own recipe.
    """

    method = get_method(name)
    budget = check_budget(budget)
    if method.per_layer:
        if calibrated is None:
            raise KvtoolError(f"method {name!r} needs a calibrated profile (kvtool calibrate MODEL --budget B)")
        if method.recipe:
            profile = calibrated if budget == calibrated.budget else rebudget(calibrated, budget, source=name)[0]
            rules = profile.method
            if method.eviction is not None:
                rules = dataclasses.replace(rules, eviction=method.eviction)
            if method.no_draft:
                rules = dataclasses.replace(rules, draft=None)
            profile = profile if rules == profile.method else dataclasses.replace(profile, method=rules)
            return at_storage(profile, storage, model, source=name)
        # PrefixKV's ratios come from attention-sum curves, whatever scorer the recipe chose, over
        # entries at the model's own precision (the curves count entries, not bytes).
        if storage_of(calibrated) != NATIVE:
            calibrated = at_storage(calibrated, NATIVE, model, source=name)
        base_method = calibrated.method
        own = (
            budget == calibrated.budget
            and (base_method.ratios == "attention-sum" or (base_method.ratios == "scorer" and base_method.scorer == "attention-sum"))
        )
        profile = calibrated if own else rebudget(calibrated, budget, source=name, importance_curves=True)[0]
    else:
        profile = uniform_profile(model, budget)
    base = calibrated.method if calibrated is not None else MethodSettings()
    return at_storage(dataclasses.replace(profile, method=method_settings(name, base)), storage or NATIVE, model, source=name)


def method_settings(name: str, base: MethodSettings) -> MethodSettings:
    """The rules of the named (non-recipe) method, with `base`'s sinks, recent window, D and, where
    the method leaves it to calibration, merge mode. Baselines compress right after the prompt, as
    their papers do (no draft)."""
    method = get_method(name)
    if method.recipe:
        raise KvtoolError(f"method {name!r} is the calibrated recipe, not a fixed set of rules")
    return dataclasses.replace(
        base, selection=method.selection, merge=method.merge or base.merge, eviction=method.eviction,
        scorer=method.scorer, window=method.window, pool=method.pool, heads=method.heads, recent_share=0.0,
        ratios="scorer" if method.per_layer else "uniform", draft=None,
    )
