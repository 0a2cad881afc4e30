"""The runtime dependencies pyproject.toml declares are the ones kvtool's code imports."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Distribution name -> the module it installs, where they differ.
MODULE_OF = {"pyyaml": "yaml", "rouge-score": "rouge_score", "pillow": "PIL"}
# Needed by a dependency on kvtool's behalf, not imported by kvtool itself.
USED_THROUGH = {
    "gguf": "transformers reads .gguf weights with it (from_pretrained(..., gguf_file=...))",
    "accelerate": "transformers refuses to load .gguf weights without it",
}


def _imported_top_modules() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "kvtool").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_every_runtime_dependency_is_imported_by_the_package() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower() for spec in declared]
    imported = _imported_top_modules()
    unused = [name for name in names
              if name not in USED_THROUGH and MODULE_OF.get(name, name.replace("-", "_")) not in imported]
    assert not unused, f"declared in pyproject.toml but imported nowhere in kvtool/: {unused}"
