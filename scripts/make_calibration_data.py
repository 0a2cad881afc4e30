"""Build kvtool's shipped prompt sets from texts that come with Python itself.

    .venv/bin/python scripts/make_calibration_data.py

writes `kvtool/data/calibration.jsonl` (calibration prompts) and `kvtool/data/evaluation.jsonl`
(distinct prompts for evaluation). Every prompt is an instruction over a long context — a summary,
an explanation, a quiz, a comparison, or a multi-turn chat to continue — built from the language
reference (`pydoc_data.topics`), long module docstrings, Python's LICENSE and `this`. The two sets
use disjoint source texts, so evaluation never sees a calibration context.

Lengths are measured with the SmolLM2 tokenizer when the embedded model is installed (the chat
template included, as `kvtool calibrate` sees them), otherwise estimated at 4 characters a token.
The output depends on the Python version's stdlib texts: the committed files were made with the
version recorded in each line's `source`, and regenerating elsewhere may change them.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
import random
import re
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "kvtool" / "data"
SEED = 20240604

# Prompt length window in tokens (formatted prompt): long enough for compression to matter,
# short enough that 10 of them calibrate a small model on a laptop CPU in minutes.
MIN_TOKENS, MAX_TOKENS = 420, 1150

UNDERLINE = re.compile(r"^\s*([*=\-^~])\1{2,}\s*$")

PY = f"Python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"


# --------------------------------------------------------------------------- source texts


def _topic(name: str) -> Callable[[], str]:
    def text() -> str:
        from pydoc_data.topics import topics

        return topics[name]

    return text


def _module_doc(module: str, attribute: str = "__doc__") -> Callable[[], str]:
    def text() -> str:
        import importlib

        return getattr(importlib.import_module(module), attribute)

    return text


def _object_doc(module: str, name: str) -> Callable[[], str]:
    """The docstring of a class or function, `name` a dotted path inside `module`."""

    def text() -> str:
        import importlib
        import inspect

        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return inspect.getdoc(obj)

    return text


def _license(part: str) -> Callable[[], str]:
    def text() -> str:
        full = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
        history, _, terms = full.partition("B. TERMS AND CONDITIONS")
        return history if part == "history" else "B. TERMS AND CONDITIONS" + terms

    return text


def _zen() -> str:
    # `import this` prints the poem; keep the script's own output clean.
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


@dataclass(frozen=True)
class Source:
    label: str
    text: Callable[[], str]


def source(label: str) -> Source:
    if label.startswith("topic:"):
        return Source(f"pydoc_data.topics[{label[6:]!r}]", _topic(label[6:]))
    if label.startswith("license:"):
        return Source(f"LICENSE.txt ({label[8:]})", _license(label[8:]))
    if label == "zen":
        return Source("this (The Zen of Python)", _zen)
    if label.startswith("doc:"):
        module, _, name = label[4:].partition(":")
        return Source(f"{module}.{name}.__doc__", _object_doc(module, name))
    module, _, attribute = label.partition(".")
    return Source(f"{module}.{attribute or '__doc__'}", _module_doc(module, attribute or "__doc__"))


# --------------------------------------------------------------------------- tasks

FOLLOW_UPS = (
    "Can you explain that in simpler words?",
    "What does that mean in practice?",
    "Is there an exception to that rule?",
    "How would I use this in my own code?",
    "What happens if I get this wrong?",
    "Why was it designed that way?",
    "Could you go on? What comes next?",
)

OPENERS = (
    "I am reading the Python documentation and I am confused. Where should I start?",
    "Hi! Can you walk me through this part of Python?",
    "I have to teach this topic tomorrow. Can you help me understand it first?",
)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks; prose is re-flowed, indented blocks (code) stay as they are.

    reST underlines ("*****", "=====") are dropped: joined onto their heading they read as noise.
    """
    blocks = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if not UNDERLINE.match(line)]
        if not any(line.strip() for line in lines):
            continue
        text_block = "\n".join(lines)
        blocks.append(text_block.rstrip() if text_block.startswith(" ") else " ".join(text_block.split()))
    return blocks


def summary(ctx: str) -> str:
    return (
        "Summarize the following excerpt from the Python documentation in one clear paragraph "
        f"for an experienced programmer.\n\n---\n{ctx}\n---\n\nNow write the one-paragraph summary."
    )


def explain(ctx: str) -> str:
    return (
        "Read the text below and explain its main idea to a beginner, using a simple everyday "
        f"analogy.\n\n---\n{ctx}\n---\n\nExplain the main idea to a beginner, with an analogy."
    )


