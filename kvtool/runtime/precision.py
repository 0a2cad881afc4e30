"""A budget in bytes spent on entries at a chosen precision: `KVStorage` and the profiles it makes.

`--budget` is the share of the full cache's bytes as the model stores them. A layer that stores its
kept entries at 8 bits instead of the model's own precision pays less per entry, so the same bytes
keep more of them: a float32 SmolLM2 entry (64 values per head) is 256 bytes, at int8 with its
float32 scale 68, so budget 0.1 keeps 0.1 x 256 / 68 = 0.376 of the entries. `at_storage` turns a
profile's byte budget into that share of entries, re-derived by the profile's own rule (its curves
or its uniform ratio), and records each compressing layer's formats; the profile's `budget` stays
the byte share it was asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from kvtool.errors import KvtoolError
from kvtool.profiles import Profile, fingerprint_of
from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.schema import KV_FORMATS
from kvtool.profiles.whole_cache import is_hybrid, rebudget
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
        stored = storage_format(self.keys).bytes_per_entry(head_dim, native_bytes) \
            + storage_format(self.values).bytes_per_entry(head_dim, native_bytes)
        return stored / (2 * head_dim * native_bytes)


NATIVE = KVStorage()


def native_bytes(model) -> int:
    """Bytes of one value as the model's cache stores it (its dtype's)."""
    return model.dtype.itemsize


def entries_for(budget: float, storage: KVStorage, model) -> float:
    """The share of entries `budget` (a share of the native cache's bytes) keeps at `storage`."""
    head_dim = fingerprint_of(model).head_dim
    return min(1.0, check_budget(budget) / storage.entry_share(head_dim, native_bytes(model)))


def at_storage(profile: Profile, storage: KVStorage, model, *, budget: float | None = None, source: str = "profile") -> Profile:
    """`profile`'s recipe spending `budget` (a share of the native cache's bytes; default the
    profile's own) on entries stored as `storage` says: the compressing layers' entry ratios
    re-derived for `entries_for(budget, ...)` by the profile's own rule (none when the profile is
    already at that share), each layer's formats recorded, and `budget` as the profile's budget.
    Native storage at the profile's own budget returns it unchanged."""
    budget = profile.budget if budget is None else check_budget(budget)
    if not storage.quantized:
        return profile if budget == profile.budget else rebudget(profile, budget, source=source)[0]
    if is_hybrid(profile.model):
        raise KvtoolError(f"{source}: quantized storage on a hybrid model's whole-cache budget is not supported yet; use --kv-format native")
    for name in (storage.keys, storage.values):
        try:
            storage_format(name).check(profile.model.head_dim)
        except ValueError as exc:
            raise KvtoolError(f"{source}: {exc}") from None
    entries = entries_for(budget, storage, model)
    compressing = [layer for layer in profile.layers if layer.compress]
    if entries == profile.budget:
        shaped = profile
    elif all(layer.priority_curve or layer.loss_curve for layer in compressing):
        shaped = rebudget(profile, entries, source=source)[0]  # the profile's own rule at that share
    elif len({layer.ratio for layer in compressing}) == 1:  # one ratio everywhere (uniform_profile)
        shaped = dataclasses.replace(profile, layers=tuple(
            dataclasses.replace(layer, ratio=entries) if layer.compress else layer for layer in profile.layers))
    else:
        raise KvtoolError(f"{source}: its layers carry no curves to re-derive their ratios at {storage.name}; calibrate it")
    layers = tuple(
        dataclasses.replace(layer, keys_format=storage.keys, values_format=storage.values) if layer.compress else layer
        for layer in shaped.layers
    )
    return dataclasses.replace(shaped, budget=budget, layers=layers)


def storage_of(profile: Profile) -> KVStorage | None:
    """The one storage every compressing layer of `profile` uses (None: they differ)."""
    found = {(layer.keys_format, layer.values_format) for layer in profile.layers if layer.compress}
    if not found:
        return NATIVE
    return KVStorage(*found.pop()) if len(found) == 1 else None
