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


def _hook(name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("html", "raw"),
    [
        ("<p>See :class:<code>StorageError</code>.</p>", True),
        ("<p>See :func:`enqueue_once`.</p>", True),
        ("<p>a :meth:<code>x</code>, :attr:<code>y</code>, :mod:<code>z</code></p>", True),
        ("<p>Example::</p>", True),
        ("<p>A routes file maps topics to routes::   </p>", True),
        ('<p>See <a href="#x"><code>StorageError</code></a>.</p>', False),
        ("<p>Example:</p><pre><code>x = 1</code></pre>", False),
        ("<p>postgresql+psycopg://host and the ratio 2:1</p>", False),
        ('<code>a::b</code> <span class="p">::</span>', False),
    ],
)
def test_the_docs_build_refuses_raw_sphinx_markup(html: str, raw: bool) -> None:
    """docs/hooks/raw_markup.py fails the build on a page showing a role or a literal block's '::'."""
    assert bool(_hook("raw_markup").raw_markup(html)) is raw


def test_sphinx_roles_and_literal_blocks_are_rendered_at_build_time() -> None:
    """The griffe extension and the check are both wired into mkdocs.yml, and the extension turns a role
    into an optional autorefs link and a reST literal block into a fenced one."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert "- docs/hooks/sphinx_roles.py:SphinxRoles" in config
    assert "- docs/hooks/raw_markup.py" in config
    import griffe

    roles = _hook("sphinx_roles")
    text = (
        "Example::\n\n    x = run(1)\n\n"
        "Build it first::\n\n    CREATE INDEX CONCURRENTLY x\n      ON t (a);\n"
    )
    assert roles.render_literal_blocks(text) == (
        "Example:\n\n```python\nx = run(1)\n```\n\n"
        "Build it first:\n\n```text\nCREATE INDEX CONCURRENTLY x\n  ON t (a);\n```\n"
    )
    package = griffe.load("dagster_joblease", search_paths=[str(ROOT)], resolve_aliases=False)
    owner = package["dagster.resource.JobLeaseResource"]
    rendered = roles.render_roles(
        "See :class:`LeaseService`, :func:`~dagster_joblease.outbox.enqueue_once` and :meth:`close`.", owner
    )
    assert rendered == (
        'See <autoref identifier="dagster_joblease.lease.LeaseService" optional><code>LeaseService</code>'
        '</autoref>, <autoref identifier="dagster_joblease.outbox.enqueue_once" optional><code>'
        'enqueue_once()</code></autoref> and <autoref identifier="dagster_joblease.dagster.resource.'
        'JobLeaseResource.close" optional><code>close()</code></autoref>.'
    )


def test_every_config_field_and_component_attribute_is_in_the_api_reference() -> None:
    """docs/hooks/config_reference.py lists JobLeaseResource's fields and every Component's attributes
    from their models (the build fails on one without a description); both pages carry its marker."""
    import dataclasses

    from dagster.components import Component

    from dagster_joblease.dagster import components
    from dagster_joblease.dagster.resource import JobLeaseResource

    hook = _hook("config_reference")
    table = hook.config_table("dagster_joblease.dagster.resource.JobLeaseResource")
    for name in JobLeaseResource.model_fields:
        assert f"| `{name}` |" in table
    for name in components.__all__:
        cls = getattr(components, name)
        if isinstance(cls, type) and issubclass(cls, Component):
            listed = {row[0] for row in hook.component_rows(cls)}
            assert set(cls.model().model_fields) <= listed, name  # type: ignore[attr-defined]
            assert {f.name for f in dataclasses.fields(cls)} <= listed  # type: ignore[arg-type]
    assert (
        "joblease-config: dagster_joblease.dagster.resource.JobLeaseResource"
        in (ROOT / "docs" / "reference" / "dagster.md").read_text()
    )
    assert (
        "joblease-components: dagster_joblease.dagster.components"
        in (ROOT / "docs" / "reference" / "components.md").read_text()
    )
    assert "- docs/hooks/config_reference.py" in (ROOT / "mkdocs.yml").read_text()
