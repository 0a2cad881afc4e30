"""The storage stage: the searched recipe at each uniform storage of `--kv-formats`, at the same bytes.

The recipe search spends the budget's bytes per layer only through the `measured` ratio source
(each layer's storage and share by its own measured loss, summed as if layers were independent).
A layer's loss measured alone says little about how 30 starved layers add up over a long answer,
so the shipped recipe is also measured with every layer storing one format, its entries re-derived
to the same bytes (`precision.at_storage`, what `kvtool eval --kv-format` runs): on the prompts that
choose, the lowest PPL wins; the held-out prompts then confirm it against the search's own profile,
which ships where they do not.

Without a storage per layer (and on models without sliding windows) the search itself runs where
the profile will live: at the entries the first quantized format keeps at the budget's bytes
(budget 0.1 at `int8` on a float32 model of head dim 64: 0.376 of them), at the model's precision,
which 8 bits matches to a PPL ratio of 1.001 there. A recipe chosen for 0.1 of the entries is not
the one 0.376 of them want. Every candidate is then that recipe re-derived to the budget's bytes,
the model's own precision (`native`) included, which is what the held-out prompts judge against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtool.calibration.passes import Progress, PromptState, StageCounter, recipe_ppls, reference_steps
from kvtool.profiles import Profile
from kvtool.profiles.schema import StorageTrial
from kvtool.runtime.precision import KVStorage, at_storage, entries_for

STAGE_STORAGE = "storage"
AS_SEARCHED = "as searched"  # the recipe search's own profile: its layers' formats as it chose them
NATIVE_NAME = "native"  # a search at another level's recipe at the model's precision, re-derived to the budget


def search_level(budget: float, storages: Sequence[KVStorage], model: Any, *, per_layer: bool, hybrid: bool) -> float:
    """The budget the recipe search runs at: the share of entries the first quantized storage keeps
    at `budget`'s bytes, at the model's precision; `budget` itself with a storage per layer (the
    search spends the bytes), on a hybrid model (the windows share the bytes), without a quantized
    storage, or where that storage keeps every entry (nothing left to search)."""
    quantized = [s for s in storages if s.quantized]
    if per_layer or hybrid or not quantized:
        return budget
    entries = entries_for(budget, quantized[0], model)
    return budget if entries >= 1.0 else entries


@dataclass(frozen=True)
class StorageChoice:
    profile: Profile  # the one that ships
    trials: tuple[StorageTrial, ...]  # every candidate, in the order measured; the shipped one flagged

    @property
    def shipped(self) -> StorageTrial:
        """The candidate that ships (AS_SEARCHED or a format name in its `storage`)."""
        return next(t for t in self.trials if t.shipped)


def choose_storage(
    model: Any,
    searched: Profile,
    storages: Sequence[KVStorage],
    budget: float,
    choosing: Sequence[PromptState],
    confirming: Sequence[PromptState],
    progress: Progress,
) -> StorageChoice:
    """`searched` against itself at each quantized storage of `storages`, all at `budget`'s bytes
    (`searched` at its own budget, or, searched at another level, re-derived at the model's precision)."""
    own = AS_SEARCHED if searched.budget == budget else NATIVE_NAME
    candidates = {own: searched if own == AS_SEARCHED else at_storage(searched, None, model, budget=budget, source="--kv-formats")}
    for storage in storages:
        if storage.quantized:
            candidates[storage.name] = at_storage(searched, storage, model, budget=budget, source="--kv-formats")
    names = list(candidates)
    bar = StageCounter(STAGE_STORAGE, reference_steps(choosing) + 2 * reference_steps(confirming), progress).start()
    ppl = dict(zip(names, recipe_ppls(model, [candidates[n] for n in names], choosing, bar.step)))
    best = min(names, key=lambda n: (ppl[n], n != own))
    held: dict[str, float] = {}
    if confirming:
        judged = list(dict.fromkeys((best, own)))
        held = dict(zip(judged, recipe_ppls(model, [candidates[n] for n in judged], confirming, bar.step)))
    bar.finish()
    shipped = best if not held or held[best] <= held[own] else own
    trials = tuple(
        StorageTrial(storage=n, ppl=ppl[n], held_out_ppl=held.get(n), shipped=True if n == shipped else None) for n in names
    )
    return StorageChoice(profile=candidates[shipped], trials=trials)
