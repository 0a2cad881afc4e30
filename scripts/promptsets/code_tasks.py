"""The "code" kind: explain, continue, debug, test or review real functions of Python's standard library.

A row takes one function or method of a stdlib module (the focus) and as much of the code before it
as its length target allows, so the model sees the helpers the focus uses. "find-bug" rows carry one
small mutation of the focus (a flipped comparison, a dropped `not`, ...), checked to parse and to
change the code; the row records which.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

from . import texts
from .common import CALIBRATION, EVALUATION, Count, Row, Window

KIND = "code"
WINDOWS = {EVALUATION: Window(450, 1450), CALIBRATION: Window(420, 1020)}
TASKS = ("explain", "continue", "find-bug", "write-tests", "review")

# (module file under Lib/, focus "name" or "Class.method"). Evaluation and calibration use different modules.
FOCUS = {
    EVALUATION: (
        ("textwrap.py", "dedent"),
        ("shlex.py", "shlex.read_token"),
        ("fractions.py", "Fraction.limit_denominator"),
        ("colorsys.py", "hsv_to_rgb"),
        ("calendar.py", "Calendar.itermonthdays2"),
        ("fnmatch.py", "translate"),
        ("ipaddress.py", "summarize_address_range"),
        ("difflib.py", "get_close_matches"),
        ("string.py", "Formatter._vformat"),
        ("urllib/parse.py", "urljoin"),
        ("posixpath.py", "relpath"),
        ("graphlib.py", "TopologicalSorter.get_ready"),
        ("base64.py", "_b32encode"),
    ),
    CALIBRATION: (
        ("glob.py", "_iglob"),
        ("bisect.py", "bisect_left"),
        ("quopri.py", "decode"),
        ("sched.py", "scheduler.run"),
        ("mimetypes.py", "MimeTypes.guess_type"),
        ("shutil.py", "copyfileobj"),
        ("ntpath.py", "join"),
        ("copy.py", "_reconstruct"),
        ("html/__init__.py", "_replace_charref"),
        ("json/encoder.py", "py_encode_basestring_ascii"),
    ),
}

# One small change each, as a bug a person could make; tried in a seeded order until one applies.
MUTATIONS = (
    (r" <= ", " < "), (r" >= ", " > "), (r" < ", " <= "), (r" > ", " >= "),
    (r" == ", " != "), (r" != ", " == "), (r" and ", " or "), (r" or ", " and "),
    (r"\bnot ", ""), (r" \+ 1\b", ""), (r" - 1\b", ""), (r"\[1:\]", "[2:]"), (r"\[-1\]", "[0]"),
    (r"\bTrue\b", "False"), (r"\bFalse\b", "True"), (r"\bbreak\b", "continue"),
)


@dataclass(frozen=True)
class Focus:
    header: list[str]  # class header lines for a method, else empty
    units: list[tuple[int, int]]  # (first, last) 0-based line spans of the statements before the focus
    span: tuple[int, int]  # the focus itself
    body_start: int  # first line of the focus after its signature and docstring


def _span(node: ast.AST) -> tuple[int, int]:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first - 1, node.end_lineno - 1


def _find(tree: ast.Module, lines: list[str], name: str) -> Focus:
    owner, _, member = name.rpartition(".")
    body, header = tree.body, []
    if owner:
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            raise SystemExit(f"no class {owner} in the module")
        body, header = cls.body, lines[_span(cls)[0] : cls.lineno]  # decorators and the `class` line
    index = next(
        (i for i, n in enumerate(body) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member), None
    )
    if index is None:
        raise SystemExit(f"no function {name} in the module")
    node = body[index]
    first_body = node.body[1] if ast.get_docstring(node) and len(node.body) > 1 else node.body[0]
    return Focus(header, [_span(n) for n in body[:index]], _span(node), first_body.lineno - 1)


def _mutate(code: str, focus_lines: tuple[int, int], body_start: int, lines: list[str], rng: random.Random) -> tuple[list[str], str]:
    order = list(MUTATIONS)
    rng.shuffle(order)
    candidates = [i for i in range(body_start, focus_lines[1] + 1) if lines[i].strip() and not lines[i].lstrip().startswith("#")]
    for pattern, replacement in order:
        for i in candidates:
            code_part = lines[i].split("#", 1)[0]
            if "'" in code_part or '"' in code_part:
                continue  # keep strings intact: a change inside a literal is not the kind of bug meant
            changed = re.sub(pattern, replacement, lines[i], count=1)
            if changed == lines[i]:
                continue
            mutated = lines[:i] + [changed] + lines[i + 1 :]
            try:
                before, after = ast.dump(ast.parse(code)), ast.dump(ast.parse("\n".join(mutated)))
            except SyntaxError:
                continue
            if before != after:
                return mutated, f"planted bug, line {i - focus_lines[0] + 1} of the function: {lines[i].strip()!r} -> {changed.strip()!r}"
    raise SystemExit("no mutation applies")


def _prompt(task: str, module: str, name: str, code: str) -> str:
    block = f"```python\n{code}\n```"
    where = f"Python's `{module}` module"
    if task == "explain":
        return (f"Here is some code from {where}. Explain what `{name}` does, step by step, and show one example call "
                f"with its result.\n\n{block}")
    if task == "continue":
        return (f"The following code from {where} stops in the middle of `{name}`. Continue it: write the rest of "
                f"`{name}` in the same style, then explain in two sentences what the finished function does.\n\n{block}")
    if task == "find-bug":
        return (f"Someone changed one small thing in `{name}` below (from {where}), and now it has a bug. Find it, "
                f"explain for which inputs it goes wrong, and give the corrected line.\n\n{block}")
    if task == "write-tests":
        return (f"Write pytest unit tests for `{name}` (from {where}, shown below with the code around it). Cover "
                f"the normal cases and the edge cases, and say what each test checks.\n\n{block}")
    if task == "review":
        return (f"Review `{name}` below as you would in a code review: is it clear, which edge cases could break it, "
                f"how would you add type annotations? The code is from {where}.\n\n{block}")
    raise ValueError(task)


def _row(module_file: str, name: str, task: str, window: Window, rng: random.Random, count: Count) -> Row:
    text = texts.stdlib_file(module_file)
    lines = text.body.splitlines()
    focus = _find(ast.parse(text.body), lines, name)
    note = ""
    if task == "find-bug":
        lines, note = _mutate(text.body, focus.span, focus.body_start, lines, rng)
    last = focus.span[1]
    if task == "continue":  # stop about halfway through the body, at a line boundary
        last = focus.body_start + max(1, (focus.span[1] - focus.body_start) // 2)
    module = module_file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    target = rng.randint(window.low + 100, window.high)

    gap = "    ..." if focus.header else "# ..."

    # Each statement with the blank lines and comments that follow it, up to the next one.
    starts = [first for first, _ in focus.units] + [focus.span[0]]
    spans = [(starts[i], starts[i + 1]) for i in range(len(focus.units))]

    def build(chosen: list[int]) -> str:
        # The chosen statements before the focus, in file order; "..." where code is left out.
        body = list(focus.header)
        previous = -1
        for i in sorted(chosen):
            if i != previous + 1:
                body.append(gap)
            body += lines[spans[i][0] : spans[i][1]]
            previous = i
        if previous != len(focus.units) - 1:
            body.append(gap)
        body += lines[focus.span[0] : last + 1]
        return _prompt(task, module, name, "\n".join(body).rstrip())

    # Nearest statements first; one too long for the room is skipped, not the end of the excerpt.
    chosen: list[int] = []
    if count(build(chosen)) > target:
        raise SystemExit(f"{text.name}: {name} alone exceeds {target} tokens")
    for i in reversed(range(len(focus.units))):
        if count(build([*chosen, i])) <= target:
            chosen.append(i)
    prompt = build(chosen)
    return Row(prompt, KIND, task, (text.name,), note=note)


def rows(split: str, count: Count) -> list[Row]:
    window = WINDOWS[split]
    return [
        _row(module, name, TASKS[i % len(TASKS)], window, random.Random(f"{split}:{KIND}:{i}"), count)
        for i, (module, name) in enumerate(FOCUS[split])
    ]
