"""The "long-answer" kind: requests whose answers run to hundreds of tokens.

The other kinds mostly ask for a paragraph; a compressed cache that holds up for 64 tokens can still
drift over 300. These rows ask for what people ask a model to write at length: a study guide to a
section of Python's language reference, a function-by-function walkthrough of a stdlib module, a
module implemented from its documentation with its tests, and a documentation chat written up as a
tutorial. The other kinds use none of these texts.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable

from . import chats, texts
from .common import CALIBRATION, EVALUATION, Count, Row, Window, longest_fit

KIND = "long-answer"
# Short prompts are allowed: the answer is what grows the cache here. Calibration's are as long as its
# other prompts (400 tokens or more), so that the prompt's compression matters too.
WINDOWS = {EVALUATION: Window(150, 1450), CALIBRATION: Window(400, 1020)}

AUDIENCES = (
    "a student who knows a little Python",
    "a developer coming from JavaScript",
    "a colleague who has to teach this next week",
)

# Calibration scores these rows on references as long as the answers they ask for
# (kvtool.calibration.config.LONG_REFERENCE_TOKENS); the two sets share no text.
SOURCES = {
    EVALUATION: {
        "study-guide": ("class", "binary", "with", "objects"),
        "walkthrough": ("heapq.py", "reprlib.py", "linecache.py", "genericpath.py"),
        "implement": ("shelve", "fileinput", "csv", "argparse"),
        "tutorial-chat": ("raise", "async", "integers", "identifiers"),
    },
    CALIBRATION: {
        "study-guide": ("attribute-access", "calls"),
        "walkthrough": ("filecmp.py", "py_compile.py"),
        "implement": ("cmd", "timeit"),
        "tutorial-chat": ("augassign", "numeric-types"),
    },
}

TUTORIAL_FINALS = (
    "Thank you. Now please write all of this up as a complete tutorial: an introduction, one section for every "
    "point we discussed with a code example in each, and a summary at the end.",
    "Great. Could you turn our whole conversation into detailed lecture notes, with a heading and an example for "
    "each idea, in the order we covered them?",
    "Please write a long, step-by-step guide that covers everything above, with examples, so that I can read it "
    "again later without this chat.",
)


def _fit(parts: list[str], frame: Callable[[str], str], window: Window, rng: random.Random, count: Count) -> str:
    target = rng.randint(min(window.low + 150, window.high), window.high)
    prompt, _ = longest_fit(lambda n: frame("\n\n".join(parts[:n])), len(parts), target, count)
    return prompt


def _study_guide(name: str, window: Window, rng: random.Random, count: Count) -> Row:
    text = texts.topic(name)
    audience = rng.choice(AUDIENCES)

    def frame(ctx: str) -> str:
        return (f"Write a detailed study guide for {audience} on the section of the Python documentation below. Go "
                f"through it part by part, in order: for each part a heading, a summary of several sentences and a "
                f"short code example. End with a list of common mistakes.\n\n---\n{ctx}\n---\n\nYour study guide:")

    return Row(_fit(texts.paragraphs(text.body), frame, window, rng, count), KIND, "study-guide", (text.name,))


def _walkthrough(path: str, window: Window, rng: random.Random, count: Count) -> Row:
    text = texts.stdlib_file(path)
    lines = text.body.splitlines()
    # Whole functions and classes, in file order (module docstrings and constant tables left out).
    defs = [n for n in ast.parse(text.body).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    units = ["\n".join(lines[n.lineno - 1 : n.end_lineno]) + "\n" for n in defs]

    def frame(code: str) -> str:
        return ("Walk through the Python code below, function by function. For each function, explain what it does "
                "and how it works step by step, and show an example call with its result.\n\n```python\n"
                f"{code.strip()}\n```\n\nYour walkthrough:")

    target = rng.randint(min(window.low + 150, window.high), window.high)
    prompt, _ = longest_fit(lambda n: frame("\n".join(units[:n])), len(units), target, count)
    return Row(prompt, KIND, "walkthrough", (text.name,))


def _implement(module: str, window: Window, rng: random.Random, count: Count) -> Row:
    text = texts.module_doc(module)

    def frame(doc: str) -> str:
        return (f"Here is the documentation of a Python module:\n\n---\n{doc}\n---\n\nWrite a complete Python module "
                "that implements what it describes from scratch, with a docstring for every function and class, type "
                "hints and error handling. Then write unit tests for every function.")

    return Row(_fit(texts.paragraphs(text.body), frame, window, rng, count), KIND, "implement", (text.name,))


def _tutorial_chat(name: str, window: Window, rng: random.Random, count: Count) -> Row:
    row = chats.doc_row(name, window, rng, count, finals=TUTORIAL_FINALS)
    return Row(row.prompt, KIND, "tutorial-chat", row.sources)


MAKERS = {"study-guide": _study_guide, "walkthrough": _walkthrough, "implement": _implement, "tutorial-chat": _tutorial_chat}


def rows(split: str, count: Count) -> list[Row]:
    window = WINDOWS[split]
    # Tasks interleaved, so a leading slice mixes them.
    per_task = min((len(names) for names in SOURCES[split].values()), default=0)
    order = [(task, names[i]) for i in range(per_task) for task, names in SOURCES[split].items()]
    return [MAKERS[task](name, window, random.Random(f"{split}:{KIND}:{i}"), count) for i, (task, name) in enumerate(order)]
