"""No two modules of the library import each other, counting every import statement: module level,
inside functions (deferred) and under ``TYPE_CHECKING``. A package's ``__init__`` re-exporting its
modules is not a module of its own here."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import dagster_joblease

ROOT = Path(dagster_joblease.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        found[".".join(path.relative_to(ROOT.parent).with_suffix("").parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in out if m in known and m != name}


def test_no_two_modules_import_each_other() -> None:
    known = _modules()
    assert "dagster_joblease.lease" in known and "dagster_joblease.batch" in known
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert "dagster_joblease.lease" in graph["dagster_joblease.batch"]  # the one direction
    mutual = [(a, b) for a, b in itertools.combinations(sorted(graph), 2) if b in graph[a] and a in graph[b]]
    assert mutual == []
