"""Dispatchers as real processes: several in parallel, SIGKILL after the effect, SIGTERM mid-batch, the
database connection terminated and PostgreSQL restarted (a private cluster of the test's own: see
tests/pg_restart.py). The reference receiver runs in its own process.

Each test prints a ``REPORT`` line (rows enqueued, POSTs received, effects applied, rows lost).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from benchmarks.private_pg import private_cluster
from dagster_joblease.receiver import effect_count, effects, request_count
from dagster_joblease.storage import create_engine, migrate
from dagster_joblease.storage.schema import outbox_table
from tests import dispatch_workers
from tests.conftest import admin_url, wait_until
from tests.dispatch_workers import (
    enqueue_many,
    keys_requested_more_than_once,
    status_counts,
    statuses_answered,
)
from tests.pg_restart import restart_command
from tests.receiver_proc import start_receiver

pytestmark = pytest.mark.chaos

CTX = multiprocessing.get_context("spawn")
FAST = {"backoff_base_ms": 10, "backoff_max_ms": 100}


@pytest.fixture
def fast_pg_url(pg_url: str) -> str:
    """The test database with synchronous_commit off: these tests are about ordering, not disk durability."""
    name = sa.engine.make_url(pg_url).database
    admin = sa.create_engine(admin_url(), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    admin.dispose()
    return pg_url


def _result(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _join(process: BaseProcess, timeout: float) -> None:
    process.join(timeout)
    assert not process.is_alive(), f"dispatcher process {process.pid} did not finish within {timeout} s"
    assert process.exitcode == 0


def _report(name: str, **counts: Any) -> None:
    print(f"REPORT {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))


@pytest.mark.parametrize("dispatchers", [1, 2, 4])
def test_parallel_dispatchers_deliver_every_row_once(
    dispatchers: int, fast_pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(fast_pg_url)
    keys = enqueue_many(engine, 2_000, topic="work")
    with start_receiver(fast_pg_url) as receiver:
        routes = {"work": {"url": receiver.url + "/work"}}
        paths = [tmp_path / f"d{i}.json" for i in range(dispatchers)]
        workers = [
            processes(dispatch_workers.drain, fast_pg_url, routes, {"concurrency": 8}, str(path), 250)
            for path in paths
        ]
        for worker in workers:
            _join(worker, 120)
    results = [_result(p) for p in paths]
    retried = sum(r["retried"] for r in results)
    assert status_counts(engine) == {"SENT": 2_000}
    assert sum(r["sent"] for r in results) == 2_000
    assert sum(r["claimed"] for r in results) == 2_000 + retried, results
    assert all(r["lost_claims"] == 0 and r["released"] == 0 and r["dead"] == 0 for r in results), results
    applied = effects(engine)
    assert len(applied) == 2_000 and sorted(k for k, _, _ in applied) == keys
    # No key was ever in flight from two dispatchers at once: the receiver's inbox answers 409 to a second
    # delivery of a key whose first is still in progress, and none was seen. Without transient failures
    # (a loaded shared server can refuse a connection, which is retried) every key is POSTed exactly once.
    # The receiver logs each status just after its answer leaves: wait for the last ones.
    wait_until(lambda: statuses_answered(engine).get(200) == 2_000, timeout=20)
    answered = statuses_answered(engine)
    assert 409 not in answered, answered
    assert 2_000 <= request_count(engine) <= 2_000 + retried
    assert len(keys_requested_more_than_once(engine)) <= retried
    _report(
        f"{dispatchers} dispatchers",
        rows=2_000,
        posts=request_count(engine),
        effects=len(applied),
        lost=2_000 - status_counts(engine).get("SENT", 0),
        sent_per_process=[r["sent"] for r in results],
        retried=retried,
    )
    engine.dispose()


def test_sigkill_after_the_effect_redelivers_with_the_same_key_and_applies_once(
    fast_pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(fast_pg_url)
    keys = enqueue_many(engine, 20, topic="work", prefix="v2:kill")
    # claim_ms leaves 2.5 s to start each of the 20 requests (claim less its 0.5 s margin and the 2 s
    # timeout): at 2.5 s it was 0.25 s, and on a loaded machine most were given back before the kill.
    options = {"concurrency": 20, "claim_ms": 5_000, **FAST}
    with start_receiver(fast_pg_url, delay_after_apply_ms=1_500) as receiver:
        routes = {"work": {"url": receiver.url + "/work", "timeout_s": 2.0}}
        first = processes(dispatch_workers.drain, fast_pg_url, routes, options, str(tmp_path / "a.json"))
        # The receiver applied an effect and holds its response back: kill the dispatcher right there,
        # before it can mark anything SENT.
        wait_until(lambda: effect_count(engine) >= 1, timeout=30)
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        applied_before = {k for k, _, _ in effects(engine)}
        with engine.connect() as conn:
            t = outbox_table
            claimed = conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.claim_token.is_not(None))
            ).scalar_one()
        assert status_counts(engine) == {"PENDING": 20} and claimed == 20
        second = processes(dispatch_workers.drain, fast_pg_url, routes, options, str(tmp_path / "b.json"))
        _join(second, 60)
    result = _result(tmp_path / "b.json")
    assert status_counts(engine) == {"SENT": 20}
    assert result["sent"] == 20 and result["lost_claims"] == 0
    assert sorted(k for k, _, _ in effects(engine)) == keys
    for key in keys:
        assert effect_count(engine, idempotency_key=key) == 1
    for key in applied_before:
        # Applied for the killed dispatcher, which never recorded it: delivered again with the same key.
        assert request_count(engine, idempotency_key=key) >= 2
    with engine.connect() as conn:
        attempts = conn.execute(sa.select(outbox_table.c.attempts)).scalars().all()
    assert all(a >= 2 for a in attempts)
    _report(
        "sigkill",
        rows=20,
        posts=request_count(engine),
        effects=effect_count(engine),
        effects_before_kill=len(applied_before),
        lost=20 - status_counts(engine).get("SENT", 0),
    )
    engine.dispose()


def test_sigterm_finishes_in_flight_deliveries_and_gives_back_the_rest(
    fast_pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(fast_pg_url)
    enqueue_many(engine, 40, topic="work", prefix="v2:term")
    with start_receiver(fast_pg_url, delay_after_apply_ms=400) as receiver:
        routes = {"work": {"url": receiver.url + "/work"}}
        path = tmp_path / "loop.json"
        worker = processes(dispatch_workers.run_loop, fast_pg_url, routes, {"concurrency": 4}, str(path), 40)
        wait_until(_progress(worker, lambda: effect_count(engine) >= 1), timeout=30)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGTERM)
        _join(worker, 30)
    result = _result(path)
    assert result["stopped_cleanly"] is True
    counts = status_counts(engine)
    # In-flight deliveries finished and were recorded; the others were handed back untouched.
    assert result["sent"] == counts["SENT"] == effect_count(engine) >= 1
    assert result["released"] == counts["PENDING"] >= 1
    assert result["claimed"] == result["sent"] + result["released"]
    t = outbox_table
    with engine.connect() as conn:
        leftovers = conn.execute(
            sa.select(t.c.attempts, t.c.claim_token).where(t.c.status == "PENDING")
        ).all()
    assert all(r.attempts == 0 and r.claim_token is None for r in leftovers)
    engine.dispose()


def _progress(worker: BaseProcess, predicate: Callable[[], bool]) -> Callable[[], bool]:
    """``predicate``, but fail at once if the worker died instead of waiting out the timeout."""

    def check() -> bool:
        assert worker.is_alive() or predicate(), f"worker exited early with code {worker.exitcode}"
        return predicate()

    return check


@contextlib.contextmanager
def _restartable_server(pg_url: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """(a database URL, a restart of its server): a private cluster of this test's own (its data, port and
    settings kept across the restart), unless $JOBLEASE_TEST_PG_RESTART_CMD asks to restart the test
    server itself (tests/pg_restart.py). The machine's PostgreSQL is never restarted uninvited."""
    command, reason = restart_command()
    if reason:
        pytest.fail(reason)
    if command is not None:

        def restart_shared() -> None:
            subprocess.run(command, check=True, timeout=60, capture_output=True)

        try:
            yield pg_url, restart_shared
        finally:
            if not _is_up(str(admin_url())):
                restart_shared()
        return
    with private_cluster(settings=("synchronous_commit=off", "max_connections=100")) as cluster:
        migrate_engine = create_engine(cluster.url)
        migrate(migrate_engine)
        migrate_engine.dispose()
        yield cluster.url, cluster.restart


