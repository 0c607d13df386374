"""The core never imports Dagster: a plain Python program can use it without Dagster being imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dagster_joblease

PACKAGE_DIR = Path(dagster_joblease.__file__).resolve().parent
NOT_CORE = ("dagster_joblease.dagster", "dagster_joblease.demo", "dagster_joblease.cli")


def core_modules() -> list[str]:
    """Every importable module of the package except the Dagster layer, the demo and the CLI."""
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if parts[-1] == "__main__" or "migrations" in parts:
            continue  # __main__ runs a program; Alembic loads migration scripts itself
        if any(name == prefix or name.startswith(prefix + ".") for prefix in NOT_CORE):
            continue
        names.append(name)
    return names


def test_core_module_list_covers_the_core() -> None:
    names = core_modules()
    for expected in (
        "dagster_joblease",
        "dagster_joblease.errors",
        "dagster_joblease.identity",
        "dagster_joblease.options",
        "dagster_joblease.lease",
        "dagster_joblease.storage",
        "dagster_joblease.storage.clock",
        "dagster_joblease.storage.engine",
        "dagster_joblease.storage.migrate",
        "dagster_joblease.storage.schema",
    ):
        assert expected in names
    assert not any(name.startswith("dagster_joblease.dagster") for name in names)


def test_core_does_not_import_dagster() -> None:
    names = core_modules()
    program = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "leaked = sorted(m for m in sys.modules if m == 'dagster' or m.startswith('dagster.'))\n"
        "print(json.dumps({'dagster_imported': 'dagster' in sys.modules, 'leaked': leaked}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=PACKAGE_DIR.parent
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["leaked"] == [], f"core modules pulled in Dagster: {report['leaked'][:10]}"
    assert report["dagster_imported"] is False


def test_the_dagster_layer_is_where_dagster_lives() -> None:
    """The check above can fail: importing the Dagster layer does bring Dagster in."""
    program = "import sys, dagster_joblease.dagster\nprint('dagster' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_the_core_and_the_inbox_middleware_do_not_import_the_receivers_server() -> None:
    """Starlette, uvicorn and psycopg-pool are the `receiver` extra: the package root, the inbox (its ASGI
    middleware is pure ASGI) and the testing kit's import load none of them."""
    program = (
        "import json, sys\n"
        "import dagster_joblease, dagster_joblease.inbox, dagster_joblease.testing, dagster_joblease.wire\n"
        "print(json.dumps(sorted(m for m in ('starlette', 'uvicorn', 'psycopg_pool', 'fastapi')"
        " if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_dagster_layer_holds_no_statement_on_the_joblease_tables() -> None:
    """Each table's statements live in its store module (storage/*.py): no module of the Dagster layer
    (the demo included) names a joblease table; it calls the store's functions instead."""
    tables = ("lease_table", "outbox_table", "inbox_table", "route_group_table")
    offenders = {
        str(path.relative_to(PACKAGE_DIR)): [t for t in tables if t in path.read_text(encoding="utf-8")]
        for path in sorted((PACKAGE_DIR / "dagster").rglob("*.py"))
    }
    assert {path: found for path, found in offenders.items() if found} == {}
