"""The storage stage: the searched recipe at each uniform storage of `--kv-formats`, at the same bytes.

The recipe search spends the budget's bytes per layer only through the `measured` ratio source
(each layer's storage and share by its own measured loss, summed as if layers were independent).
A layer's loss measured alone says little about how 30 starved layers add up over a long answer,
so the shipped recipe is also measured with every layer storing one format, its entries re-derived
to the same bytes (`precision.at_storage`, what `kvtool eval --kv-format` runs): on the prompts that
choose, the lowest PPL wins; the held-out prompts then confirm it against the search's own profile,
which ships where they do not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtool.calibration.passes import Progress, PromptState, StageCounter, recipe_ppls, reference_steps
from kvtool.profiles import Profile
from kvtool.profiles.schema import StorageTrial
from kvtool.runtime.precision import KVStorage, at_storage

STAGE_STORAGE = "storage"
AS_SEARCHED = "as searched"  # the recipe search's own profile: its layers' formats as it chose them


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
    """`searched` against itself at each quantized storage of `storages`, all at `budget`'s bytes."""
    candidates = {AS_SEARCHED: searched}
    for storage in storages:
        if storage.quantized:
            candidates[storage.name] = at_storage(searched, storage, model, budget=budget, source="--kv-formats")
    names = list(candidates)
    bar = StageCounter(STAGE_STORAGE, reference_steps(choosing) + 2 * reference_steps(confirming), progress).start()
    ppl = dict(zip(names, recipe_ppls(model, [candidates[n] for n in names], choosing, bar.step)))
    best = min(names, key=lambda n: (ppl[n], n != AS_SEARCHED))
    held: dict[str, float] = {}
    if confirming:
        judged = list(dict.fromkeys((best, AS_SEARCHED)))
        held = dict(zip(judged, recipe_ppls(model, [candidates[n] for n in judged], confirming, bar.step)))
    bar.finish()
    shipped = best if not held or held[best] <= held[AS_SEARCHED] else AS_SEARCHED
    trials = tuple(
        StorageTrial(storage=n, ppl=ppl[n], held_out_ppl=held.get(n), shipped=True if n == shipped else None) for n in names
    )
    return StorageChoice(profile=candidates[shipped], trials=trials)