def rules(ctx: str) -> str:
    return (
        "List the five most important rules or facts stated in the following documentation, "
        f"one line each, most important first.\n\n---\n{ctx}\n---\n\nThe five most important points are:"
    )


def quiz(ctx: str) -> str:
    return (
        "Write three quiz questions, each with its answer, that test whether a student understood "
        f"the text below.\n\n---\n{ctx}\n---\n\nWrite the three questions with answers."
    )


def title(ctx: str) -> str:
    return (
        "Suggest a title and a two-sentence abstract for the following text, then name the audience "
        f"it was written for.\n\n---\n{ctx}\n---\n\nTitle, abstract and audience:"
    )


def describe(ctx: str) -> str:
    return (
        "The text below describes a part of Python. Describe, in your own words, a small program "
        f"that would use what it describes, and say what the program prints.\n\n---\n{ctx}\n---\n\n"
        "Describe the program."
    )


def chat(ctx: str, rng: random.Random) -> str:
    """A conversation in which the assistant's turns are the source's paragraphs, to be continued."""
    parts = paragraphs(ctx)
    turns = [f"User: {rng.choice(OPENERS)}"]
    follow = list(FOLLOW_UPS)
    rng.shuffle(follow)
    for i, part in enumerate(parts):
        turns.append(f"Assistant: {part}")
        if i < len(parts) - 1 and i % 2 == 1:
            turns.append(f"User: {follow[(i // 2) % len(follow)]}")
    turns.append(f"User: {follow[-1]} Please keep it short.")
    transcript = "\n\n".join(turns)
    return (
        "Below is a conversation between a user and a helpful assistant about Python. You are the "
        f"assistant: write your next reply.\n\n{transcript}\n\nWrite the assistant's next reply."
    )


def compare(ctx: str, other: str) -> str:
    return (
        "Compare the two sections of documentation below: what do they have in common, and how do "
        f"they differ?\n\n=== Section A ===\n{ctx}\n\n=== Section B ===\n{other}\n\n"
        "Answer in a few sentences: common ground first, then the differences."
    )


SIMPLE_TASKS = {"summary": summary, "explain": explain, "rules": rules, "quiz": quiz, "title": title, "describe": describe}

# (task, source label[, second source for "compare"]). Calibration and evaluation share no source.
CALIBRATION = [
    ("summary", "topic:execmodel"),
    ("explain", "topic:naming"),
    ("rules", "topic:import"),
    ("quiz", "topic:try"),
    ("chat", "topic:assignment"),
    ("summary", "topic:comparisons"),
    ("describe", "topic:calls"),
    ("chat", "topic:function"),
    ("title", "heapq.__about__"),
    ("explain", "topic:with"),
    ("rules", "topic:class"),
    ("chat", "turtle"),
    ("summary", "license:terms"),
    ("quiz", "topic:raise"),
    ("compare", "topic:for", "topic:while"),
    ("describe", "topic:async"),
    ("chat", "topic:exceptions"),
    ("compare", "zen", "topic:objects"),
    ("rules", "topic:attribute-access"),
    ("summary", "argparse"),
    ("chat", "topic:customization"),
    ("quiz", "topic:numeric-types"),
    ("title", "topic:sequence-types"),
    ("compare", "topic:context-managers", "topic:global"),
    ("chat", "pdb"),
    ("describe", "topic:formatstrings"),
    ("explain", "topic:identifiers"),
    ("summary", "topic:specialnames"),
]

