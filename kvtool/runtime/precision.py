"""A budget in bytes spent on entries at a chosen precision: `KVStorage` and the profiles it makes.

`--budget` is the share of the full cache's bytes as the model stores them. A layer that stores its
kept entries at 8 bits instead of the model's own precision pays less per entry, so the same bytes
keep more of them: a float32 SmolLM2 entry (64 values per head) is 256 bytes, at int8 with its
float32 scale 68, so budget 0.1 keeps 0.1 x 256 / 68 = 0.376 of the entries. `at_storage` turns a
profile's byte budget into that share of entries, re-derived by the profile's own rule (its curves
or its uniform ratio), and records each compressing layer's formats; the profile's `budget` stays
the byte share it was asked for. On a hybrid model (`profiles.whole_cache`) the windows take the
storage too and the whole cache's bytes are re-spent: windows scaled to the same entries per byte
(the model's own at most, which transformers keeps native), the global layers' ratios solved for the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from kvtool.errors import KvtoolError
from kvtool.profiles import Profile, fingerprint_of
from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.entry_bytes import entry_share
from kvtool.profiles.schema import KV_FORMATS
from kvtool.profiles import whole_cache
from kvtool.profiles.whole_cache import rebudget
from kvtool.runtime.storage import storage_format


@dataclass(frozen=True)
class KVStorage:
    """How kept keys and values are stored: one format each (names in `profiles.schema.KV_FORMATS`)."""

    keys: str = "native"
    values: str = "native"

    @classmethod
    def parse(cls, spec: str) -> "KVStorage":
        """`int8` (keys and values alike) or `KEYS/VALUES` such as `int8/int4-g32`; one-line error otherwise."""
        parts = [part.strip() for part in str(spec).split("/")]
        if len(parts) not in (1, 2) or any(part not in KV_FORMATS for part in parts):
            raise KvtoolError(f"--kv-format takes FORMAT or KEYS/VALUES with formats {', '.join(KV_FORMATS)}; got {spec!r}")
        return cls(parts[0], parts[-1])

    @property
    def name(self) -> str:
        return self.keys if self.keys == self.values else f"{self.keys}/{self.values}"

    @property
    def quantized(self) -> bool:
        return (self.keys, self.values) != ("native", "native")

    def entry_share(self, head_dim: int, native_bytes: int) -> float:
        """A stored (token, head) entry's bytes, key and value with their scales, over a native one's."""
        return entry_share(self.keys, self.values, head_dim, native_bytes)


NATIVE = KVStorage()


def native_bytes(model) -> int:
    """Bytes of one value as the model's cache stores it (its dtype's)."""
    return model.dtype.itemsize


def entries_for(budget: float, storage: KVStorage | None, model) -> float:
    """The share of entries `budget` (a share of the native cache's bytes) keeps at `storage` (None:
    as a profile's own formats say, which its budget already counts)."""
    if storage is None:
        return check_budget(budget)
    head_dim = fingerprint_of(model).head_dim
    return min(1.0, check_budget(budget) / storage.entry_share(head_dim, native_bytes(model)))


def check_storage(storage: KVStorage, head_dim: int, source: str) -> None:
    """A one-line KvtoolError when a format of `storage` cannot store vectors of `head_dim` values."""
    for name in (storage.keys, storage.values):
        try:
            storage_format(name).check(head_dim)
        except ValueError as exc:
            raise KvtoolError(f"{source}: {exc}") from None


def with_storage(profile: Profile, storage: KVStorage, model, source: str = "profile") -> Profile:
    """`profile` with every layer kvtool stores (compressing ones, and a hybrid model's windows)
    storing its entries as `storage` says, ratios and windows as they are (so its bytes change):
    what `at_storage` then re-derives at a budget. A sliding layer keeping the model's own window is
    transformers' layer and stays native."""
    check_storage(storage, profile.model.head_dim, source)
    layers = tuple(
        dataclasses.replace(layer, keys_format=storage.keys, values_format=storage.values) if whole_cache.in_kvtool(layer) else layer
        for layer in profile.layers
    )
    return dataclasses.replace(profile, layers=layers, native_bytes=native_bytes(model) if storage.quantized else None)


def at_storage(profile: Profile, storage: KVStorage | None, model, *, budget: float | None = None, source: str = "profile") -> Profile:
    """`profile`'s recipe spending `budget` (a share of the native cache's bytes; default the
    profile's own) on entries stored as `storage` says: every compressing layer's formats set, then
    its entry ratios re-derived by the profile's own rule (its curves, or one ratio everywhere) at
    the level whose bytes are `budget` (`profiles.byte_budget`). `storage` None keeps the profile's
    own formats, calibrated per layer or not. A profile already at that storage and budget returns
    unchanged (native storage at its own budget: bit for bit what it was)."""
    budget = profile.budget if budget is None else check_budget(budget)
    current = storage_of(profile)
    if storage is None or storage == current:
        return profile if budget == profile.budget else rebudget(profile, budget, source=source)[0]
    stored = with_storage(profile, storage, model, source)
    if profile.budget_tokens is not None and whole_cache.is_hybrid(profile.model):
        # The whole cache's bytes: the windows keep as many entries per byte as before their formats changed.
        was = whole_cache.window_cost(profile)
        respend = lambda shaped: whole_cache.rebudget_whole(shaped, budget, source, from_cost=was)  # noqa: E731
    else:
        respend = lambda shaped: rebudget(shaped, budget, source=source)[0]  # noqa: E731
    compressing = [layer for layer in stored.layers if layer.compress]
    if not all(layer.priority_curve or layer.scorer_curve or layer.loss_curve for layer in compressing) \
            and len({layer.ratio for layer in compressing}) == 1:
        # One ratio everywhere and no curves (uniform_profile): that ratio at the budget's entries.
        shaped = dataclasses.replace(stored, method=dataclasses.replace(stored.method, ratios="uniform"))
        return dataclasses.replace(respend(shaped), method=stored.method)
    return respend(stored)


def storage_of(profile: Profile) -> KVStorage | None:
    """The one storage every layer kvtool stores of `profile` uses (compressing ones and windows; None: they differ)."""
    found = {(layer.keys_format, layer.values_format) for layer in profile.layers if whole_cache.in_kvtool(layer)}
    if not found:
        return NATIVE
    return KVStorage(*found.pop()) if len(found) == 1 else None
