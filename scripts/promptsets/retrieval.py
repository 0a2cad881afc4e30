"""The "retrieval" kind: RULER-style needles in a haystack, with exact answers.

A needle is the sentence "One of the special magic numbers for KEY is: VALUE." (KEY a hyphenated
pair of words, VALUE a 7-digit number). Haystacks are RULER's noise (one fixed paragraph repeated)
or running prose from a real text. Variants: one needle; several needles with different keys, one
of them asked for; several values for one key, all asked for. `answers` lists the values asked for;
each appears in the prompt exactly once, the asked key only in its needles and the question.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from . import texts
from .common import CALIBRATION, EVALUATION, Count, Row, Window, longest_fit
from .texts import Text

KIND = "retrieval"
# Evaluation prompts are long (the budget matters most there); calibration ones stay within the
# 1024 tokens `kvtool calibrate` keeps by default, so no needle is cut out of the middle.
WINDOWS = {EVALUATION: Window(1000, 2000), CALIBRATION: Window(700, 1020)}
TARGETS = {EVALUATION: (1150, 1950), CALIBRATION: (780, 1010)}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_NAME = "RULER noise filler"
SEVEN_DIGITS = re.compile(r"\d{7}")

# Needle keys: evaluation and calibration draw from different words.
KEY_WORDS = {
    EVALUATION: (
        ("amber", "brisk", "crimson", "dusty", "gentle", "hollow", "ivory", "jagged", "lucky", "mellow", "nimble",
         "quiet", "rustic", "silver", "tender", "velvet", "wistful", "zesty"),
        ("lantern", "harbour", "meadow", "violin", "compass", "orchard", "pebble", "falcon", "teapot", "glacier",
         "ribbon", "saddle", "thimble", "walnut", "canyon", "beacon", "quill", "marble"),
    ),
    CALIBRATION: (
        ("bold", "cosy", "eager", "frosty", "grumpy", "humble", "icy", "jolly", "keen", "lofty", "murky", "noisy",
         "proud", "rapid", "sturdy", "tidy"),
        ("anchor", "biscuit", "candle", "dragon", "engine", "feather", "garden", "helmet", "island", "jacket",
         "kettle", "ladder", "mirror", "needle", "oyster", "parrot"),
    ),
}

ESSAYS: dict[str, tuple[Callable[[], Text], ...]] = {
    EVALUATION: (texts.idle_guide, lambda: texts.stdlib_file("email/architecture.rst")),
    CALIBRATION: (texts.man_db_manual, lambda: texts.stdlib_file("idlelib/HISTORY.txt")),
}

# (variant, haystack) per row; the mix follows RULER's single / multi-key / multi-value needles.
PLAN = {
    EVALUATION: (
        ("single", "noise"), ("single", "essay"), ("multikey", "noise"), ("multikey", "essay"), ("multivalue", "noise"),
        ("multivalue", "essay"), ("single", "noise"), ("single", "essay"), ("multikey", "noise"), ("multikey", "essay"),
        ("multivalue", "noise"), ("multivalue", "essay"), ("multikey", "essay"),
    ),
    CALIBRATION: (
        ("single", "noise"), ("single", "essay"), ("multikey", "noise"), ("multikey", "essay"), ("multivalue", "noise"),
        ("multivalue", "essay"), ("single", "noise"), ("single", "essay"), ("multikey", "noise"), ("multivalue", "essay"),
    ),
}

HEADER = (
    "A long text follows. Some special magic numbers are hidden in it. Read it carefully and remember them: "
    "you will be asked about them at the end."
)


@dataclass(frozen=True)
class Needle:
    key: str
    value: str

    @property
    def sentence(self) -> str:
        return f"One of the special magic numbers for {self.key} is: {self.value}."


def _needles(variant: str, split: str, rng: random.Random) -> tuple[list[Needle], str]:
    adjectives, nouns = KEY_WORDS[split]
    keys = [f"{a}-{n}" for a, n in zip(rng.sample(adjectives, 4), rng.sample(nouns, 4))]
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), 4)]
    if variant == "single":
        return [Needle(keys[0], values[0])], keys[0]
    if variant == "multikey":  # the asked key among distractor keys, in random order
        needles = [Needle(k, v) for k, v in zip(keys, values)][: rng.randint(2, 4)]
        asked = rng.choice(needles).key
        rng.shuffle(needles)
        return needles, asked
    count = rng.randint(2, 4)
    return [Needle(keys[0], v) for v in values[:count]], keys[0]


def _question(variant: str, key: str) -> str:
    if variant == "multivalue":
        return (f"What are all the special magic numbers for {key} mentioned in the text above? "
                "List every one of them.")
    return f"What is the special magic number for {key} mentioned in the text above? Answer with the number."


def _row(split: str, variant: str, haystack: str, essay: Text | None, rng: random.Random, count: Count) -> Row:
    needles, asked = _needles(variant, split, rng)
    answers = tuple(n.value for n in needles if n.key == asked)
    if essay is None:
        units, sources = [NOISE] * 400, (NOISE_NAME,)
    else:
        # A 7-digit run in the text would read as one more magic number.
        sentences = [s for s in texts.sentences(essay.body) if not SEVEN_DIGITS.search(s)]
        start = rng.randrange(len(sentences))
        units, sources = sentences[start:] + sentences[:start], (essay.name,)
    depths = sorted(rng.uniform(0.05, 0.95) for _ in needles)
    low, high = TARGETS[split]
    target = rng.randint(low, high)

    def build(n: int) -> str:
        body = list(units[:n])
        for depth, needle in sorted(zip(depths, needles), key=lambda pair: -pair[0]):
            body.insert(round(depth * n), needle.sentence)  # deepest first, so earlier indices stay put
        return f"{HEADER}\n\n{' '.join(body)}\n\n{_question(variant, asked)}"

    prompt, _ = longest_fit(build, len(units), target, count)
    for needle in needles:
        if prompt.count(needle.value) != 1:
            raise SystemExit(f"{needle.value} occurs {prompt.count(needle.value)} times in a {variant} prompt")
    asked_needles = sum(n.key == asked for n in needles)
    if prompt.count(asked) != asked_needles + 1:
        raise SystemExit(f"key {asked} occurs outside its needles and question")
    key_source = f"kvtool needle keys ({split} words)"
    return Row(prompt, KIND, f"{variant}-{haystack}", (*sources, key_source), answers=answers)


def rows(split: str, count: Count) -> list[Row]:
    out = []
    essays = ESSAYS[split]
    for i, (variant, haystack) in enumerate(PLAN[split]):
        rng = random.Random(f"{split}:{KIND}:{i}")
        # Essay rows take the split's texts in turn.
        essay_rows = sum(h == "essay" for _, h in PLAN[split][:i])
        essay = essays[essay_rows % len(essays)]() if haystack == "essay" else None
        out.append(_row(split, variant, haystack, essay, rng, count))
    return out
