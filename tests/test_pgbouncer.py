"""The library behind PgBouncer in transaction pooling mode, with the URL docs/operations.md section 2 gives.

Every test here runs through a real PgBouncer (``$JOBLEASE_TEST_PGBOUNCER_URL``; ``.ci/run`` starts one):
the databases are created on PostgreSQL directly, then used only through PgBouncer, except to check what
was committed. Each path runs many times from two engines (two workers), so a prepared statement left on
one server connection and met by another client would show: without ``?prepare_threshold=none`` the same
loops fail (see ``test_pgbouncer_symptoms.py``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from dagster_joblease import errors
from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.identity import JobIdentity
from dagster_joblease.inbox import Inbox, InboxResult
from dagster_joblease.lease import LeaseService, LeaseStatus, NotAcquiredReason
from dagster_joblease.outbox import enqueue_once
from dagster_joblease.receiver import effect_count, effects
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import lease_table, outbox_table
from dagster_joblease.testing.leases import reclaim_now
from tests.conftest import BouncedDatabase, wait_until
from tests.receiver_proc import start_receiver

pytestmark = [pytest.mark.pgbouncer, pytest.mark.postgres_only]

#: How often each path runs: enough that a per-connection prepared statement would collide.
ROUNDS = 100


@pytest.fixture
def engines(bounced: BouncedDatabase) -> Iterator[tuple[sa.Engine, sa.Engine]]:
    """Two engines through PgBouncer: two workers whose transactions share its server connections."""
    first, second = create_engine(bounced.url), create_engine(bounced.url)
    yield first, second
    first.dispose()
    second.dispose()


@pytest.fixture
def direct(bounced: BouncedDatabase) -> Iterator[sa.Engine]:
    """Straight to PostgreSQL: to check what was committed, never to do the work under test."""
    engine = create_engine(bounced.direct_url)
    yield engine
    engine.dispose()


def _count(engine: sa.Engine, table: sa.Table, *where: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar_one())


def test_the_url_setting_reaches_psycopg_through_pgbouncer(bounced: BouncedDatabase) -> None:
    engine = create_engine(bounced.url)
    try:
        with engine.connect() as conn:
            driver = conn.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            assert driver.prepare_threshold is None
            assert driver.info.port == make_url(bounced.url).port != 5432
            assert conn.execute(sa.text("SELECT current_database()")).scalar_one() == bounced.name
    finally:
        engine.dispose()


def test_lease_claim_refusal_reclaim_heartbeat_fenced_write_and_complete(
    engines: tuple[sa.Engine, sa.Engine], direct: sa.Engine
) -> None:
    worker = LeaseService(engines[0], lease_ms=60_000, holder="worker")
    rival = LeaseService(engines[1], lease_ms=60_000, holder="rival")
    for i in range(ROUNDS):
        job = JobIdentity.schedule("pgbouncer-lease", f"round-{i:03d}")
        lease = worker.acquire(job)
        assert lease is not None and lease.attempt == 1
        assert rival.try_acquire(job).reason is NotAcquiredReason.HELD
        worker.heartbeat(lease)
        with worker.fenced_transaction(lease) as conn:
            enqueue_once(conn, idempotency_key=f"v1:lease-{i}", topic="work", payload={"i": i})
        if i % 2:
            taken = reclaim_now(rival, lease)
            assert taken.attempt == 2
            with pytest.raises(errors.LostLeaseError):
                worker.heartbeat(lease)
            with pytest.raises(errors.LostLeaseError), worker.fenced_transaction(lease) as conn:
                enqueue_once(conn, idempotency_key=f"v1:lost-{i}", topic="work", payload={"i": i})
            rival.complete(taken)
        else:
            worker.complete(lease)
        assert worker.try_acquire(job).reason is NotAcquiredReason.SUCCEEDED
    t = lease_table
    assert _count(direct, t, t.c.status == LeaseStatus.SUCCESS.value) == ROUNDS
    assert _count(direct, t, t.c.attempt == 2) == ROUNDS // 2
    assert _count(direct, outbox_table) == ROUNDS  # the fenced writes of lost leases rolled back


def test_run_exclusive_heartbeats_through_pgbouncer(
    engines: tuple[sa.Engine, sa.Engine], direct: sa.Engine
) -> None:
    worker = LeaseService(engines[0], lease_ms=60_000)
    rival = LeaseService(engines[1], lease_ms=60_000)

    def heartbeat_at(lease_id: int) -> Any:
        with direct.connect() as conn:
            t = lease_table
            return conn.execute(sa.select(t.c.heartbeat_at).where(t.c.id == lease_id)).scalar_one()

    runs = 20
    for i in range(runs):
        job = JobIdentity.schedule("pgbouncer-exclusive", f"run-{i:02d}")

        def body(lease: Any, job: JobIdentity = job) -> int:
            seen = [heartbeat_at(lease.id)]

            def renewed_three_times() -> bool:
                now = heartbeat_at(lease.id)
                if now != seen[-1]:
                    seen.append(now)
                return len(seen) > 3

            wait_until(renewed_three_times, timeout=60)
            assert not rival.run_exclusive(job, lambda _lease: None).acquired
            assert not lease.lost
            return lease.id

        outcome = worker.run_exclusive(job, body, heartbeat_ms=20)
        assert outcome.acquired and outcome.result == outcome.lease.id  # type: ignore[union-attr]
    t = lease_table
    assert _count(direct, t, t.c.status == LeaseStatus.SUCCESS.value) == runs


def _begin(engine: sa.Engine, psycopg_conninfo: str, key: str, fail: bool) -> None:
    with engine.begin() as conn:
        assert enqueue_once(conn, idempotency_key=key, topic="work", payload={"k": key})
        if fail:
            raise _Rollback


def _connect_commit(engine: sa.Engine, psycopg_conninfo: str, key: str, fail: bool) -> None:
    with engine.connect() as conn:
        assert enqueue_once(conn, idempotency_key=key, topic="work", payload={"k": key})
        if fail:
            raise _Rollback
        conn.commit()


def _session(engine: sa.Engine, psycopg_conninfo: str, key: str, fail: bool) -> None:
    with Session(engine) as session:
        assert enqueue_once(session.connection(), idempotency_key=key, topic="work", payload={"k": key})
        if fail:
            raise _Rollback
        session.commit()


def _raw_psycopg(engine: sa.Engine, psycopg_conninfo: str, key: str, fail: bool) -> None:
    # The docs: your own psycopg connections to PgBouncer take prepare_threshold=None themselves.
    with psycopg.connect(psycopg_conninfo, prepare_threshold=None) as pg, pg.transaction():
        assert enqueue_once(pg, idempotency_key=key, topic="work", payload={"k": key})
        if fail:
            raise _Rollback


class _Rollback(Exception):
    pass


@pytest.mark.parametrize(
    "style",
    [
        pytest.param(_begin, id="engine.begin"),
        pytest.param(_connect_commit, id="connect+commit"),
        pytest.param(_session, id="session"),
        pytest.param(_raw_psycopg, id="raw-psycopg"),
    ],
)
def test_enqueue_once_in_every_connection_style(
    bounced: BouncedDatabase,
    engines: tuple[sa.Engine, sa.Engine],
    direct: sa.Engine,
    style: Callable[[sa.Engine, str, str, bool], None],
) -> None:
    conninfo = make_url(bounced.url).difference_update_query(["prepare_threshold"])
    dsn = conninfo.set(drivername="postgresql").render_as_string(hide_password=False)
    for i in range(ROUNDS):
        fail = i % 10 == 9
        try:
            style(engines[i % 2], dsn, f"v1:style-{i:03d}", fail)
        except _Rollback:
            pass
    committed = ROUNDS - ROUNDS // 10
    assert _count(direct, outbox_table) == committed
    # A committed row is a no-op to repeat (from the other worker); a rolled-back one is new again.
    for i in range(0, ROUNDS, 3):
        key = f"v1:style-{i:03d}"
        with engines[(i + 1) % 2].begin() as conn:
            assert enqueue_once(conn, idempotency_key=key, topic="work", payload={"k": key}) is (i % 10 == 9)


def test_inbox_processes_replays_refuses_and_holds_keys_in_flight(
    engines: tuple[sa.Engine, sa.Engine], direct: sa.Engine
) -> None:
    effect = sa.Table("pgb_effect", sa.MetaData(), sa.Column("key", sa.Text(), primary_key=True))
    effect.metadata.create_all(direct)
    inboxes = [Inbox(engine) for engine in engines]

    def write(key: str) -> Callable[[sa.Connection], tuple[int, str]]:
        def apply(conn: sa.Connection) -> tuple[int, str]:
            conn.execute(effect.insert().values(key=key))
            return 201, json.dumps({"key": key})

        return apply

    for i in range(ROUNDS):
        key = f"in-{i:03d}"
        first, other = inboxes[i % 2], inboxes[(i + 1) % 2]
        assert first.process(key, {"i": i}, write(key)) == InboxResult(201, json.dumps({"key": key}), False)
        assert other.process(key, {"i": i}, write(key)).replayed
        with pytest.raises(errors.InboxConflictError):
            other.process(key, {"i": -1}, write(key))
    assert _count(direct, effect) == ROUNDS

    # In flight: a second consumer is told at once (its transaction runs on another server connection).
    entered, release = threading.Event(), threading.Event()
    results: list[InboxResult] = []

    def slow(conn: sa.Connection) -> tuple[int, str]:
        conn.execute(effect.insert().values(key="slow"))
        entered.set()
        assert release.wait(30)
        return 200, "slow"

    thread = threading.Thread(target=lambda: results.append(inboxes[0].process("slow", {}, slow)))
    thread.start()
    try:
        assert entered.wait(30)
        with pytest.raises(errors.InboxInProgressError):
            inboxes[1].process("slow", {}, write("slow"))
    finally:
        release.set()
        thread.join(30)
    assert results == [InboxResult(200, "slow", False)]
    assert inboxes[1].process("slow", {}, write("slow")) == InboxResult(200, "slow", True)


def test_dispatcher_delivers_to_the_reference_receiver_process(
    bounced: BouncedDatabase, engines: tuple[sa.Engine, sa.Engine], direct: sa.Engine
) -> None:
    """Producer, dispatcher and the receiver subprocess all use the PgBouncer URL."""
    with engines[0].begin() as conn:
        for i in range(ROUNDS):
            enqueue_once(conn, idempotency_key=f"v1:send-{i:03d}", topic="work", payload={"i": i})
    with start_receiver(bounced.url) as receiver:
        with Dispatcher(engines[1], {"work": Route(receiver.url + "/work")}, concurrency=4) as dispatcher:
            sent = 0
            for _ in range(20):
                report = dispatcher.dispatch(limit=25)
                sent += report.sent
                assert report.dead == 0
                if sent == ROUNDS:
                    break
        assert sent == ROUNDS
        # Replays and a conflict, straight at the receiver (its AsyncInbox on a psycopg pool, unprepared).
        with httpx.Client(base_url=receiver.url, timeout=30) as client:
            for i in range(0, ROUNDS, 4):
                body = json.dumps({"i": i}, separators=(",", ":"))
                again = client.post("/work", content=body, headers={"Idempotency-Key": f"v1:send-{i:03d}"})
                assert again.status_code == 200, again.text
                assert again.headers.get("Idempotent-Replayed") == "true"
            other = client.post("/work", content=b'{"i": -1}', headers={"Idempotency-Key": "v1:send-000"})
            assert other.status_code == 422
        assert "prepared statement" not in receiver.stderr()
    assert effect_count(direct) == ROUNDS
    assert sorted(k for k, _, _ in effects(direct)) == [f"v1:send-{i:03d}" for i in range(ROUNDS)]
    t = outbox_table
    assert _count(direct, t, t.c.status == "SENT") == ROUNDS


def test_dispatchers_with_limits_and_a_pause_hold_through_pgbouncer(
    engines: tuple[sa.Engine, sa.Engine], direct: sa.Engine
) -> None:
    """Two dispatchers through PgBouncer share one max_in_flight=2 group (row locks in short transactions,
    no advisory locks, no prepared statements), and a 429 Retry-After pauses the group for both."""
    from dagster_joblease.storage.schema import route_group_table
    from tests.limit_server import serve

    with engines[0].begin() as conn:
        for i in range(40):
            enqueue_once(conn, idempotency_key=f"v2:lim-{i:03d}", topic="work", payload={"i": i})

    def respond(path: str, number: int) -> tuple[int, dict[str, str]]:
        return (429, {"Retry-After": "3600"}) if number == 30 else (200, {})

    with serve(latency_s=0.01, respond=respond) as server:
        route = Route(server.url + "/work", max_in_flight=2, max_pause_s=3600)
        dispatchers = [Dispatcher(engine, {"work": route}, concurrency=4) for engine in engines]
        errors_seen: list[BaseException] = []

        def work(dispatcher: Dispatcher) -> None:
            try:
                for _ in range(200):
                    report = dispatcher.dispatch(limit=10)
                    if report.paused:
                        break
            except BaseException as exc:  # reported below
                errors_seen.append(exc)

        threads = [threading.Thread(target=work, args=(d,)) for d in dispatchers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for dispatcher in dispatchers:
            dispatcher.close()
        assert errors_seen == []
        assert server.max_in_flight <= 2
        keys = [k for _, _, k, _ in server.requests]
        # After the 429 (the 30th request) at most the other slot's request, already claimed, still went.
        assert len(keys) == len(set(keys)) and 30 <= len(keys) <= 31
    with direct.connect() as conn:
        paused = conn.execute(sa.select(route_group_table.c.paused_until)).scalar_one()
    assert paused is not None
    assert _count(direct, outbox_table, outbox_table.c.status == "SENT") == len(keys) - 1
