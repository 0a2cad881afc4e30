"""What one compressing layer does (`LayerPlan`), built from a profile by `attach.layer_plans`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtool.errors import KvtoolError
from kvtool.runtime.eviction import EvictRule, FixedPoint
from kvtool.runtime.importance import LayerQueries, Scorer, make_scorer
from kvtool.runtime.merge import MergeRule
from kvtool.runtime.selection import SelectRule, TopImportance, kept_count

# A scored window (`LayerProfile.scored`) ranks the model's own window by the attention of the
# prompt's last row under the model's sliding mask (TOVA's prefill score). On Gemma 3's calibration
# prompts at 0.2 it beat SnapKV's 32 rows pooled over 7 and 8 rows pooled over 7 at windows of 64
# and 127, on the prompts that choose and on the held-out ones (`benchmarks/window_rules.py
# gemma3-270m --profile kvtool/profiles/builtin/gemma3-270m-b0.2.yaml`: at 64, 14.101 against 14.310
# and 14.651 choosing, 6.272 against 6.719 and 6.510 held out).
SCORED_WINDOW_ROWS = 1
SCORED_WINDOW_POOL = 1

# "shared": one set of entries for all KV heads of a layer; "per-head": each KV head its own.
HEAD_MODES = ("shared", "per-head")


@dataclass(frozen=True)
class LayerPlan:
    """What one compressing layer does; built from a profile."""

    ratio: float
    merge: MergeRule
    sink_tokens: int
    recent_window: int
    truncation_distance: int
    select: SelectRule = field(default_factory=TopImportance)
    evict: EvictRule = field(default_factory=FixedPoint)
    # Keep the prompt importance after compressing (calibration reads it; costs one score pass).
    record_importance: bool = False
    # What a prompt token is worth (a name in kvtool.runtime.importance.SCORERS): "attention-sum", the
    # attention all prompt rows give it (Elastic Cache, PrefixKV); "window", the attention of the
    # last `window` rows (SnapKV; 1 = TOVA's prefill score), max-pooled over `pool` positions.
    scorer: str = "attention-sum"
    window: int = 32
    pool: int = 7
    # "union": the share of its kept tokens that come from the window's top list.
    window_share: float = 0.5
    heads: str = "shared"  # one of HEAD_MODES
    # Share of each sequence's kept prompt entries reserved for the most recent tokens (on top of
    # `recent_window`): on a small budget the question and the last turn are what the answer reads.
    recent_share: float = 0.0
    # Entries a layer keeps however short the sequence (`attach(..., min_kept=N)`): at small budgets a short
    # prompt leaves the tightest layers a few entries and the model degenerates, while a floor costs
    # nothing once ratio * T passes it. 0: the ratio alone.
    min_kept: int = 0
    # A window-shaped layer keeps at most `cap` entries at any length (`sink_tokens` first tokens and
    # a queue of the most recent: select `recent`, evict `sliding`), what engines take as a per-layer
    # attention window (TensorRT-LLM's max_attention_window, vLLM's sliding groups). None: the ratio alone.
    cap: int | None = None
    # What transformers' own layer would store at most: a sliding-window layer's window - 1 (None: the
    # whole sequence). The full cache the layer's kept share is counted against (`full_bytes`).
    native_window: int | None = None
    # The layer's calibrated query statistics and RoPE (the expected-attention scorer reads them);
    # None when the profile has none.
    queries: LayerQueries | None = field(default=None, compare=False)
    # How the kept keys and values are stored: names in kvtool.runtime.storage.FORMATS.
    storage: tuple[str, str] = ("native", "native")

    def __post_init__(self) -> None:
        if isinstance(self.min_kept, bool) or not isinstance(self.min_kept, int) or self.min_kept < 0:
            raise KvtoolError(f"min-kept must be an integer >= 0, got {self.min_kept!r}")
        if self.heads not in HEAD_MODES:
            raise KvtoolError(f"unknown head mode {self.heads!r} (known: {', '.join(HEAD_MODES)})")
        if self.cap is not None and (isinstance(self.cap, bool) or not isinstance(self.cap, int) or self.cap < 1):
            raise KvtoolError(f"a layer's window must be an integer >= 1, got {self.cap!r}")
        if self.cap is not None and self.native_window is not None and self.cap > self.native_window:
            raise KvtoolError(f"a layer's window ({self.cap}) cannot exceed the model's own ({self.native_window} entries)")
        if self.record_importance and self.storage != ("native", "native"):
            raise KvtoolError("calibration records layers at the model's own precision (storage native/native)")
        self.scoring  # refuses an unknown scorer or a bad window / pool now, not at the first prompt

    def keep(self, tokens: np.ndarray) -> np.ndarray:
        """Entries each sequence keeps after `tokens` real tokens: ceil(ratio * T), at least `min_kept`,
        at most `cap`."""
        kept = kept_count(self.ratio, tokens, self.min_kept)
        return kept if self.cap is None else np.minimum(kept, self.cap)

    @property
    def compresses(self) -> bool:
        """Whether the layer ever keeps fewer entries than it is given."""
        return self.ratio < 1.0 or self.cap is not None

    @property
    def scoring(self) -> Scorer:
        return make_scorer(self.scorer, window=self.window, pool=self.pool, window_share=self.window_share)
