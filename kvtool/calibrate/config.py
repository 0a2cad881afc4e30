"""What one calibration run does: prompts drawn, their length, references, D and merge candidates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtool.errors import KvtoolError
from kvtool.profiles import MERGE_MODES, MethodSettings
from kvtool.profiles.schema import ANSWER_REFERENCES
from kvtool.calibrate.recipes import SearchSpace

DEFAULT_SAMPLES = 10
DEFAULT_MAX_PROMPT_TOKENS = 1024
# All default samples in one batch: per-token steps cost about the same for 1 row as for 10.
DEFAULT_BATCH_SIZE = 10
DEFAULT_CANDIDATES = (0, 8, 16, 25, 48, 96)
# As long as kvtool eval's default generation: the fixed-point queue holds about D entries, so the
# last D prompt entries are gone after ~D / (1 - budget) steps; 32-token references ended before
# that and favoured a D that lost on 64-token generations (smollm2 at 0.2: D 25 -> 48, held-out
# PPL 2.987 -> 2.809). Still a CPU calibration in minutes.
REFERENCE_TOKENS = 64
# New tokens each compressing layer sees over the whole prompt before it compresses (the profile's
# `lookahead`). Off by default: during those tokens every layer holds the whole prompt, so the peak
# KV memory is the full cache's, and a generation shorter than the lookahead never compresses at all
# (README, "Lookahead": what it buys and what it costs, measured).
DEFAULT_LOOKAHEAD = 0
# Tokens drafted at the budget to score the prompt a second time (the profile's `draft`): as long as
# the references calibration scores and eval's default generation. On the 30 calibration prompts
# neither built-in draw uses, the built-in profiles with a draft of 64 against none: NLL per token
# -0.066 +- 0.017 at 0.2 (needles 0.542 vs 0.208) and -0.041 +- 0.014 at 0.5; 8 tokens did nothing
# (-0.003), 32 came close (-0.056 +- 0.018). It costs one more prompt forward, never memory
# (README, "Draft").
DEFAULT_DRAFT = 64
# Rounds of that draft (the profile's `draft_rounds`): the second drafts through the cache the first
# scored. On the same 30 prompts, two rounds against one: at 0.2 NLL per token -0.038 +- 0.015
# (lower on 19), ROUGE-L +0.026 +- 0.014, needles the same (0.542); at 0.5 NLL -0.019 +- 0.011,
# ROUGE-L +0.008 +- 0.022. It costs one prompt forward and 63 steps more (README, "Draft").
DEFAULT_DRAFT_ROUNDS = 2
# Verified drafts (the profile's `draft_verify`): each round's draft is checked against the
# full-attention logits of the forward that scores it; later rounds draft from the verified prefix
# and the answer starts with it. On the same 30 prompts, the shipped 0.2 profile with and without:
# ROUGE-L +0.115 +- 0.032 (ahead on 18, behind on 6), NLL per token -0.031 +- 0.018, needles the
# same (0.750). It costs a few rows of the output projection (README, "Verified drafts").
DEFAULT_DRAFT_VERIFY = True
# Reused drafts (the profile's `draft_reuse`): the verified tokens' keys and values are the draft
# forward's (the full cache's own) instead of the compressed cache's recomputation.
DEFAULT_DRAFT_REUSE = False
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

    samples: int = DEFAULT_SAMPLES
    seed: int = 0
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    method: MethodSettings = MethodSettings()
    candidates: Sequence[int] = DEFAULT_CANDIDATES
    reference_tokens: int = REFERENCE_TOKENS
    batch_size: int = DEFAULT_BATCH_SIZE
    merge_modes: Sequence[str] = DEFAULT_MERGE_MODES
    # The recipe search (kvtool.calibrate.recipes); None keeps `method`'s rules and searches only
    # D x `merge_modes` (the papers' recipe). A search takes its D values and merge modes from
    # `candidates` and `merge_modes`; empty `candidates` skips every search.
    search: SearchSpace | None = SearchSpace()
    # The reference of a prompt with exact `answers` in the recipe search: "forced" (its answers
    # joined, forced right after the prompt) or "in-context" (the full cache's continuation, scored
    # only where it writes them: the generation rule then runs through the words before the answer).
    # Forced stays the default: on the calibration prompts neither built-in draw uses, in-context
    # found more needles at 0.2 and fewer at 0.5, with higher PPL at both (README, "Scoring the
    # answer where the model writes it").
    answer_references: str = "forced"
    # Written into the profile and applied to every recipe the search measures (not searched: every
    # candidate would gain from a longer one, and it holds the whole prompt that many tokens longer).
    lookahead: int = DEFAULT_LOOKAHEAD
    # What the lookahead holds: 0, the whole prompt; c >= 1, c times each layer's share.
    lookahead_hold: float = 0.0
    # Written into the profile like the lookahead: tokens drafted at the budget whose attention
    # joins the prompt's scores in a second prompt forward (MethodSettings.draft; 0: none).
    draft: int = DEFAULT_DRAFT
    draft_rounds: int = DEFAULT_DRAFT_ROUNDS
    draft_verify: bool = DEFAULT_DRAFT_VERIFY
    draft_reuse: bool = DEFAULT_DRAFT_REUSE
    # After the search, measure its pick and the recipes one generation rule or ratio source away with
    # the draft, and ship the best if the held-out prompts agree (`calibrate.drafted`). Off by default:
    # each candidate pays its own prompt forwards and drafts, which takes the default 10-prompt run
    # past 3 minutes; the built-in profiles are made with it (scripts/build_builtin_profiles.sh).
    draft_stage: bool = False

    def checked(self) -> "CalibrateConfig":
        """The same settings with tuples for sequences and duplicates dropped; a one-line
        KvtoolError for the first bad one."""
        method = self.method or MethodSettings()
        candidates = tuple(self.candidates)
        merge_modes = tuple(dict.fromkeys(self.merge_modes)) or (method.merge,)
        samples = self.samples
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
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
        if self.answer_references not in ANSWER_REFERENCES:
            raise KvtoolError(
                f"answer references must be one of {', '.join(ANSWER_REFERENCES)}, got {self.answer_references!r}"
            )
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise KvtoolError(f"lookahead must be an integer >= 0, got {self.lookahead!r}")
        if not (self.lookahead_hold == 0 or self.lookahead_hold >= 1):
            raise KvtoolError(f"lookahead hold must be 0 (the whole prompt) or at least 1, got {self.lookahead_hold!r}")
        if isinstance(self.draft, bool) or not isinstance(self.draft, int) or self.draft < 0:
            raise KvtoolError(f"draft must be an integer >= 0, got {self.draft!r}")
        if isinstance(self.draft_rounds, bool) or not isinstance(self.draft_rounds, int) or self.draft_rounds < 1:
            raise KvtoolError(f"draft rounds must be an integer >= 1, got {self.draft_rounds!r}")
        if self.draft_stage and not self.draft:
            raise KvtoolError("the draft stage measures recipes with their draft: it needs --draft above 0")
        if self.draft_stage and self.search is None:
            raise KvtoolError("the draft stage re-ranks the recipe search's pick: it needs the search")
        if self.draft and self.lookahead:
            raise KvtoolError("a draft and a lookahead cannot be combined: ask for --draft 0 with a lookahead")
        if self.reference_tokens < 1 or self.batch_size < 1:
            raise KvtoolError("reference tokens and batch size must be at least 1")
        return CalibrateConfig(
            samples=samples,
            seed=self.seed,
            max_prompt_tokens=self.max_prompt_tokens,
            method=method,
            candidates=candidates,
            reference_tokens=self.reference_tokens,
            batch_size=self.batch_size,
            merge_modes=merge_modes,
            answer_references=self.answer_references,
            lookahead=self.lookahead,
            lookahead_hold=float(self.lookahead_hold),
            draft=self.draft,
            draft_rounds=self.draft_rounds,
            draft_verify=bool(self.draft_verify),
            draft_reuse=bool(self.draft_reuse),
            draft_stage=bool(self.draft_stage),
            # One list of D candidates and merge modes: the search's are the config's.
            search=None if self.search is None else replace(
                self.search, distances=candidates or self.search.distances, merge_modes=merge_modes
            ).checked(),
        )
