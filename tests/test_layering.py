"""Dependencies run one way: every kvtool module imports only from its own layer or lower ones.

Walks every module's imports with `ast`, function-local ones and `TYPE_CHECKING` blocks included,
so a back door hidden inside a function fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvtool"

# Lowest first. A module may import from its own layer and every layer before it.
LAYERS = (
    ("kvtool.errors", "kvtool.files", "kvtool.units", "kvtool.version"),
    ("kvtool.profiles",),
    ("kvtool.models",),
    ("kvtool.runtime",),
    ("kvtool.data", "kvtool.scoring"),
    ("kvtool.calibration",),
    ("kvtool.evaluation", "kvtool.bench"),
    # The exporter (profile -> an engine's flags) and the server (requests -> batched generation):
    # each its own room, above everything they use and below the commands that start them.
    ("kvtool.export",),
    ("kvtool.serve",),
    ("kvtool.cli",),
    # The package's face (kvtool/__init__.py): it names the public API of every layer, and no
    # module of kvtool imports it.
    ("kvtool",),
)


def layer_of(module: str) -> int:
    best, depth = None, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            # "kvtool" itself matches only the package's own __init__, not its subpackages.
            exact = name == "kvtool"
            if (module == name or (not exact and module.startswith(name + "."))) and len(name) > depth:
                best, depth = index, len(name)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
    return [(line, name) for line, name in found if name == "kvtool" or name.startswith("kvtool.")]


MODULES = sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in MODULES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_point_down(path):
    source = module_name(path)
    mine = layer_of(source)
    against = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
        for line, target in imported(path)
        if layer_of(target) > mine
    ]
    assert not against, "imports against the layer order:\n" + "\n".join(against)


def test_the_walk_sees_function_local_imports(tmp_path):
    # The check would be blind if it read only top-level statements.
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kvtool.cli.app import app\n")
    assert imported(probe) == [(2, "kvtool.cli.app")]


def local_imports(path: Path) -> list[int]:
    """Lines of kvtool imports inside functions."""
    lines = []
    for func in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                )
                if any(n == "kvtool" or n.startswith("kvtool.") for n in names) or getattr(node, "level", 0):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_function_local_imports_only_where_they_keep_help_fast():
    # The CLI imports its commands' machinery inside the commands so `kvtool --help` loads no torch;
    # anywhere else an import inside a function only hides a dependency.
    hidden = [
        f"{path.relative_to(ROOT.parent)}:{line}"
        for path in MODULES
        if not module_name(path).startswith("kvtool.cli")
        for line in local_imports(path)
    ]
    assert not hidden, "function-local kvtool imports outside kvtool/cli:\n" + "\n".join(hidden)


def test_rules_never_import_the_cache_layer():
    # The layer imports its rules; they see its entries through read-only views (eviction.EntryView,
    # selection's and merging's tensors, importance's PromptScores), never the layer itself.
    rules = [p for name in ("eviction", "selection", "merge", "importance") for p in (ROOT / "runtime" / name).glob("*.py")]
    against = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
        for path in rules
        for line, target in imported(path)
        if target == "kvtool.runtime.layer" or target.startswith("kvtool.runtime.layer.")
    ]
    assert rules and not against, "rules importing the layer:\n" + "\n".join(against)
