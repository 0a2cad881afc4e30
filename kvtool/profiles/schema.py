"""Profile format v1: what a calibrated per-layer KV budget looks like in memory.

A profile is read by the runtime (ratios, method settings, fingerprint) and by `kvtool inspect`
(Gini, Lorenz curves, calibration metadata). The fields are declared in the order the YAML file lists
them, each with what a file may hold for it (`rule`, see `kvtool.profiles.fields`); `kvtool.profiles.io`
reads and writes the file and `kvtool.profiles.validate` checks it, both from these declarations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from kvtool.profiles.fields import Legacy, legacy, rule

SCHEMA_VERSION = 1

MERGE_MODES = ("position", "none", "similarity-avg", "similarity-pivot", "similarity-weighted")
# Which prompt tokens a layer keeps (kvtool.runtime.selection holds the rules; a test keeps these
# names in step with them). Which entry goes during generation is a name in the eviction rules'
# registry (kvtool.runtime.eviction.EVICT_RULES), which this layer cannot see: the runtime checks it
# when it loads or applies a profile (`load_profile`, `attach`), so a new rule is one file and one
# registry line there.
SELECTION_RULES = ("importance", "recent", "heavy-hitter", "text-prior")
# What a prompt token is worth (kvtool.runtime.importance) and whether KV heads choose their own entries.
SCORERS = ("attention-sum", "window", "union", "expected-attention", "expected-output", "triattention")
# The scorers that read the profile's per-head query statistics (`Profile.queries`).
QUERY_SCORERS = ("expected-attention", "expected-output", "triattention")
# The scorers that read the observation window and max-pool it (their window and pool matter).
WINDOW_SCORERS = ("window", "union")
HEAD_MODES = ("shared", "per-head")
# Where the per-layer ratios come from: the Lorenz curves of the profile's scorer, PrefixKV's
# attention-sum curves whatever the scorer, the budget in every layer, or each layer's measured loss
# (`kvtool.profiles.loss_budget`).
RATIO_SOURCES = ("scorer", "attention-sum", "uniform", "measured")
# How a compressing layer stores the keys or values of the entries it keeps (kvtool.runtime.storage
# holds the formats; a test keeps these names in step with them): the model's own dtype, 8 bits with
# one scale per token and head (int8, fp8: vLLM's int8_per_token_head / fp8_per_token_head), 4 bits
# per token and head (int4) or in groups of 32 along the head dim (int4-g32), and 2 bits in groups.
KV_FORMATS = ("native", "int8", "fp8", "int4", "int4-g32", "int2-g32")

# Field constraints several fields share.
_KEPT_FRACTION = rule(low=0, high=1, open_low=True)
_NON_NEGATIVE = rule(low=0)


@dataclass(frozen=True)
class ModelFingerprint:
    """Enough of a model's shape to refuse a profile made for another model."""

    name: str
    model_type: str
    num_layers: int = field(metadata=rule(low=1))
    num_attention_heads: int = field(metadata=rule(low=1))
    num_kv_heads: int = field(metadata=rule(low=1))
    head_dim: int = field(metadata=rule(low=1))
    hidden_size: int = field(metadata=rule(low=1))
    vocab_size: int = field(metadata=rule(low=1))
    # "full_attention" / "sliding_attention" per layer; sliding layers are left alone by kvtool.
    # Empty in profiles made before the field existed.
    layer_types: tuple[str, ...] = field(
        default=(), metadata=rule(flow=True, nonempty=True, per_layer=True, may_be_empty=True)
    )
    # The sliding-window layers' window in tokens (transformers' layer stores window - 1 of them);
    # None for models without one, and in profiles made before the field existed.
    sliding_window: int | None = field(default=None, metadata=rule(low=1, omit_none=True))
    # The chunked layers' chunk in tokens (Llama 4; transformers' layer stores chunk - 1 of them);
    # None for models without one, and in profiles made before the field existed.
    attention_chunk_size: int | None = field(default=None, metadata=rule(low=1, omit_none=True))

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        """Fields that make `other` incompatible (the name alone never does)."""
        keys = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim")
        return [
            f"{k} {getattr(self, k)} != {getattr(other, k)}"
            for k in keys
            if getattr(self, k) != getattr(other, k)
        ]


