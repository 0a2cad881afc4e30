"""What a serving engine can hold of a kvtool profile (`Held`), and the interface every engine's
exporter implements (`Engine`).

Engines keep per layer a recency window without sinks or the full cache, and one KV dtype
(`kvtool.calibration.engine.ENGINE_SPACES` says which, per engine). A profile says per layer a kept
share of the prompt and a storage format. The mapping, the same for every engine:
- a full-attention layer keeping `ratio` of an N-token prompt becomes a window of ceil(ratio x N)
  tokens (a window of N or more is the full cache); N is `--prompt-tokens`, by default the mean
  length of the profile's calibration prompts (else its `budget_tokens`, else DEFAULT_PROMPT_TOKENS);
- a sliding layer keeps its window: kvtool's `window` entries plus the token being written, the
  engine's window counting that token (the model's own sliding_window where kvtool set none);
- each layer's format (the wider of its keys' and values') maps to the engine's nearest dtype
  (`Engine.nearest`); the engine stores one dtype, so the most common one wins and the rest is said.
A profile calibrated for the engine (`kvtool calibrate --engine`, `calibration.engine`) is exported
as it was measured instead, its windows scaled by N over its own prompt length when N differs.
What the engine cannot hold (scored eviction, merging, sinks, the draft, per-layer window sizes
where the engine takes one, formats it lacks) is said in one line, never silently dropped.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvtool.calibration.engine import EngineSpace, engine_space
from kvtool.errors import KvtoolError
from kvtool.profiles import Profile
from kvtool.profiles.schema import EngineRecipe

DEFAULT_PROMPT_TOKENS = 4096
# The checkpoints kvtool's model aliases are converted from (their GGUFs' sources): what an engine loads.
HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m-it"}
# Bits per value of each kvtool format, to pick the wider of a layer's keys and values.
FORMAT_BITS = {"native": 16, "int8": 8, "fp8": 8, "int4": 4, "int4-g32": 4, "int2-g32": 2}


@dataclass(frozen=True)
class Held:
    """What the engine holds of a profile, and what stays behind."""

    engine: str
    model: str
    windows: tuple[int | None, ...]  # per layer: tokens, or None for the full cache
    kv_cache_dtype: str  # the engine's own name
    skip_layers: tuple[int, ...]  # layers at native precision beside the dtype (vLLM)
    prompt_tokens: int
    mapping: str  # one sentence: how the windows were made
    behind: tuple[str, ...]  # what the engine cannot hold, one phrase each
    kept_entries: float  # share of the full cache's entries the windows keep at prompt_tokens
    measured: EngineRecipe | None = None  # the calibrated engine recipe this came from

    @property
    def stays_behind(self) -> str:
        return "; ".join(self.behind) if self.behind else "nothing"

    @property
    def holds(self) -> str:
        sizes = sorted({w for w in self.windows if w is not None})
        full = sum(w is None for w in self.windows)
        shape = ("no windows" if not sizes else
                 f"{len(self.windows) - full} windows of {sizes[0]} tokens" if len(sizes) == 1 else
                 f"{len(self.windows) - full} windows of {sizes[0]}-{sizes[-1]} tokens")
        skip = f", layers {', '.join(map(str, self.skip_layers))} at native precision" if self.skip_layers else ""
        return (f"{len(self.windows)} layers: {shape}, {full} full; KV dtype {self.kv_cache_dtype}{skip}; "
                f"{self.kept_entries:.1%} of the full cache's entries at {self.prompt_tokens} prompt tokens")


class Engine:
    """One serving engine's exporter: its space (what it serves), the nearest dtype to each kvtool
    format, whether it can serve a profile's model at all, and how its command or config reads."""

    name: str = ""

    @property
    def space(self) -> EngineSpace:
        return engine_space(self.name)

    def nearest(self, fmt: str) -> tuple[str, str | None]:
        """(the emulated format in `space.dtypes` nearest kvtool's `fmt`, how they differ or None)."""
        raise NotImplementedError

    def format_note(self, fmt: str) -> str | None:
        """How the engine's dtype emulated as `fmt` differs from kvtool's format of that name (None: alike)."""
        return self.nearest(fmt)[1] if fmt in FORMAT_BITS else None

    def check(self, profile: Profile, windows: tuple[int | None, ...]) -> None:
        """A one-line KvtoolError when the engine cannot serve these windows of this model at all."""

    def unify(self, windows: list[int | None], tokens: int) -> tuple[list[int | None], str | None]:
        """The windows as the engine takes them (vLLM: one size), and what that changed."""
        return windows, None

    def render(self, held: Held, **options: Any) -> str:
        raise NotImplementedError

    def data(self, held: Held, **options: Any) -> dict:
        raise NotImplementedError


