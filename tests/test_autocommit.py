"""The autocommit connections that lease claims use beside the engine's pool (real PostgreSQL)."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService, NotAcquiredReason
from dagster_joblease.storage import create_engine, migrate
from dagster_joblease.storage import engine as engine_module
from dagster_joblease.storage.autocommit import autocommit_connections


@pytest.fixture
def admin(pg_url: str) -> Iterator[sa.Engine]:
    engine = create_engine(pg_url, poolclass=sa.pool.NullPool)
    yield engine
    engine.dispose()


def _sessions(admin: sa.Engine) -> int:
    """Other sessions connected to the test database."""
    with admin.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        )


def test_sequential_claims_reuse_one_connection(pg_url: str, admin: sa.Engine) -> None:
    engine = create_engine(pg_url)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        for i in range(50):
            assert service.acquire(JobIdentity.schedule("reuse", str(i))) is not None
        assert _sessions(admin) == 1
        assert len(autocommit_connections(engine)._idle) == 1
    finally:
        engine.dispose()


def test_dispose_closes_them(pg_url: str, admin: sa.Engine) -> None:
    engine = create_engine(pg_url)
    service = LeaseService(engine, lease_ms=60_000)
    assert service.acquire(JobIdentity.schedule("dispose", "1")) is not None
    with engine.connect() as conn:  # and one in the ordinary pool
        conn.execute(sa.text("SELECT 1"))
    assert _sessions(admin) == 2
    engine.dispose()
    assert _sessions(admin) == 0
    # The engine still works after dispose, as SQLAlchemy's own pool does.
    assert service.acquire(JobIdentity.schedule("dispose", "2")) is not None
    engine.dispose()
    assert _sessions(admin) == 0


def test_a_null_pool_engine_keeps_no_connection(pg_url: str, admin: sa.Engine) -> None:
    engine = create_engine(pg_url, poolclass=sa.pool.NullPool)
    service = LeaseService(engine, lease_ms=60_000)
    assert service.acquire(JobIdentity.schedule("nullpool", "1")) is not None
    assert service.try_acquire(JobIdentity.schedule("nullpool", "1")).reason is NotAcquiredReason.HELD
    assert _sessions(admin) == 0


def test_threads_share_them_with_one_winner_each(pg_url: str, admin: sa.Engine) -> None:
    engine = create_engine(pg_url, pool_size=3)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        jobs = [JobIdentity.schedule("threads", str(i)) for i in range(40)]
        wins: list[str] = []
        failures: list[BaseException] = []
        lock = threading.Lock()

        def claim_all() -> None:
            try:
                for job in jobs:
                    if service.acquire(job) is not None:
                        with lock:
                            wins.append(job.run_key)
            except BaseException as exc:  # pragma: no cover - reported below
                failures.append(exc)

        threads = [threading.Thread(target=claim_all) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        assert sorted(wins) == sorted(job.run_key for job in jobs)
        assert len(autocommit_connections(engine)._idle) <= 3
        assert _sessions(admin) <= 3
    finally:
        engine.dispose()


def _backend_pids(engine: sa.Engine) -> list[int]:
    return [handle.connection.info.backend_pid for handle, _ in autocommit_connections(engine)._idle]


def _claim_in_child(engine: sa.Engine, queue: multiprocessing.Queue[object]) -> None:
    service = LeaseService(engine, lease_ms=60_000)
    lease = service.acquire(JobIdentity.schedule("fork", "child"))
    queue.put(("won" if lease is not None else "lost", _backend_pids(engine)))


def test_a_forked_child_never_uses_its_parents_connection(pg_url: str, admin: sa.Engine) -> None:
    engine = create_engine(pg_url)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        assert service.acquire(JobIdentity.schedule("fork", "parent-1")) is not None
        ctx = multiprocessing.get_context("fork")
        parent_pids = _backend_pids(engine)
        assert len(parent_pids) == 1
        queue: multiprocessing.Queue[object] = ctx.Queue()
        child = ctx.Process(target=_claim_in_child, args=(engine, queue))
        child.start()
        result = queue.get(timeout=30)
        assert isinstance(result, tuple)
        outcome, child_pids = result
        assert outcome == "won"
        assert len(child_pids) == 1 and child_pids != parent_pids  # its own session
        child.join(30)
        assert child.exitcode == 0
        # The child exited (and garbage-collected its copy of the parent's connection) without closing
        # the parent's session: the parent's next claim runs on the same connection, without an error.
        assert service.acquire(JobIdentity.schedule("fork", "parent-2")) is not None
        assert _backend_pids(engine) == parent_pids
        assert _sessions(admin) == 1
    finally:
        engine.dispose()


def test_a_connection_left_inside_a_transaction_is_closed_not_reused(pg_url: str) -> None:
    engine = create_engine(pg_url)
    try:
        connections = autocommit_connections(engine)
        handle = connections.acquire(engine)
        handle.cursor.execute("BEGIN")
        connections.release(handle)
        assert handle.connection.closed
        assert connections._idle == []
        fresh = connections.acquire(engine)
        assert fresh.connection is not handle.connection
        connections.release(fresh)
    finally:
        engine.dispose()


def test_a_killed_session_fails_one_claim_loudly_then_claims_recover(
    pg_url: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "IDLE_PING_AFTER_S", 3600.0)  # reused at once: no ping
    engine = create_engine(pg_url)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        assert service.acquire(JobIdentity.schedule("killed", "1")) is not None
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
        with pytest.raises(errors.StorageError, match="acquire a lease"):
            service.acquire(JobIdentity.schedule("killed", "2"))
        assert service.acquire(JobIdentity.schedule("killed", "2")) is not None
    finally:
        engine.dispose()


def _prepared_on_claim_connection(engine: sa.Engine) -> int:
    connections = autocommit_connections(engine)
    handle = connections.acquire(engine)
    try:
        handle.cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        row = handle.cursor.fetchone()
        assert row is not None
        return int(row[0])
    finally:
        connections.release(handle)


@pytest.mark.parametrize("threshold", ["", "&prepare_threshold=none"])
def test_claim_connections_honour_the_url_schema_and_prepare_threshold(
    pg_url: str, admin: sa.Engine, threshold: str
) -> None:
    """The operations guide's URLs: a search path via ``options``, and PgBouncer's prepare_threshold=none."""
    with admin.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA own"))
    url = f"{pg_url}?options=-csearch_path%3Down{threshold}"
    engine = create_engine(url)
    try:
        migrate(engine)
        service = LeaseService(engine, lease_ms=60_000)
        for i in range(8):
            assert service.acquire(JobIdentity.schedule("schema", str(i))) is not None
            assert (
                service.try_acquire(JobIdentity.schedule("schema", str(i))).reason is NotAcquiredReason.HELD
            )
        with admin.connect() as conn:
            in_own = conn.execute(sa.text("SELECT count(*) FROM own.joblease_lease")).scalar_one()
            in_public = conn.execute(sa.text("SELECT count(*) FROM public.joblease_lease")).scalar_one()
        assert (in_own, in_public) == (8, 0)
        prepared = _prepared_on_claim_connection(engine)
        assert prepared == 0 if threshold else prepared >= 2
    finally:
        engine.dispose()


def test_a_session_that_forgot_its_prepared_statements_prepares_them_again(pg_url: str) -> None:
    """As behind a pooler that moved the session, or after ``DEALLOCATE ALL``: the claim that meets it
    drops psycopg's memory of its prepared statements and runs once more, on the same connection (the
    failed statement was its own transaction and wrote nothing), so no claim fails. Only a second loss in
    a row (a pooler in transaction mode, each statement on another server session) fails, naming the URL
    setting that prevents it (tests/test_pgbouncer_symptoms.py)."""
    engine = create_engine(pg_url)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        assert service.acquire(JobIdentity.schedule("forgot", "1")) is not None
        connections = autocommit_connections(engine)
        (handle, _), *_ = connections._idle
        handle.connection.pgconn.exec_(b"DEALLOCATE ALL")  # behind psycopg's back, as the server would
        for i in range(2, 5):
            assert service.acquire(JobIdentity.schedule("forgot", str(i))) is not None
        assert not handle.connection.closed
        assert [h for h, _ in connections._idle] == [handle]
    finally:
        engine.dispose()


def test_pool_size_zero_means_no_limit_as_in_sqlalchemy(pg_url: str, admin: sa.Engine) -> None:
    engine = create_engine(pg_url, pool_size=0)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        for i in range(5):
            assert service.acquire(JobIdentity.schedule("unbounded", str(i))) is not None
        assert len(autocommit_connections(engine)._idle) == 1  # reused, not reopened per claim
        assert _sessions(admin) == 1
    finally:
        engine.dispose()