@dataclass(frozen=True)
class Draft:
    """The answer drafted at the budget to help choose what the prompt keeps (kvtool.runtime.draft).

    Before the prompt is compressed for good, `tokens` greedy tokens are drafted through the
    compressed cache and run as one forward of their own over the held prompt: their attention joins
    the prompt's scores (observation window and column sums) and a fresh cache is compressed with
    them; then they are dropped and generation starts from the prompt's end. The cache never holds
    more than the budget. Each later round of `rounds` drafts again from the last round's cache.
    `verify`: that forward also checks the draft against its own full-attention logits; the agreed
    prefix (plus the next token) is the full cache's greedy answer, so later rounds draft from it and
    the answer starts with it. `jacobi`: a later round takes its draft from the last round's
    full-attention predictions (the prompt's next token, then the token each draft row predicts, as
    in Jacobi decoding) instead of stepping through the cache again, so only the first round pays
    for greedy steps (and less is kept than with stepped rounds: not calibration's default).
    """

    tokens: int = field(metadata=rule(low=1))
    rounds: int = field(default=1, metadata=rule(low=1))
    verify: bool = False
    jacobi: bool = field(default=False, metadata=rule(omit_default=True))

    def capped(self, tokens: int) -> "Draft":
        """This draft, never longer than `tokens` (a draft longer than the answer scores tokens nobody reads)."""
        return self if self.tokens <= tokens else dataclasses.replace(self, tokens=max(1, tokens))


@dataclass(frozen=True)
class MethodSettings:
    """How entries are chosen and combined; shared by every layer."""

    merge: str = field(default="position", metadata=rule(choices=MERGE_MODES))
    # First and last prompt tokens always kept (inside the budget).
    sink_tokens: int = field(default=4, metadata=_NON_NEGATIVE)
    recent_window: int = field(default=8, metadata=_NON_NEGATIVE)
    # D: generation evicts at prefix_l - D.
    truncation_distance: int = field(default=25, metadata=_NON_NEGATIVE)
    selection: str = field(default="importance", metadata=rule(choices=SELECTION_RULES))
    eviction: str = "fixed-point"  # a name in kvtool.runtime.eviction.EVICT_RULES (checked there)
    # Profiles written before these fields existed load with these defaults (the current behaviour).
    scorer: str = field(default="attention-sum", metadata=rule(choices=SCORERS))
    # The observation window (last prompt rows) and max-pool width of the "window" scorer.
    window: int = field(default=32, metadata=rule(low=1))
    pool: int = field(default=7, metadata=rule(low=1))
    # The "union" scorer's share of kept tokens from the window's top list (the rest: column sums').
    window_share: float = field(default=0.5, metadata=rule(low=0, high=1, open_low=True))
    heads: str = field(default="shared", metadata=rule(choices=HEAD_MODES))
    # Share of each layer's kept prompt entries reserved for the most recent tokens (beside
    # `recent_window`, whichever keeps more).
    recent_share: float = field(default=0.0, metadata=rule(low=0, high=1))
    ratios: str = field(default="scorer", metadata=rule(choices=RATIO_SOURCES))
    # The answer's first tokens drafted at the budget to score the prompt again (`Draft`); None: the
    # prompt is compressed once, by its own attention. Written `draft: {tokens: 32, rounds: 2, verify: true}`.
    draft: Draft | None = field(default=None, metadata=rule(omit_none=True, flow=True))

    # Keys older files may hold (kvtool.profiles.fields.Legacy): the draft was flat keys (`draft: 64`,
    # `draft_rounds`, `draft_verify`), read into `draft`; the lookahead (new tokens generated over the whole prompt before compressing)
    # and reused drafts (the verified tokens' keys and values taken from the draft's forward) were
    # measured as no better and retired: their keys are checked, then ignored.
    LEGACY_KEYS: ClassVar[dict[str, Legacy]] = {
        "lookahead": legacy("int", low=0),
        "lookahead_hold": legacy("float", low=0),
        "draft": legacy("int", low=0, into="draft.tokens", off=0),
        "draft_rounds": legacy("int", low=1, into="draft.rounds"),
        "draft_verify": legacy("bool", into="draft.verify"),
        "draft_reuse": legacy("bool"),
    }


def draft_phrase(draft: Draft | None) -> str:
    """How a recipe's draft reads in reports: "prompt compressed with the attention of a 64-token draft (2 rounds, verified)"; "" without."""
    if draft is None:
        return ""
    notes = [f"{draft.rounds} rounds"] if draft.rounds > 1 else []
    notes += ["verified"] if draft.verify else []
    notes += ["later rounds from its predictions"] if draft.jacobi and draft.rounds > 1 else []
    rounds = f" ({', '.join(notes)})" if notes else ""
    return f"prompt compressed with the attention of a {draft.tokens}-token draft{rounds}"


