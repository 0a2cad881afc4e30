"""Profile format v1: what a calibrated per-layer KV budget looks like in memory.

A profile is read by the runtime (ratios, method settings, fingerprint) and by `kvtool inspect`
(Gini, Lorenz curves, calibration metadata). YAML mapping lives in `kvtool.profiles.io`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA_VERSION = 1

MERGE_MODES = ("position", "none", "similarity-avg", "similarity-pivot", "similarity-weighted")
# Which prompt tokens a layer keeps, and which entry goes during generation (kvtool.runtime.selection
# and kvtool.runtime.eviction hold the rules; a test keeps these names in step with them).
SELECTION_RULES = ("importance", "recent", "heavy-hitter", "text-prior")
EVICTION_RULES = ("fixed-point", "sliding", "heavy-hitter")
# "mean": column sum / rows that can see the token (removes the causal bias toward early tokens);
# "sum": the plain column sum the runtime ranks tokens by.
CURVE_IMPORTANCE = ("mean", "sum")


@dataclass(frozen=True)
class ModelFingerprint:
    """Enough of a model's shape to refuse a profile made for another model."""

    name: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    # "full_attention" / "sliding_attention" per layer; sliding layers are left alone by kvtool.
    layer_types: tuple[str, ...] = ()

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        """Fields that make `other` incompatible (the name alone never does)."""
        keys = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim")
        return [
            f"{k} {getattr(self, k)} != {getattr(other, k)}"
            for k in keys
            if getattr(self, k) != getattr(other, k)
        ]


@dataclass(frozen=True)
class MethodSettings:
    """How entries are chosen and combined; shared by every layer."""

    merge: str = "position"  # one of MERGE_MODES
    sink_tokens: int = 4  # first prompt tokens always kept (inside the budget)
    recent_window: int = 8  # last prompt tokens always kept (inside the budget)
    truncation_distance: int = 25  # D: generation evicts at prefix_l - D
    selection: str = "importance"  # one of SELECTION_RULES
    eviction: str = "fixed-point"  # one of EVICTION_RULES


@dataclass(frozen=True)
class LayerProfile:
    """One decoder layer's share of the cache and the statistics it came from."""

    ratio: float  # kept fraction R_l in (0, 1]
    compress: bool = True  # False for layers kvtool leaves alone (sliding-window layers)
    gini: float | None = None
    ratio_std: float | None = None  # spread of the ratio across calibration samples
    # Mean cumulative-priority curve P_l(o) sampled at o = i/(len-1); empty when not calibrated.
    priority_curve: tuple[float, ...] = ()
    # Mean share of the kept prompt entries that are image tokens at this ratio, over the calibration
    # prompts with images; None for text-only calibrations and layers kvtool leaves alone.
    image_share: float | None = None


@dataclass(frozen=True)
class PromptStats:
    min: int
    mean: float
    max: int


@dataclass(frozen=True)
class CalibrationInfo:
    """Where the ratios came from; absent for a uniform profile made on the fly."""

    dataset_hash: str
    samples: int
    prompt_tokens: PromptStats
    retention_p: float | None = None
    truncation_ppl: dict[int, float] = field(default_factory=dict)  # D -> calibration PPL
    ppl_full: float | None = None
    ppl_compressed: float | None = None
    seed: int | None = None
    seconds: float | None = None
    # Which per-token score the Lorenz curves were built from (CURVE_IMPORTANCE); None in old files.
    curve_importance: str | None = None


@dataclass(frozen=True)
class Profile:
    """A per-layer KV budget for one model. `budget` is the KEPT fraction of the full cache."""

    budget: float
    model: ModelFingerprint
    method: MethodSettings
    layers: tuple[LayerProfile, ...]
    calibration: CalibrationInfo | None = None
    kvtool_version: str = ""
    created: str = ""  # ISO-8601 timestamp
    schema_version: int = SCHEMA_VERSION

    @property
    def ratios(self) -> list[float]:
        return [layer.ratio for layer in self.layers]
