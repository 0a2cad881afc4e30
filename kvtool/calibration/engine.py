"""What a serving engine can serve of the cache, searched under kvtool's byte budget and measured.

No serving engine keeps a different number of scored entries per layer. What vLLM and TensorRT-LLM
take per layer is a recency window (no sinks) or the full cache, and a KV dtype: vLLM one window
size for every windowed layer (`--hf-overrides` layer_types + sliding_window) and one dtype with
chosen layers left at native precision (`--kv-cache-dtype-skip-layers`); TensorRT-LLM a window per
layer (`max_attention_window`) and one dtype for all. `ENGINE_SPACES` holds that, one entry per engine.

The emulation of the engines' semantics is `engine_emulation`'s.

The search (`search_engine_recipe`): each layer's loss when it alone becomes a window of budget x
prompt tokens orders the layers; then, for every dtype the engine stores (and for vLLM the most
sensitive layers skipped at native precision), the least sensitive k layers become windows of the one
size the byte budget leaves them, for a few k; TensorRT-LLM also tries kvtool's own per-layer ratios
as per-layer windows. The lowest PPL on the prompts that choose wins and is measured on the held-out
ones, beside kvtool's shipped recipe on both (`EngineRecipe`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtool.calibration.config import DEFAULT_LONG_PROMPT_TOKENS, DEFAULT_SAMPLES, HYBRID_SAMPLES, CalibrateConfig
from kvtool.calibration.engine_emulation import (
    FP8_TENSOR, Servable, emulated_ppl, entry_share, kept_share, own_entries, reference_rows,
)
from kvtool.calibration.passes import PromptState, full_pass, full_ppl, no_progress, recipe_ppls
from kvtool.calibration.runner import CalibrationResult, calibrate, draw, encode_halves
from kvtool.data import Record, load_jsonl
from kvtool.data.long_prompts import long_prompts
from kvtool.errors import KvtoolError
from kvtool.files import check_writable
from kvtool.models.loader import as_loaded
from kvtool.profiles import MethodSettings, Profile, fingerprint_of, save_profile, whole_cache
from kvtool.profiles.kept_fraction import check_budget
from kvtool.profiles.schema import ENGINES, EngineRecipe
from kvtool.runtime.precision import native_bytes

STAGE_ENGINE = "engine"
# Shares of the layers made windows, least sensitive first (0: no window, the dtype alone).
WINDOW_SHARES = (0.0, 0.5, 0.75, 1.0)
# Choosing prompts each layer's window probe runs on: the probe only orders the layers (a forward per
# layer and prompt), the candidates are measured on all of them.
PROBE_ROWS = 3


@dataclass(frozen=True)
class EngineSpace:
    """What one engine serves: its KV dtypes by the format kvtool emulates them with, whether all
    windowed layers share one size, and whether chosen layers may stay at native precision."""

    name: str
    dtypes: dict[str, str]  # emulated format -> the engine's dtype name
    one_window: bool
    skip_layers: bool

    def dtype_of(self, fmt: str) -> str:
        return self.dtypes[fmt]

    def format_of(self, dtype: str) -> str:
        for fmt, name in self.dtypes.items():
            if name == dtype:
                return fmt
        raise KvtoolError(f"{self.name} has no KV dtype {dtype!r} kvtool emulates (known: {', '.join(self.dtypes.values())})")


ENGINE_SPACES: dict[str, EngineSpace] = {
    "vllm": EngineSpace(
        "vllm",
        # kvtool's int8 / fp8 / int4 keep one scale per token and head, as vLLM's *_per_token_head
        # dtypes do (vLLM's int4 also rotates the vector first; kvtool's does not).
        {"native": "auto", "int8": "int8_per_token_head", "fp8": "fp8_per_token_head", "int4": "int4_per_token_head"},
        one_window=True, skip_layers=True,
    ),
    "trtllm": EngineSpace("trtllm", {"native": "auto", FP8_TENSOR: "fp8"}, one_window=False, skip_layers=False),
}
assert tuple(ENGINE_SPACES) == ENGINES


def engine_space(name: str) -> EngineSpace:
    if name not in ENGINE_SPACES:
        raise KvtoolError(f"unknown engine {name!r} (known: {', '.join(ENGINE_SPACES)})")
    return ENGINE_SPACES[name]



def with_own_windows(servable: Servable, fingerprint: Any, cap: bool = True) -> Servable:
    """`servable` with each of the model's own sliding layers given its own window where `servable`
    gives it none, and with `cap` never more (vLLM's one sliding_window replaces the model's own)."""
    own = fingerprint.sliding_window
    windows = tuple(
        (own if w is None else (min(w, own) if cap else w)) if kind == "sliding_attention" and own else w
        for w, kind in zip(servable.windows, fingerprint.layer_types)
    )
    return replace(servable, windows=windows)


def _window_for(budget: float, fingerprint: Any, native: int, tokens: int, base: Servable, windowed: Sequence[int]) -> int | None:
    """The one window (tokens) the byte budget leaves the `windowed` layers once the others are paid
    for; None when nothing of at least one token fits."""
    own = own_entries(fingerprint, tokens)
    total = budget * sum(own)
    share = entry_share(base.fmt, fingerprint.head_dim, native)
    fixed = sum(
        entry_share("native" if i in base.skip else base.fmt, fingerprint.head_dim, native) * own[i]
        for i in range(len(own)) if i not in windowed
    )
    if not windowed:
        return tokens if fixed <= total + 1e-12 else None
    window = math.floor((total - fixed) / (share * len(windowed)) + 1e-9)
    return window if window >= 1 else None


def _scaled_windows(ratios: Sequence[float], budget: float, fingerprint: Any, native: int, tokens: int, fmt: str) -> Servable | None:
    """kvtool's per-layer kept shares as per-layer windows at `fmt`, scaled to spend the budget."""
    def shaped(scale: float) -> Servable:
        windows = tuple(None if math.ceil(r * scale * tokens) >= tokens else max(1, math.ceil(r * scale * tokens)) for r in ratios)
        return Servable(windows, fmt)

    low, high = 0.0, 1.0 / max(min(ratios), 1e-6)
    if kept_share(shaped(low + 1e-9), fingerprint, native, tokens) > budget:
        return None
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if kept_share(shaped(middle), fingerprint, native, tokens) <= budget else (low, middle)
    return shaped(low)