def served_model(profile: Profile, model: str | None) -> str:
    """What the engine loads: `--model`, else the checkpoint behind kvtool's alias, else the profile's model name."""
    if model:
        return model
    return HUB_IDS.get(profile.model.name, profile.model.name)


def default_prompt_tokens(profile: Profile) -> tuple[int, str]:
    info = profile.calibration
    if info is not None and info.engine is not None:
        return info.engine.prompt_tokens, "the prompt length its engine recipe was calibrated at"
    if info is not None and info.prompt_tokens.mean > 0:
        return max(1, round(info.prompt_tokens.mean)), "the mean length of the profile's calibration prompts"
    if profile.budget_tokens is not None:
        return profile.budget_tokens, "the profile's budget_tokens"
    return DEFAULT_PROMPT_TOKENS, "kvtool export's default"


def hold(engine: Engine, profile: Profile, *, model: str | None = None, prompt_tokens: int | None = None) -> Held:
    """What `engine` holds of `profile` at `prompt_tokens` (default: `default_prompt_tokens`)."""
    if prompt_tokens is not None and prompt_tokens < 1:
        raise KvtoolError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    tokens, where = (prompt_tokens, "--prompt-tokens") if prompt_tokens is not None else default_prompt_tokens(profile)
    recorded = profile.calibration.engine if profile.calibration is not None else None
    if recorded is not None and recorded.engine == engine.name:
        return _from_recipe(engine, profile, recorded, served_model(profile, model), tokens, where)
    return _mapped(engine, profile, served_model(profile, model), tokens, where)


def _own_window(profile: Profile) -> int | None:
    return profile.model.sliding_window


def _layer_types(profile: Profile) -> tuple[str, ...]:
    """Each layer's kind (profiles made before the field existed: every layer full attention)."""
    return profile.model.layer_types or ("full_attention",) * profile.model.num_layers


def _mapped(engine: Engine, profile: Profile, model: str, tokens: int, where: str) -> Held:
    method = profile.method
    windows: list[int | None] = []
    behind: list[str] = []
    scored_layers = sinks_layers = 0
    scored = False  # whether a full-attention layer's scored entries became a window
    for kind, layer in zip(_layer_types(profile), profile.layers):
        if kind == "sliding_attention":
            windows.append(layer.window + 1 if layer.window is not None else _own_window(profile))
            scored_layers += bool(layer.scored)
            sinks_layers += bool(layer.sinks)
        elif layer.compress and layer.window is None and layer.ratio < 1.0:
            window = math.ceil(layer.ratio * tokens - 1e-9)
            windows.append(None if window >= tokens else max(1, window))
            scored |= window < tokens
        else:
            windows.append(None)
    if scored and not (method.selection == "recent" and method.eviction == "sliding"):
        behind.append(f"scored eviction ({method.selection} by {method.scorer}, {method.heads} entries, "
                      f"{method.eviction} while generating) becomes recency windows")
    if scored and method.sink_tokens:
        behind.append(f"the {method.sink_tokens} sink tokens")
    if scored and method.merge != "none":
        behind.append(f"merging ({method.merge})")
    if scored_layers:
        behind.append(f"scored entries in {scored_layers} sliding layers become their most recent")
    if sinks_layers:
        behind.append(f"the sinks of {sinks_layers} sliding layers")
    if method.draft is not None:
        behind.append(f"the {method.draft.tokens}-token draft")
    windows, unified = engine.unify(windows, tokens)
    if unified:
        behind.append(unified)
    mapping = (f"each full-attention layer's kept share x {tokens} prompt tokens ({where}), rounded up, is its window "
               f"(a window of {tokens} or more stays full)")
    dtype, skip, notes = _dtype(engine, profile)
    behind += notes
    return _held(engine, profile, model, tuple(windows), dtype, skip, tokens, mapping, behind)


