"""The "chat" kind: a multi-turn conversation laid out as a transcript in one user message, to be
continued by the assistant.

Two sources: the conversations of `chat_topics` (everyday and technical, slots filled by a seeded
draw), and technical chats whose assistant turns are paragraphs of Python's documentation, as a
user reading the docs with an assistant would see them. Transcript layouts and instructions vary.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from . import texts
from .chat_topics import CALIBRATION_TOPICS, EVALUATION_TOPICS, Topic
from .common import CALIBRATION, EVALUATION, Count, Row, Window, longest_fit, same_draws

KIND = "chat"
WINDOWS = {EVALUATION: Window(450, 1450), CALIBRATION: Window(420, 1020)}
SLOT = re.compile(r"\{(\w+)\}")

LAYOUTS = (("User", "Assistant"), ("[user]", "[assistant]"), ("Human", "AI"))

INSTRUCTIONS = (
    "Below is a conversation between a user and a helpful assistant. Continue it: write the assistant's next "
    "reply, taking everything said so far into account.\n\n{transcript}",
    "Here is a chat transcript. You are the assistant in it. Answer the user's last message.\n\n{transcript}\n\n"
    "Your reply:",
    "{transcript}\n\n(Continue the conversation as the assistant.)",
)

DOC_OPENERS = (
    "I am reading the Python documentation and I am confused. Where should I start?",
    "Hi! Can you walk me through this part of Python?",
    "I have to teach this topic tomorrow. Can you help me understand it first?",
)
DOC_FOLLOW_UPS = (
    "Can you explain that in simpler words?",
    "What does that mean in practice?",
    "Is there an exception to that rule?",
    "How would I use this in my own code?",
    "What happens if I get this wrong?",
    "Why was it designed that way?",
    "OK, go on. What comes next?",
)
DOC_FINALS = (
    "Could you give me a short example that uses what you just explained?",
    "Can you sum up the whole conversation in three bullet points?",
    "What is the most common mistake people make with this?",
)

DOC_CHATS = {
    EVALUATION: ("debugger", "strings", "comparisons", "dict", "context-managers"),
    CALIBRATION: ("assignment", "function", "exceptions", "customization"),
}
TOPICS = {EVALUATION: EVALUATION_TOPICS, CALIBRATION: CALIBRATION_TOPICS}


def _layout(turns: list[tuple[str, str]], rng: random.Random) -> str:
    """(role, text) turns, role "user" or "assistant", in one of the transcript layouts, then an instruction."""
    user, assistant = rng.choice(LAYOUTS)
    bracket = user.startswith("[")
    lines = [f"{user if role == 'user' else assistant}{chr(10) if bracket else ': '}{text}" for role, text in turns]
    return rng.choice(INSTRUCTIONS).format(transcript="\n\n".join(lines))



def _topic_row(topic: Topic, window: Window, rng: random.Random, count: Count) -> Row:
    values = {name: rng.choice(options) for name, options in topic.slots.items()}

    def fill(text: str) -> str:
        return SLOT.sub(lambda m: values.get(m.group(1), m.group(0)), text)

    final = fill(rng.choice(topic.finals))
    layout = random.Random(rng.random())
    turns = [(role, fill(text)) for pair in topic.pairs for role, text in zip(("user", "assistant"), pair)]

    def build(n: int) -> str:  # the first n exchanges, then the final question
        return _layout([*turns[: 2 * n], ("user", final)], same_draws(layout))

    prompt, _ = longest_fit(build, len(topic.pairs), window.high, count)
    return Row(prompt, KIND, "continue", (f"kvtool chat topics: {topic.name}",))


def doc_row(name: str, window: Window, rng: random.Random, count: Count, finals: tuple[str, ...] = DOC_FINALS) -> Row:
    """A chat over a section of the language reference; the user's last message is one of `finals`."""
    text = texts.topic(name)
    parts = texts.paragraphs(text.body)
    opener, final = rng.choice(DOC_OPENERS), rng.choice(finals)
    follow = list(DOC_FOLLOW_UPS)
    rng.shuffle(follow)
    target = rng.randint(window.low + 150, window.high)
    layout = random.Random(rng.random())

    def build(n: int) -> str:
        # The assistant explains in the docs' own words, two paragraphs a turn; the user asks a
        # follow-up between turns.
        turns = [("user", opener)]
        for i in range(0, n, 2):
            if i:
                turns.append(("user", follow[(i // 2) % len(follow)]))
            turns.append(("assistant", "\n\n".join(parts[i : min(i + 2, n)])))
        return _layout([*turns, ("user", final)], same_draws(layout))

    prompt, _ = longest_fit(build, len(parts), target, count)
    return Row(prompt, KIND, "continue-docs", (text.name,))


def rows(split: str, count: Count) -> list[Row]:
    window = WINDOWS[split]
    makers: list[Callable[[random.Random], Row]] = [
        (lambda rng, t=topic: _topic_row(t, window, rng, count)) for topic in TOPICS[split]
    ]
    makers += [(lambda rng, n=name: doc_row(n, window, rng, count)) for name in DOC_CHATS[split]]
    return [make(random.Random(f"{split}:{KIND}:{i}")) for i, make in enumerate(makers)]