@dataclass(frozen=True)
class LayerProfile:
    """One decoder layer's share of the cache and the statistics it came from."""

    ratio: float = field(metadata=_KEPT_FRACTION)  # kept fraction R_l
    compress: bool = True  # False for layers kvtool leaves alone (sliding-window layers)
    gini: float | None = field(default=None, metadata=rule(low=0, high=1))
    # Spread of the ratio across calibration samples.
    ratio_std: float | None = field(default=None, metadata=rule(low=0))
    # Mean cumulative-priority curve P_l(o) sampled at o = i/(len-1); empty when not calibrated.
    # Written with 6 digits: plenty for Lorenz plots and re-budgeting, and the file stays readable.
    priority_curve: tuple[float, ...] = field(
        default=(), metadata=rule(low=0, high=1, increasing=True, nullable=True, flow=True, digits=6)
    )
    # Mean share of the kept prompt entries that are image tokens at this ratio, over the calibration
    # prompts with images; None for text-only calibrations and layers kvtool leaves alone. Left out of
    # the file when None, so text profiles look as they did before the field existed.
    image_share: float | None = field(default=None, metadata=rule(low=0, high=1, omit_none=True))
    # The priority curve of the profile's scorer when that is not `attention-sum` (whose curve is
    # `priority_curve`, PrefixKV's): the ratios are solved on it. Left out of the file when None.
    scorer_curve: tuple[float, ...] | None = field(
        default=None, metadata=rule(low=0, high=1, increasing=True, flow=True, digits=6, omit_none=True)
    )
    # The rise of the references' NLL per token when this layer alone keeps each of
    # `Profile.loss_ratios` of its prompt entries (the `measured` ratio source solves on it).
    # Left out of the file when None.
    loss_curve: tuple[float, ...] | None = field(
        default=None, metadata=rule(low=0, flow=True, digits=6, omit_none=True)
    )
    # A window-shaped layer (a sliding-window layer given a shorter window): it keeps at most `window`
    # entries, its first `sinks` tokens and the most recent ones, at any length; `ratio` is then 1.
    # Left out of the file when None (the layer keeps what its ratio, or the model, says).
    window: int | None = field(default=None, metadata=rule(low=1, omit_none=True))
    sinks: int | None = field(default=None, metadata=rule(low=0, omit_none=True))
    # A window-shaped layer that keeps, beside its sinks, the entries of the model's own window that
    # the prompt's last row attended most instead of the most recent ones (selection by score inside
    # the window); generation then drops what each new token attended least, or the entry leaving
    # the model's window, so none outlives it (`runtime.eviction.window_tova`).
    scored: bool = field(default=False, metadata=rule(omit_default=True))
    # How the layer stores the keys and the values it keeps (one of KV_FORMATS each). `ratio` counts
    # entries whatever their format; what they cost in bytes is the format's. Left out of the file
    # at the model's own precision, so a profile without them reads as native.
    keys_format: str = field(default="native", metadata=rule(choices=KV_FORMATS, omit_default=True))
    values_format: str = field(default="native", metadata=rule(choices=KV_FORMATS, omit_default=True))


@dataclass(frozen=True)
class PromptStats:
    min: int = field(metadata=_NON_NEGATIVE)
    mean: float = field(metadata=_NON_NEGATIVE)
    max: int = field(metadata=rule(low=0, not_below="min"))


@dataclass(frozen=True)
class RecipeTrial:
    """One recipe the calibration's search tried, with what it measured."""

    stage: str  # which step of the search tried it (the rule it varied)
    scorer: str = field(metadata=rule(choices=SCORERS))
    heads: str = field(metadata=rule(choices=HEAD_MODES))
    eviction: str  # a name in kvtool.runtime.eviction.EVICT_RULES (checked there)
    recent_share: float = field(metadata=rule(low=0, high=1))
    merge: str = field(metadata=rule(choices=MERGE_MODES))
    truncation_distance: int = field(metadata=_NON_NEGATIVE)
    ppl: float = field(metadata=rule(low=0, open_low=True))  # on the prompts that choose
    ratios: str = field(default="scorer", metadata=rule(choices=RATIO_SOURCES))
    # The window scorer's observation window and max-pool width; left out for the other scorers
    # (and in older files).
    window: int | None = field(default=None, metadata=rule(low=1, omit_none=True))
    pool: int | None = field(default=None, metadata=rule(low=1, omit_none=True))
    # The union scorer's window share; left out for the other scorers (and in older files).
    window_share: float | None = field(default=None, metadata=rule(low=0, high=1, open_low=True, omit_none=True))
    selection: str = field(default="importance", metadata=rule(choices=SELECTION_RULES))
    # On the held-out calibration prompts, for the recipes confirmed there; left out otherwise.
    held_out_ppl: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))
    # Measured with the profile's draft by the draft stage (`kvtool calibrate --draft ...,stage`), on the
    # prompts that chose and on the held-out ones; left out for recipes it did not measure.
    drafted_ppl: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))
    drafted_held_out_ppl: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))