def candidates(
    space: EngineSpace, budget: float, fingerprint: Any, native: int, tokens: int, order: Sequence[int],
    ratios: Sequence[float] | None = None,
) -> list[Servable]:
    """The engine-servable caches the search measures, each within `budget` at `tokens`; `order`:
    the layers least sensitive to a window first; `ratios`: kvtool's per-layer kept shares
    (TensorRT-LLM takes them as per-layer windows)."""
    layers = len(fingerprint.layer_types)
    sliding = [i for i, kind in enumerate(fingerprint.layer_types) if kind == "sliding_attention"]
    found: dict[Servable, None] = {}
    for fmt in space.dtypes:
        skips = (0, max(1, layers // 8)) if space.skip_layers and fmt != "native" else (0,)
        for skip_count in skips:
            skip = tuple(sorted(order[::-1][:skip_count]))
            free = [i for i in order if i not in skip and i not in sliding]
            for share in WINDOW_SHARES:
                count = round(share * len(free))
                # vLLM's one sliding_window applies to the model's own sliding layers too.
                windowed = sorted(set(free[:count]) | (set(sliding) if space.one_window else set()))
                base = Servable((None,) * layers, fmt, skip)
                window = _window_for(budget, fingerprint, native, tokens, base, windowed)
                if window is None or (windowed and window >= tokens):
                    continue
                shaped = tuple(window if i in windowed else None for i in range(layers))
                found[with_own_windows(Servable(shaped, fmt, skip), fingerprint, cap=not space.one_window)] = None
        if not space.one_window and ratios is not None:
            scaled = _scaled_windows(ratios, budget, fingerprint, native, tokens, fmt)
            if scaled is not None:
                found[with_own_windows(scaled, fingerprint)] = None
    return [s for s in found if kept_share(s, fingerprint, native, tokens) <= budget + 1e-9]


@dataclass(frozen=True)
class EngineChoice:
    """The search's pick, what every candidate measured, and the record the profile keeps."""

    servable: Servable
    tried: dict[Servable, float]
    recipe: EngineRecipe
    seconds: float


def search_engine_recipe(
    model: Any,
    engine: str,
    budget: float,
    shipped: Profile,
    choosing: Sequence[PromptState],
    confirming: Sequence[PromptState] = (),
    *,
    progress: Callable[[str, int, int], None] = no_progress,
) -> EngineChoice:
    """The engine-servable cache with the lowest PPL on `choosing` within `budget` (a share of the
    model's own cache's bytes at the choosing prompts' mean length), measured on `confirming` too,
    beside `shipped` (kvtool's recipe, its prompt compressed by its own attention) on both."""
    started = time.perf_counter()
    space = engine_space(engine)
    fingerprint = fingerprint_of(model)
    native = native_bytes(model)
    rows = reference_rows(choosing)
    held = reference_rows(confirming)
    if not rows:
        raise KvtoolError("kvtool calibrate --engine needs a choosing prompt with a scored reference token")
    tokens = max(1, round(sum(len(ids) for ids, _ in rows) / len(rows)))
    layers = len(fingerprint.layer_types)
    full_layers = [i for i, kind in enumerate(fingerprint.layer_types) if kind != "sliding_attention"]
    probe = max(1, math.ceil(budget * tokens))
    total = len(full_layers) + 1
    progress(STAGE_ENGINE, 0, total)
    sensitivity = {}
    for done, layer in enumerate(full_layers, start=1):
        alone = tuple(probe if i == layer else None for i in range(layers))
        sensitivity[layer] = emulated_ppl(model, Servable(alone), rows[:PROBE_ROWS])
        progress(STAGE_ENGINE, done, total)
    order = sorted(full_layers, key=lambda i: (sensitivity[i], i))
    ratios = [layer.ratio if layer.compress and layer.window is None else 1.0 for layer in shipped.layers]
    tried_list = candidates(space, budget, fingerprint, native, tokens, order, ratios)
    if not tried_list:
        raise KvtoolError(f"no {engine}-servable cache fits budget {budget:g} at {tokens} prompt tokens (a window of one token is more)")
    total += len(tried_list)
    tried = {}
    for done, servable in enumerate(tried_list, start=len(full_layers) + 1):
        tried[servable] = emulated_ppl(model, servable, rows)
        progress(STAGE_ENGINE, done, total)
    best = min(tried_list, key=lambda s: (tried[s], -kept_share(s, fingerprint, native, tokens)))
    held_ppl = emulated_ppl(model, best, held) if held else None
    kvtool_ppl = recipe_ppls(model, [shipped], choosing)[0]
    kvtool_held = recipe_ppls(model, [shipped], confirming)[0] if confirming else None
    progress(STAGE_ENGINE, total, total)
    recipe = EngineRecipe(
        engine=engine, kv_cache_dtype=space.dtype_of(best.fmt), windows=best.window_strings(), prompt_tokens=tokens,
        kept=round(kept_share(best, fingerprint, native, tokens), 4), ppl=round(tried[best], 4), kvtool_ppl=round(kvtool_ppl, 4),
        skip_layers=tuple(str(i) for i in best.skip),
        held_out_ppl=None if held_ppl is None else round(held_ppl, 4),
        kvtool_held_out_ppl=None if kvtool_held is None else round(kvtool_held, 4),
    )
    return EngineChoice(best, tried, recipe, time.perf_counter() - started)


@dataclass(frozen=True)
class EngineCalibration:
    """`calibrate`'s result with the engine recipe recorded in its profile, the search, and the full
    cache's PPL on the prompts that chose (the same measure)."""

    result: CalibrationResult
    choice: EngineChoice
    ppl_full: float


def calibration_states(loaded: Any, config: CalibrateConfig, records: Sequence[Record], progress) -> tuple[tuple, tuple]:
    """The choosing and confirming prompt states of the prompts `calibrate` draws with `config`
    (the same draw, long prompts and references: the same seed and settings give the same prompts)."""
    hybrid = whole_cache.is_hybrid(fingerprint_of(loaded.model))
    config = replace(config, samples=config.samples or (HYBRID_SAMPLES if hybrid else DEFAULT_SAMPLES))
    _, choosing, confirming = draw(records, config)
    tokens = config.long_prompt_tokens or (DEFAULT_LONG_PROMPT_TOKENS if hybrid else None)
    if tokens is not None:
        choosing, confirming = (long_prompts(part, records, tokens, config.seed) for part in (choosing, confirming))
        config = replace(config, max_prompt_tokens=max(config.max_prompt_tokens, 2 * tokens))
    batches, answers, lengths = encode_halves(loaded, choosing, confirming, config)
    split = len([b for b in batches if b.rows[0] < len(choosing)])
    measured = full_pass(
        loaded.model, loaded.tokenizer, batches, answers, MethodSettings(),
        reference_tokens=lengths, with_references=True, progress=progress,
    )
    return measured.states[:split], measured.states[split:]


def calibrate_for_engine(
    model: Any,
    budget: float,
    engine: str,
    *,
    data: str | Path | Sequence[Record] | None = None,
    out: str | Path | None = None,
    config: CalibrateConfig | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> EngineCalibration:
    """`calibrate(model, budget, ...)` and the `engine`-servable cache searched at the same budget on
    the same prompts; the profile (written to `out` when given) records it (`calibration.engine`)."""
    engine_space(engine)  # an unknown engine or budget fails before any model work
    budget = check_budget(budget)
    dest = check_writable(out) if out is not None else None
    report = progress or no_progress
    config = (config or CalibrateConfig()).checked()
    records = tuple(data) if isinstance(data, Sequence) and not isinstance(data, str) else load_jsonl(data)
    loaded = as_loaded(model, "calibrate")
    if loaded.model.config.get_text_config(decoder=True) is not loaded.model.config:
        raise KvtoolError("kvtool calibrate --engine runs on text models only")
    result = calibrate(loaded, budget, data=records, config=config, progress=report)
    choosing, confirming = calibration_states(loaded, config, records, report)
    choice = search_engine_recipe(loaded.model, engine, budget, result.profile, choosing, confirming, progress=report)
    info = result.profile.calibration
    profile = replace(result.profile, calibration=replace(info, engine=choice.recipe))
    if dest is not None:
        save_profile(profile, dest)
    return EngineCalibration(replace(result, profile=profile, path=dest), choice, full_ppl(choosing).ppl())


def describe(run: EngineCalibration) -> str:
    """One line for the calibrate report: the engine recipe, its bytes, and its PPL beside kvtool's."""
    recipe = run.choice.recipe
    sizes = sorted({int(w) for w in recipe.windows if w != "full"})
    shape = "no windows" if not sizes else f"windows of {sizes[0]}" + (f"-{sizes[-1]}" if len(sizes) > 1 else "") + " tokens"
    full = sum(w == "full" for w in recipe.windows)
    held = (f"; held out {recipe.held_out_ppl:.3f} against kvtool's {recipe.kvtool_held_out_ppl:.3f}"
            if recipe.held_out_ppl is not None and recipe.kvtool_held_out_ppl is not None else "")
    skip = f", layers {', '.join(recipe.skip_layers)} native" if recipe.skip_layers else ""
    return (f"Engine {recipe.engine}: {shape} in {len(recipe.windows) - full} layers, {full} full, KV {recipe.kv_cache_dtype}{skip}; "
            f"{recipe.kept:.1%} of the cache's bytes at {recipe.prompt_tokens} tokens; PPL {recipe.ppl:.3f} against kvtool's "
            f"{recipe.kvtool_ppl:.3f} (full cache {run.ppl_full:.3f}, {len(run.choice.tried)} recipes tried){held}")
