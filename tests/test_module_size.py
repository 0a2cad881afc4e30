"""A module of the package or the benchmarks runs to at most 400 lines unless its docstring says why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 400
REASON = f"Over {LIMIT} lines because"


def test_long_modules_state_their_reason() -> None:
    unexplained = []
    for folder in ("kvtool", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            lines = text.count("\n")
            if lines > LIMIT and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
                unexplained.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not unexplained, f"over {LIMIT} lines with no '{REASON} ...' in the docstring:\n" + "\n".join(unexplained)
