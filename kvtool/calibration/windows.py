"""The window stage: how a hybrid model's whole-cache budget is split between its layer types.

A sliding-window layer can keep a shorter window and every entry it gives up goes to the
full-attention layers (`profiles.whole_cache`). Calibration's windows are scored
(`LayerProfile.scored`): the entries of the model's own window that the prompt's last row attended
most, not simply the most recent (what engines accept per layer): on
Gemma 3's calibration prompts at 0.2 the scored windows measured lower PPL at every rung tried, on
the prompts that choose and on the held-out ones (`benchmarks/window_rules.py`). They keep no sinks:
the model's own sliding layers never attend to the first tokens of a long prompt, and 4 sinks
measured 4x the PPL of none at every rung there.

Which split loses least is measured, not assumed: every window of a ladder
(the model's own, half and a quarter of it, 64, 32) whose split the budget can pay for is run
as it will ship on the prompts that chose the recipe: each batch's recorded prompt cut to the split
(`truncation.compress_recorded_prompt`: the prompt's attention is the model's own window whatever a
layer keeps afterwards, so the full pass's record serves every rung), then the references
teacher-forced through it, the rungs side by side (`passes.recipe_ppls`). The lowest PPL wins, and
the held-out prompts report it beside the model's own windows' (or the widest that fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtool.calibration.passes import Progress, PromptState, StageCounter, recipe_ppls, reference_steps
from kvtool.errors import KvtoolError
from kvtool.profiles import Profile
from kvtool.profiles import whole_cache

STAGE_WINDOWS = "window stage"


@dataclass(frozen=True)
class WindowChoice:
    profile: Profile  # the shipped split
    ppl: dict[int, float]  # window (entries) -> PPL on the prompts that chose
    held_out: dict[int, float]  # the pick and the widest window tried -> PPL on the held-out prompts


def ladder(profile: Profile) -> list[int]:
    """Windows tried, widest first: the model's own (window - 1 entries), 1/2, 1/4, 64, 32 (or a quarter of a smaller own)."""
    native = whole_cache.native_window(profile.model)
    least = whole_cache.smallest_window(profile.model)
    rungs = [native, native // 2, native // 4, 64, least]
    return sorted({w for w in rungs if least <= w <= native}, reverse=True)


def splits(profile: Profile, budget: float, tokens: int) -> dict[int, Profile]:
    """Every ladder window the budget can pay for, as the profile that ships it; a budget below the
    floor is the one-line error `with_windows` gives."""
    out, last_error = {}, None
    for window in ladder(profile):
        try:
            out[window] = whole_cache.with_windows(profile, budget, window, tokens=tokens, scored=True, source="calibrate")
        except KvtoolError as exc:
            last_error = exc
    if not out:
        raise last_error
    return out


def choose_windows(
    model: Any, profile: Profile, budget: float, tokens: int, choosing: Sequence[PromptState],
    confirming: Sequence[PromptState], progress: Progress,
) -> WindowChoice:
    """The split with the lowest PPL on `choosing` (see the module)."""
    candidates = splits(profile, budget, tokens)
    if len(candidates) == 1 or not choosing:
        window, chosen = next(iter(candidates.items()))
        return WindowChoice(chosen, {}, {})
    windows = list(candidates)
    profiles = [replace(candidates[w], method=replace(candidates[w].method, draft=None)) for w in windows]
    bar = StageCounter(STAGE_WINDOWS, reference_steps(choosing) * len(profiles), progress).start()
    ppls = _side_by_side(model, profiles, choosing, bar.step)
    bar.finish()
    ppl = {w: round(float(p), 4) for w, p in zip(windows, ppls)}
    best = min(windows, key=lambda w: ppl[w])
    held_out = {}
    if confirming:
        pair = [best] + ([windows[0]] if windows[0] != best else [])
        confirm = StageCounter(STAGE_WINDOWS + ", held-out", reference_steps(confirming) * len(pair), progress).start()
        got = _side_by_side(model, [profiles[windows.index(w)] for w in pair], confirming, confirm.step)
        confirm.finish()
        held_out = {w: round(float(p), 4) for w, p in zip(pair, got)}
    return WindowChoice(candidates[best], ppl, held_out)


def _side_by_side(model: Any, profiles: Sequence[Profile], states: Sequence[PromptState], on_step) -> list[float]:
    """`recipe_ppls` of `profiles`, run side by side where their sliding layers are of one kind: the
    model's own window is transformers' layer, a shorter one kvtool's, and a grouped cache holds one
    kind per layer index."""
    kinds: dict[bool, list[int]] = {}
    for i, profile in enumerate(profiles):
        kinds.setdefault(whole_cache.profile_window(profile) is None, []).append(i)
    ppl: dict[int, float] = {}
    for members in kinds.values():
        ppl.update(zip(members, recipe_ppls(model, [profiles[i] for i in members], states, on_step)))
    return [ppl[i] for i in range(len(profiles))]
