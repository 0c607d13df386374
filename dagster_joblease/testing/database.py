"""Throwaway joblease databases for tests: an SQLite file, or a PostgreSQL database created and dropped.

The pytest plugin builds its ``joblease_engine`` fixture on these; they work without pytest too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from dagster_joblease import errors
from dagster_joblease.storage import inbox, leases, outbox, route_groups
from dagster_joblease.storage.engine import create_engine, translate_errors
from dagster_joblease.storage.migrate import migrate

__all__ = ["TEST_PG_URL_ENV", "clear_joblease_tables", "throwaway_database"]

#: A PostgreSQL URL of a role that may create databases; its path names the maintenance database.
TEST_PG_URL_ENV = "JOBLEASE_TEST_PG_URL"


def _admin_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except Exception:
        raise errors.ConfigurationError(
            f"${TEST_PG_URL_ENV} could not be parsed; expected e.g. "
            "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ) from None
    if parsed.get_backend_name() != "postgresql":
        raise errors.ConfigurationError(
            f"${TEST_PG_URL_ENV} must be a PostgreSQL URL (a role that may create databases), got backend "
            f"{parsed.get_backend_name()!r}; unset it to test on a throwaway SQLite file"
        )
    return parsed.set(drivername="postgresql+psycopg")


def _admin_execute(admin: URL, sql: str) -> None:
    engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with translate_errors("create or drop a test database"), engine.connect() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()


@contextlib.contextmanager
def throwaway_database(pg_url: str | None = None) -> Iterator[str]:
    """Yield the URL of a fresh, migrated joblease database; delete it afterwards.

    With ``pg_url`` (default: ``$JOBLEASE_TEST_PG_URL``) a new PostgreSQL database is created through
    that URL's server and dropped at the end; without it, an SQLite file in a temporary directory. The
    yielded URL may hold a password: do not log it.

    Example::

        with throwaway_database() as url:
            engine = create_engine(url)
            ...
    """
    pg_url = pg_url if pg_url is not None else os.environ.get(TEST_PG_URL_ENV) or None
    if pg_url is None:
        folder = Path(tempfile.mkdtemp(prefix="joblease-test-"))
        url = f"sqlite:///{folder / 'joblease.sqlite'}"
        try:
            _migrate(url)
            yield url
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    admin = _admin_url(pg_url)
    name = f"joblease_kit_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    _admin_execute(admin, f'CREATE DATABASE "{name}"')
    try:
        url = admin.set(database=name).render_as_string(hide_password=False)
        _migrate(url)
        yield url
    finally:
        _admin_execute(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _migrate(url: str) -> None:
    engine = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        migrate(engine)
    finally:
        engine.dispose()


def clear_joblease_tables(engine: sa.Engine) -> None:
    """Delete every row of the joblease tables (leases, outbox, inbox); the schema stays migrated."""
    with translate_errors("clear the joblease tables"), engine.begin() as conn:
        for store in (inbox, route_groups, outbox, leases):  # one per table of storage.schema.metadata
            store.delete_all(conn)
