"""The documentation runs as written: every Python block of README.md and of every page under docs/ is
executed, page by page (``.ci/run`` also builds the site with ``mkdocs build --strict``).

A page's blocks run in order in one namespace (a page tells one story: a later block uses what an earlier
one defined), in a fresh working directory, with the placeholders a reader replaces swapped for what runs
here: PostgreSQL URLs for an SQLite file, ``https://….internal/…`` routes for a local reference receiver
(the testing kit's ``RecordingDownstream``). Names a page leaves to the reader's own code (your table, your
charge function) are given in ``PLACEHOLDERS`` below, per page, and nowhere else. Every ``dg.Definitions``
a page builds must load (``Definitions.validate_loadable``), as ``dg check defs`` would.

A block that cannot run here is preceded by ``<!-- docs-test: skip (why) -->`` in the page; the reason is
required, and the list of skipped blocks is printed by ``test_skipped_blocks_say_why``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dagster_joblease.testing import RecordingDownstream

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK = re.compile(r"(<!-- docs-test: (?P<directive>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
SKIP = re.compile(r"skip \((?P<why>[^)]+)\)$")
PG_URL = re.compile(r"postgresql(\+psycopg)?://[^\s\"')]+")
INTERNAL_URL = re.compile(r"https://[a-z0-9.-]+\.internal(?P<path>/[^\s\"')]*)?")

#: What a page leaves to the reader's own code, defined before its first block.
PLACEHOLDERS: dict[str, str] = {
    "docs/python.md": """
def charge_customers(*, for_date, idempotency_key):
    return {"charged": for_date, "key": idempotency_key}
""",
}


def _blocks(page: Path) -> list[tuple[str | None, str]]:
    return [(m["directive"], m["code"]) for m in BLOCK.finditer(page.read_text())]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _runnable(page: Path) -> list[str]:
    out = []
    for directive, code in _blocks(page):
        if directive is None:
            out.append(code)
        elif not SKIP.match(directive):
            raise AssertionError(f"{_name(page)}: unknown directive {directive!r}; use 'skip (why)'")
    return out


@pytest.fixture
def docs_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.delenv("JOBLEASE_DATABASE_URL", raising=False)
    yield tmp_path


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_name)
def test_every_python_block_runs(page: Path, docs_env: Path) -> None:
    import dagster as dg
    import sqlalchemy as sa

    database = f"sqlite:///{docs_env / 'app.sqlite'}"
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
    engines: list[sa.Engine] = []
    with RecordingDownstream() as downstream:
        prelude = PLACEHOLDERS.get(_name(page))
        if prelude:
            exec(compile(prelude, f"{_name(page)} (placeholders)", "exec"), namespace)
        for number, code in enumerate(_runnable(page), 1):
            code = PG_URL.sub(database, code)
            code = INTERNAL_URL.sub(lambda m: downstream.url(m["path"] or "/"), code)
            exec(compile(code, f"{_name(page)} python block {number}", "exec"), namespace)
        for value in list(namespace.values()):
            if isinstance(value, dg.Definitions):
                dg.Definitions.validate_loadable(value)
            if isinstance(value, sa.Engine):
                engines.append(value)
    for engine in engines:
        engine.dispose()


def test_skipped_blocks_say_why() -> None:
    skipped = []
    for page in PAGES:
        for directive, _ in _blocks(page):
            if directive is not None:
                match = SKIP.match(directive)
                assert match, f"{_name(page)}: {directive!r} is not 'skip (why)'"
                skipped.append(f"{_name(page)}: {match['why']}")
    print("\n".join(skipped) or "no block skipped")


def test_readme_is_a_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert [c.strip() for c in commands] == [
        "python3 -m venv .venv && .venv/bin/pip install -q -e '.[ui]' && .venv/bin/joblease demo",
        "python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/pytest" in ci
    assert "It is not exactly-once, and nothing can be." in readme


def test_links_between_readme_and_docs_resolve() -> None:
    """README is not part of the site (mkdocs checks the pages' own links); its links are checked here."""
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme):
        assert (ROOT / target).is_file(), target