@dataclass(frozen=True)
class StorageTrial:
    """The shipped recipe measured by calibration's storage stage (`kvtool.calibration.storage`) at
    one storage, at the same bytes: `as searched` is the recipe search's own profile, a format name
    every layer storing that format with its entries re-derived to the budget's bytes (`native`: the
    model's own precision, for a search run at a format's entries)."""

    storage: str
    ppl: float = field(metadata=rule(low=0, open_low=True))  # on the prompts that choose
    held_out_ppl: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))
    shipped: bool | None = field(default=None, metadata=rule(omit_none=True))  # True on the one the profile holds


# The serving engines a profile can record an engine-servable recipe for (kvtool.export holds how each
# is spoken to; kvtool.calibration.engine searches what each can serve).
ENGINES = ("vllm", "trtllm")


@dataclass(frozen=True)
class EngineRecipe:
    """What a serving engine can hold of the cache, searched and measured by `kvtool calibrate --engine`
    (`kvtool.calibration.engine`): per layer a recency window without sinks or the full cache, one KV
    dtype (the engine's own name), the layers the engine keeps at native precision, and the PPL of that
    recipe run with the engine's semantics (`kvtool.calibration.engine_emulation`) beside kvtool's own
    recipe's, on the same prompts."""

    engine: str = field(metadata=rule(choices=ENGINES))
    kv_cache_dtype: str  # the engine's name: "auto", "fp8", "int8_per_token_head", ...
    # Per layer "full" or the window in tokens (each token attends to itself and the window - 1 before it).
    windows: tuple[str, ...] = field(metadata=rule(flow=True, nonempty=True, per_layer=True))
    prompt_tokens: int = field(metadata=rule(low=1))  # the length at which `kept` and the windows were solved
    kept: float = field(metadata=_KEPT_FRACTION)  # its share of the full cache's bytes at prompt_tokens
    ppl: float = field(metadata=rule(low=0, open_low=True))  # on the prompts that chose
    kvtool_ppl: float = field(metadata=rule(low=0, open_low=True))  # kvtool's shipped recipe, same prompts
    # Layers the engine keeps at native precision while the others use kv_cache_dtype (vLLM's
    # --kv-cache-dtype-skip-layers); left out when none.
    skip_layers: tuple[str, ...] = field(default=(), metadata=rule(flow=True, omit_default=True))
    held_out_ppl: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))
    kvtool_held_out_ppl: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))


@dataclass(frozen=True)
class CalibrationInfo:
    """Where the ratios came from; absent for a uniform profile made on the fly."""

    # Keys older files may hold that no longer map to a field: accepted with these values, then
    # ignored. `curve_importance` named the per-token score the Lorenz curves were built from ("mean"
    # or the plain column "sum"); only "mean" is made now, but ratios solved on "sum" curves are
    # still a calibration the runtime applies as it is. `answer_references` recorded a search that
    # scored answer rows where the full cache writes them ("in-context"), an option measured as no
    # better than the answers forced after the prompt and retired.
    LEGACY_KEYS: ClassVar[dict[str, Legacy]] = {
        "curve_importance": legacy("str", choices=("mean", "sum")),
        "answer_references": legacy("str", choices=("forced", "in-context")),
    }

    dataset_hash: str
    samples: int = field(metadata=rule(low=1))
    prompt_tokens: PromptStats
    retention_p: float | None = field(default=None, metadata=_KEPT_FRACTION)
    # D -> calibration PPL.
    truncation_ppl: dict[int, float] = field(
        default_factory=dict,
        metadata=rule(low=0, open_low=True, nullable=True, keys=("distance", "perplexity"), key_low=0),
    )
    ppl_full: float | None = field(default=None, metadata=rule(low=0, open_low=True))
    ppl_compressed: float | None = field(default=None, metadata=rule(low=0, open_low=True))
    seed: int | None = None
    seconds: float | None = field(default=None, metadata=rule(low=0))
    # The recipe search (absent when calibration only tuned D and the merge mode): the prompts that
    # chose, the held-out ones that confirmed, the full cache's PPL there, and every recipe tried.
    chosen_on: int | None = field(default=None, metadata=rule(low=1, omit_none=True))
    confirmed_on: int | None = field(default=None, metadata=rule(low=1, omit_none=True))
    held_out_ppl_full: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))
    recipes: tuple[RecipeTrial, ...] | None = field(default=None, metadata=rule(omit_none=True))
    # Hybrid models: each sliding-layer window tried (entries; the model's own is window - 1) -> PPL on
    # the prompts that chose, at the whole-cache budget (calibrate.windows); absent elsewhere.
    window_ppl: dict[int, float] | None = field(
        default=None,
        metadata=rule(low=0, open_low=True, nullable=True, keys=("window", "perplexity"), key_low=1, omit_none=True),
    )
    # The prompt phase measured with the shipped method and its draft, as a multiple of the full
    # cache's prompt forward on the calibration prompts (`kvtool.calibration.cost`), and the limit it
    # had to stay within (`kvtool calibrate --max-prompt-overhead`; left out when none was set). Where
    # one row alone was clearly within the limit, that row's ratio: an upper bound of its batch's.
    prompt_overhead: float | None = field(default=None, metadata=rule(low=0, open_low=True, omit_none=True))
    max_prompt_overhead: float | None = field(default=None, metadata=rule(low=1, omit_none=True))
    # True when the held-out prompts rejected the search's choice and the method is the finalist
    # with the lowest PPL over all the prompts (nothing independent confirms it); left out otherwise.
    fell_back: bool | None = field(default=None, metadata=rule(omit_none=True))
    # The engine-servable recipe `kvtool calibrate --engine` searched, with its measured PPL; left out otherwise.
    engine: EngineRecipe | None = field(default=None, metadata=rule(omit_none=True))
    # `kvtool calibrate --kv-formats`: the storage stage's candidates, the shipped one among them; left out otherwise.
    storages: tuple[StorageTrial, ...] | None = field(default=None, metadata=rule(omit_none=True))


