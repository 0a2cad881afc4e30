"""The "document" kind: questions, summaries and explanations over real texts users paste in.

Licences (Debian's common-licenses, Python's own LICENSE), sections of Python's language reference
and the man-db manual. Each prompt takes the leading paragraphs of its text, from a marked start,
as far as its length target allows; a question is only asked of an excerpt that contains what it
asks about (`needs`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from . import texts
from .common import CALIBRATION, EVALUATION, Count, Row, Window, longest_fit, same_draws
from .texts import Text

KIND = "document"
WINDOWS = {EVALUATION: Window(450, 1450), CALIBRATION: Window(420, 1020)}

AUDIENCES = (
    "a busy engineering manager",
    "a first-year computer science student",
    "a developer who has never read this kind of text before",
    "a colleague who will decide tomorrow whether we can use this",
)


@dataclass(frozen=True)
class Spec:
    task: str
    text: Callable[[], Text]
    what: str  # how the prompt names the text: "software licence", "section of the Python docs"
    start: str | None = None  # excerpt begins at the paragraph holding this string
    question: str = ""
    needs: str = ""  # the excerpt must contain this for the question to be answerable
    other: Callable[[], Text] | None = None  # second text, for "compare"
    other_start: str | None = None
    prose: bool = False  # re-flow every block (licences), not only unindented ones


def _blocks(text: Text, start: str | None, prose: bool) -> list[str]:
    blocks = [" ".join(b.split()) for b in texts.paragraphs(text.body)] if prose else texts.paragraphs(text.body)
    if start is None:
        return blocks
    at = next((i for i, block in enumerate(blocks) if start in block), None)
    if at is None:
        raise SystemExit(f"{text.name}: no paragraph contains {start!r}")
    return blocks[at:]


def _framed(ctx: str) -> str:
    return f"---\n{ctx}\n---"


def _prompt(spec: Spec, ctx: str, rng: random.Random, other: str = "") -> str:
    audience = rng.choice(AUDIENCES)
    if spec.task == "summary":
        return (f"Summarise the following {spec.what} for {audience}. One paragraph, and mention the points "
                f"that matter most in practice.\n\n{_framed(ctx)}\n\nYour summary:")
    if spec.task == "qa":
        return (f"Read the {spec.what} below and answer the question after it, using only what the text says. "
                f"Quote the sentence your answer rests on.\n\n{_framed(ctx)}\n\nQuestion: {spec.question}")
    if spec.task == "pasted-question":  # how people often ask: the text first, then the question
        return f"Here is the {spec.what} I am dealing with:\n\n{ctx}\n\n{spec.question}"
    if spec.task == "key-points":
        return (f"List the five most important rules or facts in the following {spec.what}, one line each, "
                f"most important first.\n\n{_framed(ctx)}\n\nThe five most important points:")
    if spec.task == "explain":
        return (f"Explain the main idea of the {spec.what} below to {audience}, with a simple everyday analogy, "
                f"then say what they should remember.\n\n{_framed(ctx)}\n\nYour explanation:")
    if spec.task == "quiz":
        return (f"Write three quiz questions, each with its answer, that check whether a reader understood the "
                f"{spec.what} below.\n\n{_framed(ctx)}\n\nThe three questions with answers:")
    if spec.task == "title":
        return (f"Suggest a title and a two-sentence abstract for the {spec.what} below, then say who it was "
                f"written for.\n\n{_framed(ctx)}\n\nTitle, abstract and audience:")
    if spec.task == "compare":
        return (f"Compare the two texts below. What do they have in common, and how do they differ? {spec.question}"
                f"\n\n=== Text A ===\n{ctx}\n\n=== Text B ===\n{other}\n\nCommon ground first, then the differences:")
    raise ValueError(spec.task)


def _row(spec: Spec, window: Window, rng: random.Random, count: Count) -> Row:
    first = spec.text()
    blocks = _blocks(first, spec.start, spec.prose)
    target = rng.randint(window.low + 150, window.high)
    prompt_rng = random.Random(rng.random())
    sources = (first.name,)
    other = ""
    if spec.other is not None:
        second = spec.other()
        other_blocks = _blocks(second, spec.other_start, spec.prose)
        # Text B gets about a third of the room, text A the rest.
        other, _ = longest_fit(lambda n: "\n\n".join(other_blocks[:n]), len(other_blocks), target // 3, count)
        sources += (second.name,)

    def build(n: int) -> str:
        return _prompt(spec, "\n\n".join(blocks[:n]), same_draws(prompt_rng), other)

    prompt, used = longest_fit(build, len(blocks), target, count)
    if spec.needs and spec.needs not in "\n\n".join(blocks[:used]):
        raise SystemExit(f"{first.name}: the excerpt ({used} paragraphs) lacks {spec.needs!r}; lower `start` or raise the window")
    return Row(prompt, KIND, spec.task, sources)



L = texts.licence

SPECS = {
    EVALUATION: [
        Spec("qa", lambda: L("Apache-2.0"), "software licence", start="4. Redistribution", prose=True, needs="NOTICE",
             question="A company wants to ship a modified version of an Apache-2.0 project inside its product. What "
                      "must it do when it redistributes the work (the licence copy, changed files, notices, the NOTICE "
                      "file), and may it put its own modifications under different licence terms?"),
        Spec("summary", lambda: L("GPL-3"), "software licence", start="Preamble", prose=True),
        Spec("pasted-question", lambda: L("GPL-3"), "licence section", start="6. Conveying Non-Source Forms", prose=True,
             needs="Corresponding Source",
             question="We sell a small router whose firmware contains GPLv3 programs. In which ways are we allowed to "
                      "give buyers the Corresponding Source, and how long would a written offer have to stay valid?"),
        Spec("qa", lambda: L("MPL-2.0"), "software licence", start="3. Responsibilities", prose=True, needs="Larger Work",
             question="If I combine MPL-2.0 files with my own proprietary code into a Larger Work and ship only an "
                      "executable, what must I make available, and under which licence can the rest of my work stay?"),
        Spec("key-points", lambda: L("Artistic"), "software licence", prose=True),
        Spec("explain", lambda: L("CC0-1.0"), "legal text", prose=True),
        Spec("qa", lambda: L("GFDL-1.3"), "documentation licence", start="2. VERBATIM COPYING", prose=True, needs="100",
             question="I want to print 150 copies of a manual released under this licence and sell them at a "
                      "conference. What do I have to do about the covers and about a transparent copy?"),
        Spec("pasted-question", lambda: texts.python_licence("history"), "history and licence notes of Python",
             needs="CNRI",
             question="In what order did Python's development move between organisations, and which releases were "
                      "not GPL-compatible? Make a short timeline."),
        Spec("summary", lambda: texts.topic("typesmapping"), "section of the Python documentation"),
        Spec("explain", lambda: texts.topic("string-methods"), "section of the Python documentation"),
        Spec("title", lambda: texts.topic("compound"), "section of the Python documentation"),
        Spec("quiz", lambda: texts.topic("typesseq"), "section of the Python documentation"),
        Spec("compare", lambda: L("GPL-3"), "licence sections", start="11. Patents", prose=True,
             other=lambda: L("Apache-2.0"), other_start="3. Grant of Patent License",
             question="Focus on what each says about patents and about suing contributors."),
    ],
    CALIBRATION: [
        Spec("summary", lambda: L("GPL-2"), "software licence", start="Preamble", prose=True),
        Spec("qa", lambda: L("LGPL-2.1"), "software licence", start="5. A program that contains no derivative",
             prose=True, needs="work that uses the Library",
             question="My closed-source program links dynamically against an LGPL-2.1 library. What does the licence "
                      "require of me when I distribute the program, and what counts as a work that uses the Library?"),
        Spec("key-points", lambda: L("MPL-1.1"), "software licence", start="3. Distribution Obligations", prose=True),
        Spec("compare", lambda: L("BSD"), "licences", prose=True, other=lambda: texts.python_licence("terms"),
             question="Focus on what a redistributor must keep or include."),
        Spec("pasted-question", lambda: L("LGPL-3"), "licence", prose=True, needs="Combined Work",
             question="What exactly must I provide along with a Combined Work under this licence? Give me a checklist."),
        Spec("explain", lambda: L("GPL-1"), "software licence", start="Preamble", prose=True),
        Spec("summary", lambda: texts.topic("execmodel"), "section of the Python documentation"),
        Spec("explain", lambda: texts.topic("naming"), "section of the Python documentation"),
        Spec("key-points", lambda: texts.topic("import"), "section of the Python documentation"),
        Spec("quiz", lambda: texts.topic("try"), "section of the Python documentation"),
    ],
}


def rows(split: str, count: Count) -> list[Row]:
    window = WINDOWS[split]
    return [_row(spec, window, random.Random(f"{split}:{KIND}:{i}"), count) for i, spec in enumerate(SPECS[split])]
