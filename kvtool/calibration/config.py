"""What one calibration run does: prompts drawn, their length, references, D and merge candidates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtool.errors import KvtoolError
from kvtool.runtime.precision import KVStorage
from kvtool.profiles import MERGE_MODES, Draft, MethodSettings
from kvtool.calibration.recipes import SearchSpace
from kvtool.profiles.whole_cache import DEFAULT_BUDGET_TOKENS

# Two prompts of each of the six packaged kinds: one of each in either half (the held-out half's
# long-answer prompt is what judges the finalists on a long answer).
DEFAULT_SAMPLES = 12
# Hybrid models calibrate on ~2k-token prompts and a window stage, so they draw 10, not 12: with 10,
# `benchmarks/calibration_stages.py gemma3-270m --out g.yaml` takes 795.0 s on 2 cores (the built-in
# gemma3-270m-b0.2 profile's `calibration.seconds`), most of it work per prompt (recipes 347 s,
# held-out 52 s).
HYBRID_SAMPLES = 10
# Hybrid models: the budget holds at DEFAULT_BUDGET_TOKENS prompt tokens (profiles.whole_cache);
# calibration prompts of about 2048 tokens are past a 512-token window four times over.
DEFAULT_LONG_PROMPT_TOKENS = 2048
DEFAULT_MAX_PROMPT_TOKENS = 1024
# All default samples in one batch: per-token steps cost about the same for 1 row as for 10.
DEFAULT_BATCH_SIZE = 10
DEFAULT_CANDIDATES = (0, 8, 16, 25, 48, 96)
# As long as kvtool eval's default generation: the fixed-point queue holds about D entries, so the
# last D prompt entries are gone after ~D / (1 - budget) steps; 32-token references ended before
# that and favoured a D that lost on 64-token generations. Still a CPU calibration in minutes.
REFERENCE_TOKENS = 64
# Prompts of this kind ask for long answers (summaries, walkthroughs, tutorials): in the confirming
# half their references run LONG_REFERENCE_TOKENS, in batches of their own, so that the finalists
# are judged on what a generation rule does to an answer that outlives the compressed prompt (at 0.2
# a 700-token prompt keeps ~140 entries: 256 new tokens replace them all), not only on its first 64
# tokens (`runner.encode_halves`).
LONG_ANSWER_KIND = "long-answer"
LONG_REFERENCE_TOKENS = 256
# The draft written into the profile (`MethodSettings.draft`, kvtool.runtime.draft): 32 tokens in two
# rounds, the second drafted through the cache the first scored; verified, each round's draft checked
# against the full-attention logits of the draft's forward. It costs drafted steps and one draft-row
# forward per round (the prompt runs once). Chosen by cost: `kvtool bench smollm2 --budget 0.2
# --prompt-tokens 4096 --batch 4 --repeat 3` on a 2-core CPU puts the prompt phase at 1.47x the full
# cache's with it and 1.78x with 64 tokens, against a target of at most 1.5x. On the calibration
# prompts neither built-in draw uses (`benchmarks/unseen_calibration.py`, then `kvtool eval smollm2
# --data`), 64 x 2 kept more (PPL 2.208 against 2.284), and 32 x 2 kept more than 64 x 1 at the same
# number of steps (2.284 against 2.319), which is why calibration's cost ladder halves tokens before
# it drops a round. A Jacobi second round (`jacobi`, half the steps) tied it on those prompts but lost
# on the evaluation set (`kvtool eval smollm2 --budgets 0.2 --methods kvtool`: ROUGE-L 0.575 against
# 0.627, needles 0.673 against 0.788): it is the ladder's next rung instead.
DEFAULT_DRAFT = Draft(tokens=32, rounds=2, verify=True)
DEFAULT_MAX_PROMPT_OVERHEAD = 4.0
# The reference tokens each layer's loss is measured on (the `measured` ratio source,
# `calibration.layer_loss`): on SmolLM2 curves from 32-token references kept about two thirds of the
# 96-token ones' gain over uniform ratios at half the cost (`benchmarks/layer_budgets.py smollm2
# --choose-reference-tokens 32`: held-out NLL per token -0.149 +- 0.075 against uniform, where the
# 96-token curves give -0.210 +- 0.063; 516 s for the 12 prompts instead of about 960 s).
LAYER_LOSS_TOKENS = 32
# `kvtool calibrate`'s storages beside the model's own (`--kv-formats`): the recipe is searched at
# the entries int8 keeps at the budget's bytes, measured with every layer at int8 and at the model's
# precision, each re-derived to those bytes, and the lower PPL ships where the held-out prompts
# confirm it (`calibration.storage`). On SmolLM2 at 0.1 (0.2 of a 16-bit cache, 20 prompts) that
# is held-out PPL 1.793 against 3.329 for the same bytes at float32 (full cache 1.729). The library's own
# default (`CalibrateConfig.kv_formats`) stays the model's precision: a configuration without
# references (`candidates=()`) has nothing to measure the storages on.
DEFAULT_KV_FORMATS = ("int8",)
# Merge modes the D search also tries: Elastic Cache's bucket mean and plain eviction (PrefixKV).
DEFAULT_MERGE_MODES = ("position", "none")


@dataclass(frozen=True)
class CalibrateConfig:
    """Settings of a calibration run; `checked()` validates them before any model work.

    `samples` prompts are drawn with `seed`; prompts longer than `max_prompt_tokens` are cut in the
    middle. `method` gives the sinks, recent window and the recipe the search starts from (the
    papers': attention-sum scores shared by the heads, fixed-point eviction). With `search`, half
    the prompts (each kind split over both halves) choose the recipe and the other half confirm it.
    Without, `method`'s rules stay and only D and the merge mode are tuned, or nothing (empty
    `candidates`). Every D in `candidates` is tried with every mode in `merge_modes` on
    `reference_tokens`-long references; the lowest calibration PPL picks both (an empty
    `merge_modes` tries `method.merge` only). Prompts run `batch_size` at a time.
    """

    samples: int | None = None  # None: DEFAULT_SAMPLES, HYBRID_SAMPLES on hybrid models
    seed: int = 0
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    method: MethodSettings = MethodSettings()
    candidates: Sequence[int] = DEFAULT_CANDIDATES
    reference_tokens: int = REFERENCE_TOKENS
    long_reference_tokens: int = LONG_REFERENCE_TOKENS
    batch_size: int = DEFAULT_BATCH_SIZE
    merge_modes: Sequence[str] = DEFAULT_MERGE_MODES
    # The recipe search (kvtool.calibration.recipes); None keeps `method`'s rules and searches only
    # D x `merge_modes` (the papers' recipe). A search takes its D values and merge modes from
    # `candidates` and `merge_modes`; empty `candidates` skips every search.
    search: SearchSpace | None = SearchSpace()
    # Written into the profile (MethodSettings.draft; None: none), not searched: the search measures
    # every recipe on the recorded prompt state, without it (see `draft_stage`).
    draft: Draft | None = DEFAULT_DRAFT
    # After the search, measure its pick and the recipes one generation rule or ratio source away with
    # the draft, and ship the best if the held-out prompts agree (`calibration.drafted`). Off by default:
    # each candidate pays its own prompt forwards and drafts, which takes the default 10-prompt run
    # past 3 minutes; the built-in profiles are made with it (scripts/build_builtin_profiles.sh).
    draft_stage: bool = False
    # The most the prompt phase may cost, as a multiple of the full cache's prompt forward, measured
    # on the calibration prompts (`calibration.cost`): a draft over it is replaced by the next cheaper
    # one that fits. None: measured and recorded, never limited. 4.0 keeps every built-in profile's
    # draft with a margin for a noisy 2-core machine: their `prompt_overhead`, measured on their
    # held-out calibration batches, runs 1.73 to 3.83 (kvtool/profiles/builtin/*.yaml).
    max_prompt_overhead: float | None = DEFAULT_MAX_PROMPT_OVERHEAD
    # Hybrid models (sliding-window layers): the prompt length the whole-cache budget is held at
    # (recorded in the profile as `budget_tokens`), and the length of the long prompts calibration
    # builds from the drawn ones (data.long_prompts), past the windows so that they matter.
    budget_tokens: int = DEFAULT_BUDGET_TOKENS
    # None: DEFAULT_LONG_PROMPT_TOKENS on hybrid models, the prompts as they are elsewhere.
    long_prompt_tokens: int | None = None
    # The references' first tokens each layer's loss is measured on, when a recipe may take its
    # ratios from measured loss (`calibration.layer_loss`).
    layer_loss_tokens: int = LAYER_LOSS_TOKENS
    # The storages ("int8", "int8/int4-g32"; `runtime.precision.KVStorage`) the storage stage measures
    # the searched recipe at, every layer at one of them, beside the model's own precision.
    kv_formats: tuple[str, ...] = ("native",)
    # Each layer also chooses a storage of `kv_formats` with its entries, by measured loss within the
    # budget's bytes (the `measured` ratio source, `build.by_bytes`). Off by default: on SmolLM2 at
    # 0.1 it cost 384 s more (970 s against 586 s) and measured no better than one storage everywhere
    # (held-out PPL 1.915 against 1.926; on the prompts that choose, 2.026 against 1.942).
    layer_storage: bool = False

    def checked(self) -> "CalibrateConfig":
        """The same settings with tuples for sequences and duplicates dropped; a one-line
        KvtoolError for the first bad one."""
        method = self.method or MethodSettings()
        candidates = tuple(self.candidates)
        merge_modes = tuple(dict.fromkeys(self.merge_modes)) or (method.merge,)
        samples = self.samples
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise KvtoolError(f"samples must be a positive integer, got {samples!r}")
        protected = method.sink_tokens + method.recent_window
        if self.max_prompt_tokens <= protected:
            raise KvtoolError(
                f"max-prompt-tokens must exceed the {protected} protected tokens "
                f"({method.sink_tokens} sink + {method.recent_window} recent), got {self.max_prompt_tokens}"
            )
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in candidates):
            raise KvtoolError(f"truncation distances must be integers >= 0, got {list(candidates)}")
        unknown = [m for m in merge_modes if m not in MERGE_MODES]
        if unknown:
            raise KvtoolError(f"unknown merge mode {unknown[0]!r} (known: {', '.join(MERGE_MODES)})")
        _check_draft(self.draft)
        if self.draft_stage and self.draft is None:
            raise KvtoolError("the draft stage measures recipes with their draft: it needs --draft above 0")
        if self.draft_stage and self.search is None:
            raise KvtoolError("the draft stage re-ranks the recipe search's pick: it needs the search")
        limit = self.max_prompt_overhead
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 1.0):
            raise KvtoolError(f"max-prompt-overhead must be a number >= 1 (a multiple of the full cache's prompt phase), got {limit!r}")
        if isinstance(self.budget_tokens, bool) or not isinstance(self.budget_tokens, int) or self.budget_tokens < 1:
            raise KvtoolError(f"budget-tokens must be a positive integer (a prompt length), got {self.budget_tokens!r}")
        tokens = self.long_prompt_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise KvtoolError(f"long-prompt-tokens must be a positive integer, got {self.long_prompt_tokens!r}")
        if self.reference_tokens < 1 or self.long_reference_tokens < 1 or self.batch_size < 1:
            raise KvtoolError("reference tokens and batch size must be at least 1")
        if isinstance(self.layer_loss_tokens, bool) or not isinstance(self.layer_loss_tokens, int) or self.layer_loss_tokens < 2:
            raise KvtoolError(f"layer-loss tokens must be an integer >= 2 (the first reference token is the prompt's), got {self.layer_loss_tokens!r}")
        kv_formats = tuple(dict.fromkeys(KVStorage.parse(f).name for f in (*self.kv_formats, "native")))
        if self.layer_storage and len(kv_formats) < 2:
            raise KvtoolError("a storage per layer chooses among --kv-formats: name at least one beside native")
        if method.ratios == "measured" and not candidates:
            raise KvtoolError("ratios from measured loss need the references calibration scores recipes on: leave the D candidates on")
        return CalibrateConfig(
            samples=samples,
            seed=self.seed,
            max_prompt_tokens=self.max_prompt_tokens,
            method=method,
            candidates=candidates,
            reference_tokens=self.reference_tokens,
            long_reference_tokens=self.long_reference_tokens,
            batch_size=self.batch_size,
            merge_modes=merge_modes,
            draft=self.draft,
            draft_stage=bool(self.draft_stage),
            max_prompt_overhead=None if limit is None else float(limit),
            budget_tokens=self.budget_tokens,
            long_prompt_tokens=self.long_prompt_tokens,
            layer_loss_tokens=self.layer_loss_tokens,
            kv_formats=kv_formats,
            layer_storage=bool(self.layer_storage),
            # One list of D candidates and merge modes: the search's are the config's.
            search=None if self.search is None else replace(
                self.search, distances=candidates or self.search.distances, merge_modes=merge_modes
            ).checked(),
        )


def _check_draft(draft: Draft | None) -> None:
    """A one-line KvtoolError unless `draft` is None or a Draft with sane fields."""
    if draft is None:
        return
    if not isinstance(draft, Draft):
        raise KvtoolError(f"draft must be a Draft(tokens, rounds, verify, jacobi) or None, got {draft!r}")
    for name, value in (("tokens", draft.tokens), ("rounds", draft.rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KvtoolError(f"draft {name} must be an integer >= 1, got {value!r}")
    for name, value in (("verify", draft.verify), ("jacobi", draft.jacobi)):
        if not isinstance(value, bool):
            raise KvtoolError(f"draft {name} must be true or false, got {value!r}")