def _is_up(url: str) -> bool:
    try:
        probe = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with probe.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        probe.dispose()
        return True
    except sa.exc.OperationalError:
        return False


def test_dispatcher_survives_terminated_connections_and_a_postgres_restart(
    fast_pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    with _restartable_server(fast_pg_url) as (url, restart):
        _survives_terminated_connections_and_a_restart(url, restart, tmp_path, processes)


def _survives_terminated_connections_and_a_restart(
    url: str, restart: Callable[[], None], tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(url)
    total = 1_000
    keys = enqueue_many(engine, total, topic="work", prefix="v2:restart")
    app_name = f"jl-dispatch-{uuid.uuid4().hex[:8]}"
    # A short claim: rows whose outcome could not be recorded while the server was down come back soon.
    # A receiver connection killed mid-effect leaves its inbox claim until the claim's lock expires; the
    # receiver answers 409 with Retry-After meanwhile, so the retries must be allowed to wait that long
    # (backoff_max_ms above the Retry-After) and the lock is kept short.
    options = {"concurrency": 8, "claim_ms": 4_000, "backoff_base_ms": 10, "backoff_max_ms": 1_000}
    path = tmp_path / "loop.json"
    # Each effect takes 10 ms, so the restart surely lands while rows are still being delivered.
    with start_receiver(url, "--lock-ms", "2000", "--effect-delay-ms", "10") as receiver:
        routes = {"work": {"url": receiver.url + "/work", "timeout_s": 2.0}}
        worker = processes(dispatch_workers.run_loop, url, routes, options, str(path), 50, app_name)
        wait_until(_progress(worker, lambda: effect_count(engine) >= 100), timeout=60)
        with engine.connect() as conn:
            terminated = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = :name"
                ),
                {"name": app_name},
            ).scalar_one()
        assert terminated >= 1
        wait_until(_progress(worker, lambda: effect_count(engine) >= 300), timeout=60)
        # Count what is still to do right before the restart (after it, a fast dispatcher may already
        # have finished): the server goes down with work in flight.
        pending_at_restart = status_counts(engine).get("PENDING", 0)
        engine.dispose()
        restart()
        assert pending_at_restart > 0
        wait_until(
            _progress(worker, lambda: status_counts(engine) == {"SENT": total}), timeout=90, interval=0.2
        )
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGTERM)
        _join(worker, 30)
    result = _result(path)
    assert result["stopped_cleanly"] is True
    actions = result["actions"]
    assert sorted(k for k, _, _ in effects(engine)) == keys  # nothing lost, nothing applied twice
    _report(
        "pg restart",
        rows=total,
        posts=request_count(engine),
        effects=effect_count(engine),
        lost=total - status_counts(engine).get("SENT", 0),
        terminated_backends=terminated,
        storage_errors=actions.get("dispatch_storage_error", 0),
        record_retries=actions.get("outbox_record_retry", 0),
        unrecorded=actions.get("outbox_unrecorded", 0),
        lost_claims=result["lost_claims"],
    )
    engine.dispose()