@dataclass(frozen=True)
class QueriesFile:
    """The sidecar holding a profile's per-head query statistics (`kvtool.profiles.queries`): its
    name beside the profile, its SHA-256, and the future positions RoPE is averaged over."""

    file: str
    sha256: str
    future_positions: int = field(metadata=rule(low=1))


# Profile fields that live in memory only (io writes and reads them beside the YAML).
MEMORY_ONLY = "kvtool.memory-only"


@dataclass(frozen=True)
class Profile:
    """A per-layer KV budget for one model. `budget` is the KEPT fraction of the full cache.

    The header fields come first in the file but are keyword-only here, so the constructor still
    starts with what every profile needs: `Profile(budget, model, method, layers, ...)`.
    """

    schema_version: int = field(default=SCHEMA_VERSION, kw_only=True, metadata=rule(required=True))
    kvtool_version: str = field(default="", kw_only=True)
    created: str = field(default="", kw_only=True)  # ISO-8601 timestamp
    # Stored as {kept_fraction: 0.2}: a bare number would be ambiguous (kept or evicted?).
    budget: float = field(metadata=rule(low=0, high=1, open_low=True, wrap="kept_fraction", example=0.2))
    model: ModelFingerprint
    method: MethodSettings
    calibration: CalibrationInfo | None = field(default=None, kw_only=True)
    # The prompt length at which `budget` is the kept share of the whole cache, each layer counted as
    # it stores (a sliding layer min(L, window - 1)); None in profiles made before the field existed,
    # whose budget is the compressing layers' kept share (the same for a model of full-attention layers).
    budget_tokens: int | None = field(default=None, kw_only=True, metadata=rule(low=1, omit_none=True))
    # The per-head query statistics the expected-attention scorer reads; left out of the file when None.
    queries: QueriesFile | None = field(default=None, kw_only=True, metadata=rule(omit_none=True, flow=True))
    # The kept fractions at which each layer's `loss_curve` was measured (the `measured` ratio source);
    # left out of the file when no loss was measured.
    loss_ratios: tuple[float, ...] | None = field(
        default=None, kw_only=True,
        metadata=rule(low=0, high=1, open_low=True, increasing=True, flow=True, omit_none=True),
    )
    # Bytes of one value at the model's own precision (4 for float32, 2 for 16-bit): what the layers'
    # storage formats are counted against (`profiles.byte_budget`). Left out when every layer keeps
    # the model's precision; a profile whose layers store other formats must have it.
    native_bytes: int | None = field(default=None, kw_only=True, metadata=rule(low=1, omit_none=True))
    # Listed in order, each entry stating its position (a check against hand edits).
    layers: tuple[LayerProfile, ...] = field(metadata=rule(per_layer=True, index_key="layer"))
    # The statistics `queries` names (a kvtool.profiles.queries.QueryStats), loaded with the file.
    query_stats: object = field(default=None, kw_only=True, compare=False, repr=False, metadata={MEMORY_ONLY: True})

    @property
    def ratios(self) -> list[float]:
        return [layer.ratio for layer in self.layers]
