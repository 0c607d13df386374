"""Connection lifetime is provable: the server's own count of sessions on the test database
(``pg_stat_activity``) before, during and after ``dispose()``, across threads, forked and spawned
processes; and an engine dropped without ``dispose()`` is garbage-collected with its sessions closed."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine
from tests.conftest import wait_until

DEADLINE_S = 60.0


@pytest.fixture
def admin(pg_url: str) -> Iterator[sa.Engine]:
    """Counts from the maintenance database, so the counter is never one of the sessions counted."""
    engine = sa.create_engine(sa.make_url(pg_url).set(database="postgres"), poolclass=sa.pool.NullPool)
    yield engine
    engine.dispose()


def _sessions(admin: sa.Engine, database: str) -> int:
    with admin.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"), {"d": database}
            ).scalar_one()
        )


def _use(engine: sa.Engine, key: str) -> None:
    """A claim (claim connection), a heartbeat and a fenced transaction (pooled connections)."""
    service = LeaseService(engine, lease_ms=60_000)
    lease = service.acquire(JobIdentity.schedule("lifetime", key))
    assert lease is not None
    service.heartbeat(lease)
    with service.fenced_transaction(lease) as conn:
        conn.execute(sa.text("SELECT 1"))
    service.complete(lease)


def _spawned(url: str, key: str) -> None:
    engine = create_engine(url)
    try:
        _use(engine, key)
    finally:
        engine.dispose()


def _forked(engine: sa.Engine, key: str) -> None:
    _use(engine, key)  # on the inherited engine, without dispose: the child's exit closes its sessions


def _run(ctx: Any, target: Any, *args: Any) -> None:
    process = ctx.Process(target=target, args=args)
    process.start()
    process.join(DEADLINE_S)
    if process.is_alive():
        process.kill()
        process.join(10)
    assert process.exitcode == 0, f"{target.__name__} exited with {process.exitcode}"


def test_sessions_before_during_and_after_dispose(pg_url: str, admin: sa.Engine) -> None:
    database = sa.make_url(pg_url).database
    assert database is not None
    assert _sessions(admin, database) == 0
    engine = create_engine(pg_url, pool_size=3, max_overflow=0)
    try:
        threads = [threading.Thread(target=_use, args=(engine, f"thread-{i}")) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE_S)
        during = _sessions(admin, database)
        # At most the pool's 3 and 3 idle claim connections (pool_size bounds both), at least one.
        assert 1 <= during <= 6, during
        _run(multiprocessing.get_context("fork"), _forked, engine, "forked")
        _run(multiprocessing.get_context("spawn"), _spawned, pg_url, "spawned")
        # The children's sessions ended with them; the parent's are still there, still usable.
        wait_until(lambda: _sessions(admin, database) <= during, timeout=DEADLINE_S)
        _use(engine, "parent-after-children")
        assert 1 <= _sessions(admin, database) <= 6
    finally:
        engine.dispose()
    wait_until(lambda: _sessions(admin, database) == 0, timeout=DEADLINE_S)
    # A disposed engine holds nothing that stops it from being freed.
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


def test_engines_dropped_without_dispose_are_freed_with_their_sessions(pg_url: str, admin: sa.Engine) -> None:
    database = sa.make_url(pg_url).database
    assert database is not None
    refs = []
    for i in range(5):
        engine = create_engine(pg_url)
        _use(engine, f"dropped-{i}")
        refs.append(weakref.ref(engine))
        del engine
    assert _sessions(admin, database) >= 1
    gc.collect()
    assert [r() is None for r in refs] == [True] * 5
    wait_until(lambda: _sessions(admin, database) == 0, timeout=DEADLINE_S)
