"""The code, the docs and the CLI help speak the project's words: what is true now, not how it got there.

No development-history references: numbered work items of the project's own tracker or of its
development steps, run dates told as days, development sessions by number, "the profile it
replaced". The patterns below say them all. A comment that needs a measurement names the benchmark command and
its figure instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Case-insensitive, word-bounded. This file says them in its own examples, so it is not scanned.
_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
PATTERNS = [
    r"stop[ -]?\d+",
    r"stops? \d+(?:–|-|, )\d+",
    r"issue[ -]?#?\d+",
    r"that[ ]day",
    r"(?:slower|faster) day",
    r"the profile it replaced",
    rf"(?:{_ORDINALS}) session",
    r"this session",
    r"earlier stops?",
]
WORDS = re.compile("|".join(rf"\b(?:{p})\b" for p in PATTERNS), re.IGNORECASE)

# Where the project speaks: (folder, file name patterns). Prompt texts (kvtool/data/*.jsonl,
# scripts/promptsets' prompt modules) are natural text written for the model, not the project's prose.
SOURCES = [
    ("kvtool", ("*.py", "*.yaml")),
    ("tests", ("*.py",)),
    ("scripts", ("*.py", "*.sh")),
    ("benchmarks", ("*.py", "*.sh")),
]
TOP_FILES = ["README.md", "Makefile", "pyproject.toml"]
PROMPT_CODE = {"__init__.py", "common.py"}  # the code among scripts/promptsets' prompt texts
THIS_FILE = Path(__file__).resolve()


def _files() -> Iterator[Path]:
    for folder, patterns in SOURCES:
        for pattern in patterns:
            for path in sorted((ROOT / folder).rglob(pattern)):
                if "__pycache__" in path.parts or path.resolve() == THIS_FILE:
                    continue
                relative = path.relative_to(ROOT)
                if relative.parts[:2] == ("scripts", "promptsets") and path.name not in PROMPT_CODE:
                    continue
                yield path
    for name in TOP_FILES:
        if (ROOT / name).is_file():
            yield ROOT / name
    yield from sorted((ROOT / "docs").glob("*.md"))


def _hits(label: str, text: str) -> list[str]:
    return [
        f"{label}:{number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), 1)
        if WORDS.search(line)
    ]


def _report(hits: list[str]) -> str:
    return f"{len(hits)} development-history reference(s); say what is true now instead:\n" + "\n".join(hits)


def test_the_patterns_find_what_they_are_for():
    # Written in pieces, so that a plain search of the tree for these words finds none here either.
    stop, issue, day = "st" + "op", "iss" + "ue", " d" + "ay"
    for text in [f"({stop} 57)", f"{stop}-58's profile", f"{stop}58", f"{stop}s 60-61", f"{issue.title()} 34 asks",
                 f"{issue} #50", f"on that{day}", f"a slower{day}", f"Faster{day}", "the profile it replaced",
                 "the seventh session", "in this session", "earlier stops"]:
        assert WORDS.search(text), text
    for text in ['scope="session"', "nonstop", "stop_tokens", "a stopping rule", "the repeats stop early",
                 "one session a week", "the issue's target", "an earlier layer", "today"]:
        assert not WORDS.search(text), text


def test_sources_and_docs_have_no_history_words():
    hits: list[str] = []
    for path in _files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += _hits(str(path.relative_to(ROOT)), text)
    results = ROOT / "docs" / "results"
    if results.is_dir():
        hits += [
            f"docs/results/{path.name}: file name"
            for path in sorted(results.rglob("*"))
            if path.is_file() and WORDS.search(path.name.replace("_", " "))
        ]
    assert not hits, _report(hits)


def _command_paths() -> list[list[str]]:
    import typer.main

    from kvtool.cli import app as cli

    cli._register()
    paths: list[list[str]] = []

    def walk(command, path: list[str]) -> None:
        paths.append(path)
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, [*path, name])

    walk(typer.main.get_command(cli.app), [])
    return paths


def test_cli_help_has_no_history_words(monkeypatch):
    import typer.rich_utils
    from typer.testing import CliRunner

    from kvtool.cli.app import app

    # One line per help text, so that no phrase is split where the terminal would wrap it.
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 10_000)
    runner = CliRunner()
    hits: list[str] = []
    paths = _command_paths()
    assert len(paths) > 3  # the app, its commands, and inspect's subcommands
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "10000"})
        assert result.exit_code == 0, (path, result.output)
        hits += _hits(" ".join(["kvtool", *path, "--help"]), result.output)
    assert not hits, _report(hits)