EVALUATION = [
    ("summary", "topic:strings"),
    ("explain", "topic:typesmapping"),
    ("chat", "topic:compound"),
    ("rules", "topic:types"),
    ("quiz", "topic:string-methods"),
    ("describe", "statistics"),
    ("compare", "license:history", "topic:id-classes"),
    ("chat", "topic:debugger"),
    ("summary", "topic:typesseq"),
    ("explain", "topic:operator-summary"),
    ("compare", "topic:subscriptions", "topic:slicings"),
    ("chat", "topic:typesseq-mutable"),
    ("compare", "topic:typesmethods", "topic:in"),
    ("quiz", "topic:binary"),
    ("describe", "csv"),
    ("summary", "cmd"),
    ("chat", "topic:dict"),
    ("title", "topic:augassign"),
    ("compare", "topic:return", "topic:yield"),
    ("explain", "topic:booleans"),
    # Added later (appended, so the first 20 prompts are unchanged): 20 prompts give each method's
    # ROUGE-L a standard error of 0.02-0.07, as large as the differences between methods.
    ("summary", "re"),
    ("explain", "configparser"),
    ("chat", "socketserver"),
    ("rules", "doc:optparse:OptionParser"),
    ("quiz", "json"),
    ("describe", "doc:difflib:SequenceMatcher"),
    ("compare", "topic:integers", "topic:floating"),
    ("chat", "sys"),
    ("summary", "aifc"),
    ("explain", "site"),
    ("compare", "topic:specialattrs", "topic:typesmodules"),
    ("chat", "sunau"),
    ("quiz", "fileinput"),
    ("rules", "ssl"),
    ("describe", "doc:logging:basicConfig"),
    ("compare", "topic:power", "topic:unary"),
    ("summary", "doc:http.server:BaseHTTPRequestHandler"),
    ("title", "wave"),
    ("explain", "doc:difflib:Differ"),
    ("compare", "topic:assert", "topic:del"),
]


# --------------------------------------------------------------------------- lengths


def token_counter() -> tuple[Callable[[str], int], str]:
    """Tokens of a prompt as calibration formats it; a character estimate without the model."""
    try:
        sys.path.insert(0, str(ROOT))
        from kvtool.models import format_prompts, prepare_tokenizer
        from kvtool.models.convert import ensure_converted
        from kvtool.models.resolve import resolve
        from transformers import AutoTokenizer

        where = ensure_converted(Path(resolve("smollm2").location))
        tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(str(where)))
    except Exception as exc:  # noqa: BLE001 - any failure means: no tokenizer, estimate instead
        print(f"SmolLM2 tokenizer unavailable ({type(exc).__name__}); estimating 4 characters per token")
        return (lambda prompt: len(prompt) // 4), "estimate"

    def count(prompt: str) -> int:
        text = format_prompts(tokenizer, [prompt])[0]
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count, "smollm2"


def fit(build: Callable[[str], str], text: str, target: int, count: Callable[[str], int]) -> str:
    """The longest leading run of paragraphs whose prompt stays within `target` tokens."""
    parts = paragraphs(text)
    best = ""
    for end in range(1, len(parts) + 1):
        prompt = build("\n\n".join(parts[:end]))
        if count(prompt) > target:
            break
        best = prompt
    if not best:
        raise SystemExit(f"even one paragraph is longer than {target} tokens; pick another source")
    return best


def make(
    entries: list[tuple[str, ...]], rng: random.Random, count: Callable[[str], int], how: str
) -> list[dict]:
    records = []
    for entry in entries:
        task, first = entry[0], source(entry[1])
        target = rng.randint(MIN_TOKENS + 150, MAX_TOKENS)
        if task == "compare":
            second = source(entry[2])
            other = "\n\n".join(paragraphs(second.text()))
            # Split the room evenly: section B is cut to its own share first.
            other_prompt = fit(lambda ctx: ctx, other, target // 2, count)
            prompt = fit(lambda ctx: compare(ctx, other_prompt), first.text(), target, count)
            label = f"{first.label} + {second.label}"
        elif task == "chat":
            prompt = fit(lambda ctx: chat(ctx, random.Random(entry[1])), first.text(), target, count)
            label = first.label
        else:
            prompt = fit(SIMPLE_TASKS[task], first.text(), target, count)
            label = first.label
        tokens = count(prompt)
        if not MIN_TOKENS <= tokens <= MAX_TOKENS:
            raise SystemExit(f"{task} over {label}: {tokens} tokens, outside [{MIN_TOKENS}, {MAX_TOKENS}]")
        records.append({"prompt": prompt, "task": task, "source": f"{label}, {PY}", f"tokens_{how}": tokens})
    return records


def write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as stream:
        for record in records:
            stream.write(json.dumps(record, ensure_ascii=False) + "\n")
    lengths = [next(v for k, v in r.items() if k.startswith("tokens_")) for r in records]
    print(f"{path.relative_to(ROOT)}: {len(records)} prompts, tokens min {min(lengths)} "
          f"mean {sum(lengths) / len(lengths):.0f} max {max(lengths)}")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    count, how = token_counter()
    print(f"token counts: {how}", flush=True)
    rng = random.Random(SEED)
    write(DATA / "calibration.jsonl", make(CALIBRATION, rng, count, how))
    write(DATA / "evaluation.jsonl", make(EVALUATION, rng, count, how))


if __name__ == "__main__":
    main()