def _dtype(engine: Engine, profile: Profile) -> tuple[str, tuple[int, ...], list[str]]:
    """The engine's one KV dtype for the profile's per-layer formats, its native layers, and notes."""
    per_layer, notes = [], []
    for layer in profile.layers:
        fmt = max((layer.keys_format, layer.values_format), key=lambda f: FORMAT_BITS[f])
        if fmt != "native" and (layer.keys_format != layer.values_format):
            notes.append(f"keys {layer.keys_format} / values {layer.values_format} stored alike as {fmt}")
        per_layer.append(fmt)
    mapped = []
    for fmt in per_layer:
        near, note = engine.nearest(fmt)
        mapped.append(near)
        if note:
            notes.append(note)
    quantized = Counter(f for f in mapped if f != "native")
    if not quantized:
        return engine.space.dtype_of("native"), (), _unique(notes)
    chosen = max(quantized, key=lambda f: (quantized[f], FORMAT_BITS.get(f, 8)))
    if len(quantized) > 1:
        notes.append(f"per-layer formats ({', '.join(f'{f} in {n}' for f, n in quantized.items())}) become one dtype")
    native = tuple(i for i, f in enumerate(mapped) if f == "native")
    if native and not engine.space.skip_layers:
        notes.append(f"layers {', '.join(map(str, native))} at native precision are stored at {engine.space.dtype_of(chosen)} too")
        native = ()
    return engine.space.dtype_of(chosen), native, _unique(notes)


def _from_recipe(engine: Engine, profile: Profile, recipe: EngineRecipe, model: str, tokens: int, where: str) -> Held:
    scale = tokens / recipe.prompt_tokens
    windows = []
    for text in recipe.windows:
        if text == "full":
            windows.append(None)
            continue
        try:
            window = int(text)
        except ValueError:
            raise KvtoolError(f"calibration.engine.windows holds {text!r}; each entry is 'full' or a window in tokens") from None
        windows.append(max(1, math.ceil(window * scale)) if scale != 1 else window)
    windows, unified = engine.unify(windows, tokens)  # a hand-edited record may hold several sizes
    skip = tuple(int(i) for i in recipe.skip_layers if str(i).isdigit())
    mapping = (f"the engine recipe calibrated at {recipe.prompt_tokens} prompt tokens"
               + (f", windows scaled to {tokens} ({where})" if scale != 1 else ""))
    held_out = f", held out {recipe.held_out_ppl:g} vs {recipe.kvtool_held_out_ppl:g}" if recipe.held_out_ppl and recipe.kvtool_held_out_ppl else ""
    behind = [f"kvtool's own recipe (calibration PPL {recipe.kvtool_ppl:g} against this recipe's {recipe.ppl:g}{held_out})"]
    if profile.method.draft is not None:
        behind.append(f"the {profile.method.draft.tokens}-token draft")
    if unified:
        behind.append(unified)
    note = engine.format_note(engine.space.format_of(recipe.kv_cache_dtype))
    if note:
        behind.append(note)
    return _held(engine, profile, model, tuple(windows), recipe.kv_cache_dtype, skip, tokens, mapping, behind, recipe)


def _held(engine, profile, model, windows, dtype, skip, tokens, mapping, behind, recipe=None) -> Held:
    engine.check(profile, windows)
    own = [min(tokens, profile.model.sliding_window) if kind == "sliding_attention" and profile.model.sliding_window else tokens
           for kind in _layer_types(profile)]
    kept = sum(min(full if w is None else w, tokens) for w, full in zip(windows, own)) / sum(own)
    return Held(engine.name, model, windows, dtype, skip, tokens, mapping, tuple(_unique(behind)), kept, recipe)


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
