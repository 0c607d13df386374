"""Behind PgBouncer in transaction mode *without* ``?prepare_threshold=none``: the library's prepared
statements land on server connections other clients share. Whatever path hits it, the caller gets a
:class:`ConfigurationError` naming the setting, never a bare ``prepared statement ... already exists``.

Two workers (engines, or psycopg connections) take turns, so each one's statements meet the other's on
PgBouncer's server connections (it reuses the most recently used one first): the symptom shows within
the first rounds; a hundred make it certain. A PgBouncer that tracks protocol-level prepared statements
(1.21 or later with ``max_prepared_statements`` > 0) makes the same loops succeed instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anyio
import psycopg
import pytest
import sqlalchemy as sa
from psycopg_pool import AsyncConnectionPool
from sqlalchemy.engine import make_url

from dagster_joblease import errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.inbox import AsyncInbox, Inbox
from dagster_joblease.lease import LeaseService
from dagster_joblease.outbox import enqueue_once
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.engine import translate_errors
from tests.conftest import BouncedDatabase, pgbouncer_base_url

pytestmark = [pytest.mark.pgbouncer, pytest.mark.postgres_only]

ROUNDS = 100


def _tracks_prepared_statements() -> bool:
    """True for a PgBouncer that keeps protocol-level prepared statements per client (1.21+)."""
    admin = pgbouncer_base_url().set(database="pgbouncer", query={})
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute("SHOW CONFIG").fetchall()
    settings = {str(row[0]): str(row[1]) for row in rows}
    return int(settings.get("max_prepared_statements", "0") or 0) > 0


def _failures(step: Callable[[int], None]) -> list[errors.ConfigurationError]:
    """Run ``step`` ROUNDS times; the ConfigurationErrors it raised. Any other error fails the test."""
    failures: list[errors.ConfigurationError] = []
    for i in range(ROUNDS):
        try:
            step(i)
        except errors.ConfigurationError as exc:
            failures.append(exc)
    return failures


def _check(failures: list[errors.ConfigurationError]) -> None:
    if _tracks_prepared_statements():
        assert failures == [], "PgBouncer tracks prepared statements here: nothing should fail"
        return
    assert failures, f"no round of {ROUNDS} met another client's prepared statement: the test proves nothing"
    for failure in failures:
        text = str(failure)
        assert "prepare_threshold=none" in text and "transaction mode" in text, text
        assert isinstance(failure.__cause__, sa.exc.DBAPIError | psycopg.Error)


@pytest.fixture
def bare_engines(bounced: BouncedDatabase) -> Iterator[tuple[sa.Engine, sa.Engine]]:
    first, second = create_engine(bounced.bare_url), create_engine(bounced.bare_url)
    yield first, second
    first.dispose()
    second.dispose()


def test_lease_claims_without_the_setting_fail_as_configuration_errors(
    bare_engines: tuple[sa.Engine, sa.Engine],
) -> None:
    services = [LeaseService(engine, lease_ms=60_000) for engine in bare_engines]

    def claim_renew_complete(i: int) -> None:
        service = services[i % 2]
        lease = service.acquire(JobIdentity.schedule("pgbouncer-bare", f"round-{i:03d}"))
        assert lease is not None
        service.heartbeat(lease)
        service.complete(lease)

    _check(_failures(claim_renew_complete))


def test_inbox_without_the_setting_fails_as_configuration_errors(
    bare_engines: tuple[sa.Engine, sa.Engine],
) -> None:
    inboxes = [Inbox(engine) for engine in bare_engines]

    def process(i: int) -> None:
        inboxes[i % 2].process(f"key-{i:03d}", {"i": i}, lambda _conn: (200, "{}"))

    _check(_failures(process))


def test_enqueue_on_psycopg_connections_without_the_setting_fails_as_configuration_errors(
    bounced: BouncedDatabase,
) -> None:
    conninfo = make_url(bounced.bare_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo) as first, psycopg.connect(conninfo) as second:
        connections = [first, second]

        def enqueue(i: int) -> None:
            conn = connections[i % 2]
            try:
                with conn.transaction():
                    enqueue_once(conn, idempotency_key=f"v1:raw-{i:03d}", topic="t", payload={"i": i})
            finally:
                if conn.closed or conn.broken:
                    connections[i % 2] = psycopg.connect(conninfo)

        _check(_failures(enqueue))


def test_async_inbox_without_the_setting_fails_only_in_its_effects_statements(
    bounced: BouncedDatabase,
) -> None:
    """The AsyncInbox on psycopg pools (what the reference receiver runs) binds its own statements
    client-side and never prepares them, so with an empty effect no round fails without the setting. An
    effect's statement on the inbox's connection keeps psycopg's threshold (prepared after its fifth use),
    so those rounds soon meet another pool's statements on a shared server session: a ConfigurationError
    when the effect runs under ``translate_errors``, as the reference receiver's does."""
    conninfo = make_url(bounced.bare_url).set(drivername="postgresql").render_as_string(hide_password=False)

    async def rounds(writes: bool) -> list[errors.ConfigurationError]:
        failures: list[errors.ConfigurationError] = []
        pools = [AsyncConnectionPool(conninfo, min_size=1, max_size=1, open=False) for _ in range(2)]
        for pool in pools:
            await pool.open()
        try:
            inboxes = [AsyncInbox(pool.connection) for pool in pools]

            async def effect(conn: Any) -> tuple[int, str]:
                if writes:
                    with translate_errors("run a test effect"):
                        await conn.execute("SELECT %s::int", (1,))
                return 200, "{}"

            for i in range(ROUNDS):
                try:
                    await inboxes[i % 2].process(f"key-{writes}-{i:03d}", {"i": i}, effect)
                except errors.ConfigurationError as exc:
                    failures.append(exc)
        finally:
            for pool in pools:
                await pool.close()
        return failures

    assert anyio.run(rounds, False) == []
    _check(anyio.run(rounds, True))


def test_translate_errors_maps_only_prepared_statement_errors(pg_url: str) -> None:
    """On a direct connection too: the mapping is by SQLSTATE, and leaves other errors StorageErrors."""
    conninfo = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("PREPARE twice AS SELECT 1")
        for sql in ("PREPARE twice AS SELECT 1", "EXECUTE never_prepared"):
            with pytest.raises(errors.ConfigurationError, match="prepare_threshold=none"):
                with translate_errors("run a test statement"):
                    conn.execute(sql)
        with pytest.raises(errors.StorageError, match="division by zero"):
            with translate_errors("run a test statement"):
                conn.execute("SELECT 1/0")


@pytest.mark.parametrize("threshold", [5, None])
def test_prepare_true_prepares_at_once_unless_prepare_threshold_is_none(
    pg_url: str, threshold: int | None
) -> None:
    """What docs/operations.md section 2 says: the library's ``prepare=True`` prepares on the first
    execution (not after psycopg's 5), and ``prepare_threshold=None`` overrides it."""
    conninfo = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True, prepare_threshold=threshold) as conn:
        conn.execute("SELECT %s::int", (1,), prepare=True)
        prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements", prepare=False).fetchone()
    assert prepared == (1 if threshold is not None else 0,)