def test_two_dispatcher_processes_on_sqlite_never_double_send(
    sqlite_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(sqlite_url)
    keys = enqueue_many(engine, 300, topic="work")
    receiver_url = f"sqlite:///{tmp_path / 'receiver.sqlite'}"
    receiver_engine = create_engine(receiver_url)
    with start_receiver(receiver_url) as receiver:
        routes = {"work": {"url": receiver.url + "/work"}}
        paths = [tmp_path / "s0.json", tmp_path / "s1.json"]
        workers = [
            processes(dispatch_workers.drain, sqlite_url, routes, {"concurrency": 4}, str(p), 50)
            for p in paths
        ]
        for worker in workers:
            _join(worker, 120)
    results = [_result(p) for p in paths]
    assert status_counts(engine) == {"SENT": 300}
    assert sum(r["sent"] for r in results) == 300
    assert sorted(k for k, _, _ in effects(receiver_engine)) == keys
    assert request_count(receiver_engine) == 300
    assert keys_requested_more_than_once(receiver_engine) == {}
    _report(
        "sqlite 2 dispatchers",
        rows=300,
        posts=request_count(receiver_engine),
        effects=effect_count(receiver_engine),
        sent_per_process=[r["sent"] for r in results],
    )
    engine.dispose()
    receiver_engine.dispose()
