"""Shared fixtures: real PostgreSQL databases (one per test, cloned from a migrated template) and real
SQLite files. No mocked database anywhere.

Point the tests at another PostgreSQL with ``JOBLEASE_TEST_PG_URL`` (a URL of a role that may create
databases; the path names the maintenance database), e.g.
``JOBLEASE_TEST_PG_URL=postgresql+psycopg://me:secret@db.local:5432/postgres pytest``.

The tests marked ``pgbouncer`` run through a PgBouncer in transaction pooling mode in front of that server,
named by ``JOBLEASE_TEST_PGBOUNCER_URL`` (``.ci/run`` starts one and sets it; ``.ci/pgbouncer start DIR``
starts one for a developer and writes its URL to ``DIR/url``). Without it they skip, saying so; with
``CI=true`` they fail instead, so CI can never skip them silently.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine, migrate

#: The context of the ``processes`` fixture: a fresh interpreter per worker, as a real deployment's.
SPAWN = multiprocessing.get_context("spawn")

PG_URL_ENV = "JOBLEASE_TEST_PG_URL"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
#: A PgBouncer (transaction pooling) in front of the PostgreSQL of PG_URL_ENV; its path is ignored.
PGBOUNCER_URL_ENV = "JOBLEASE_TEST_PGBOUNCER_URL"
#: What docs/operations.md section 2 tells a PgBouncer user to add to the URL.
PGBOUNCER_QUERY = {"prepare_threshold": "none"}
BACKENDS = ["sqlite", "postgresql"]


def admin_url() -> URL:
    return make_url(os.environ.get(PG_URL_ENV, DEFAULT_PG_URL)).set(drivername="postgresql+psycopg")


def _admin_execute(sql: str) -> None:
    engine = sa.create_engine(admin_url(), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database migrated once per session; each test clones it (fast, and isolated by database)."""
    name = f"joblease_tpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    _admin_execute(f'CREATE DATABASE "{name}"')
    engine = create_engine(admin_url().set(database=name), poolclass=sa.pool.NullPool)
    migrate(engine)
    engine.dispose()
    yield name
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def clone_template(template: str, name: str) -> str:
    """Create database ``name`` from the migrated template; returns its URL."""
    for attempt in range(50):
        try:
            _admin_execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
            break
        except sa.exc.OperationalError:
            # "source database is being accessed by other users": a clone in flight; try again shortly.
            if attempt == 49:
                raise
            time.sleep(0.1)
    return admin_url().set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """The URL of a fresh, migrated PostgreSQL database for this test (dropped afterwards)."""
    name = f"joblease_t_{uuid.uuid4().hex[:10]}"
    yield clone_template(pg_template, name)
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pgbouncer_base_url() -> URL:
    """The PgBouncer URL from ``$JOBLEASE_TEST_PGBOUNCER_URL``; skip without it (fail when ``CI=true``)."""
    raw = os.environ.get(PGBOUNCER_URL_ENV, "").strip()
    if not raw:
        reason = (
            f"${PGBOUNCER_URL_ENV} is not set: no PgBouncer to test through (start one with "
            f"`.ci/pgbouncer start DIR` and export {PGBOUNCER_URL_ENV}=$(cat DIR/url))"
        )
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"{reason}; CI=true requires the PgBouncer tests", pytrace=False)
        pytest.skip(reason)
    return make_url(raw).set(drivername="postgresql+psycopg")


@dataclasses.dataclass(frozen=True)
class BouncedDatabase:
    """A fresh migrated database, reachable directly and through PgBouncer (transaction pooling)."""

    name: str
    #: Straight to PostgreSQL (for set-up and for checking what was committed).
    direct_url: str
    #: Through PgBouncer, with the URL setting the docs prescribe (``?prepare_threshold=none``).
    url: str
    #: Through PgBouncer without it: what a user who skipped the docs writes.
    bare_url: str


@pytest.fixture
def bounced(request: pytest.FixtureRequest) -> Iterator[BouncedDatabase]:
    """A database created on PostgreSQL, then used through PgBouncer (dropped afterwards)."""
    bouncer = pgbouncer_base_url()  # skip (or fail) before making any database
    template = str(request.getfixturevalue("pg_template"))
    name = f"joblease_b_{uuid.uuid4().hex[:10]}"
    direct = clone_template(template, name)
    via = bouncer.set(database=name)
    yield BouncedDatabase(
        name=name,
        direct_url=direct,
        url=via.update_query_dict(PGBOUNCER_QUERY).render_as_string(hide_password=False),
        bare_url=via.render_as_string(hide_password=False),
    )
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """The URL of a fresh, migrated SQLite file for this test."""
    url = f"sqlite:///{tmp_path / 'joblease.sqlite'}"
    engine = create_engine(url)
    migrate(engine)
    engine.dispose()
    return url


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest) -> str:
    """A migrated database URL, once per backend: the contract suite runs against both."""
    fixture = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(pg_url)
    yield eng
    eng.dispose()


@pytest.fixture
def other_engine(db_url: str) -> Iterator[sa.Engine]:
    """A second engine on the same database: another worker, with its own connections."""
    eng = create_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def service(engine: sa.Engine) -> LeaseService:
    return LeaseService(engine, lease_ms=60_000)


@pytest.fixture
def rival(other_engine: sa.Engine) -> LeaseService:
    """The lease service of another worker on the same database."""
    return LeaseService(other_engine, lease_ms=60_000)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds. Never sleep to synchronize."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


@pytest.fixture
def processes() -> Iterator[Callable[..., BaseProcess]]:
    """Start spawned worker processes; any still alive at teardown are killed (by their own pid)."""
    started: list[BaseProcess] = []

    def start(target: Callable[..., None], *args: Any) -> BaseProcess:
        process = SPAWN.Process(target=target, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)
        process.join(10)


@pytest.fixture
def url_at_0005() -> Iterator[str]:
    """A new PostgreSQL database migrated to 0005 (the revision before 0006 retypes columns)."""
    name = f"joblease_up_{uuid.uuid4().hex[:10]}"
    _admin_execute(f'CREATE DATABASE "{name}"')
    url = admin_url().set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        migrate(engine, "0005")
    finally:
        engine.dispose()
    yield url
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
