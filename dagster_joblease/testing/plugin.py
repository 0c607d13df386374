"""The pytest plugin of dagster-joblease, enabled by installing the package (entry point ``pytest11``).

pytest loads this module in every run of every project where the package is installed, so it never
imports Dagster and touches no database at import: the fixtures import the kit (and create a database)
only when a test asks for them. Disable it with ``pytest -p no:joblease``.

Fixtures:

- ``joblease_database_url``: the URL of a migrated joblease database whose tables are empty at the start
  of every test: an SQLite file, or a PostgreSQL database when ``$JOBLEASE_TEST_PG_URL`` is set (a URL of
  a role that may create databases). One database per test session, dropped afterwards.
- ``joblease_engine``: an engine on it. ``joblease_service``: a ``LeaseService`` on that engine.
- ``joblease_downstream``: a running ``RecordingDownstream`` (the reference receiver, in-process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import sqlalchemy as sa

    from dagster_joblease.lease import LeaseService
    from dagster_joblease.testing import RecordingDownstream


@pytest.fixture(scope="session")
def _joblease_session_database_url() -> Iterator[str]:
    from dagster_joblease.testing.database import throwaway_database

    with throwaway_database() as url:
        yield url


@pytest.fixture
def joblease_database_url(_joblease_session_database_url: str) -> str:
    """A migrated joblease database for this test, its tables emptied first (the URL may hold a password)."""
    from dagster_joblease.storage.engine import create_engine
    from dagster_joblease.testing.database import clear_joblease_tables

    engine = create_engine(_joblease_session_database_url)
    try:
        clear_joblease_tables(engine)
    finally:
        engine.dispose()
    return _joblease_session_database_url


@pytest.fixture
def joblease_engine(joblease_database_url: str) -> Iterator[sa.Engine]:
    """An engine on ``joblease_database_url``, disposed of after the test."""
    from dagster_joblease.storage.engine import create_engine

    engine = create_engine(joblease_database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def joblease_service(joblease_engine: sa.Engine) -> LeaseService:
    """A ``LeaseService`` with default timing on ``joblease_engine``."""
    from dagster_joblease.lease import LeaseService

    return LeaseService(joblease_engine)


@pytest.fixture
def joblease_downstream() -> Iterator[RecordingDownstream]:
    """A running ``RecordingDownstream`` with a fresh inbox; stopped after the test."""
    from dagster_joblease.testing.downstream import RecordingDownstream

    with RecordingDownstream() as downstream:
        yield downstream
