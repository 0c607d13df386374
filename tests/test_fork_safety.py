"""A forked child never uses (nor closes) a connection its parent opened, and never hangs on a lock the
parent held at the fork: real forked processes on real PostgreSQL, with generous, bounded deadlines."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import threading
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.outbox import enqueue_once
from dagster_joblease.storage import autocommit, create_engine

FORK = multiprocessing.get_context("fork")
CHILD_DEADLINE_S = 60.0  # a child that has not reported by then is hung (the machine is loaded, be generous)
_BACKEND_PID = sa.text("SELECT pg_backend_pid()")


def _backend_pid(conn: sa.Connection) -> int:
    return int(conn.execute(_BACKEND_PID).scalar_one())


def _child_work(engine: sa.Engine, key: str, results: Any) -> None:
    """Everything the library does with an engine: claim, heartbeat, a fenced transaction with an outbox
    row, run_exclusive with its heartbeat thread, completion, a plain query. Reports the sessions used."""
    try:
        service = LeaseService(engine, lease_ms=60_000)
        lease = service.acquire(JobIdentity.schedule("fork", key))
        assert lease is not None, "the child's claim was refused"
        # Its dialect is whole before its first statement (a half-initialized one was used as it was).
        assert hasattr(engine.dialect, "default_isolation_level"), "the child's dialect was never initialized"
        service.heartbeat(lease)
        pids = set()
        with service.fenced_transaction(lease) as conn:
            pids.add(_backend_pid(conn))
            assert enqueue_once(conn, idempotency_key=f"v2:{key}", topic="fork", payload={"k": key})

        def body(inner: Any) -> int:
            service.heartbeat(inner)
            with engine.connect() as conn:
                return _backend_pid(conn)

        outcome = service.run_exclusive(JobIdentity.schedule("fork", f"{key}-rx"), body, heartbeat_ms=20)
        assert outcome.acquired and outcome.result is not None
        pids.add(outcome.result)
        service.complete(lease)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 42")).scalar_one() == 42
            pids.add(_backend_pid(conn))
        results.put(("ok", key, sorted(pids)))
    except BaseException as exc:  # report, then exit non-zero
        results.put(("error", key, f"{type(exc).__name__}: {exc}"))
        raise


def _collect(children: list[BaseProcess], results: Any, expected: int) -> list[tuple[str, str, Any]]:
    """Every child's report, or a failure naming the hung ones (killed, so the test ends)."""
    got: list[tuple[str, str, Any]] = []
    try:
        while len(got) < expected:
            got.append(results.get(timeout=CHILD_DEADLINE_S))
    except queue_module.Empty:
        pass
    finally:
        for child in children:
            child.join(CHILD_DEADLINE_S if len(got) == expected else 0.1)
            if child.is_alive():
                child.kill()
                child.join(10)
    assert len(got) == expected, f"{expected - len(got)} of {expected} children hung: {got}"
    return got


@pytest.fixture
def used_engine(pg_url: str) -> Iterator[sa.Engine]:
    """An engine the parent has used: pooled connections and claim connections are idle in it."""
    engine = create_engine(pg_url, pool_size=4)
    service = LeaseService(engine, lease_ms=60_000)
    lease = service.acquire(JobIdentity.schedule("fork", "parent"))
    assert lease is not None
    with service.fenced_transaction(lease):
        pass
    service.complete(lease)
    yield engine
    engine.dispose()


def _parent_sessions(engine: sa.Engine, count: int) -> set[int]:
    conns = [engine.connect() for _ in range(count)]
    try:
        return {_backend_pid(c) for c in conns}
    finally:
        for c in conns:
            c.close()


def test_forked_children_use_sessions_of_their_own_while_the_parent_keeps_querying(
    used_engine: sa.Engine,
) -> None:
    parent_pids = _parent_sessions(used_engine, 2)
    stop = threading.Event()
    answers: list[object] = []

    def parent_queries() -> None:
        while not stop.is_set():
            try:
                with used_engine.connect() as conn:
                    answers.append(conn.execute(sa.text("SELECT 42")).scalar_one())
            except Exception as exc:  # recorded, asserted below
                answers.append(exc)

    querying = threading.Thread(target=parent_queries)
    querying.start()
    results = FORK.Queue()
    children = [FORK.Process(target=_child_work, args=(used_engine, f"c{i}", results)) for i in range(6)]
    try:
        for child in children:
            child.start()
        got = _collect(children, results, len(children))
    finally:
        stop.set()
        querying.join(30)
    assert [r for r in got if r[0] != "ok"] == []
    assert [c.exitcode for c in children] == [0] * len(children)
    child_pids = {pid for _, _, pids in got for pid in pids}
    assert child_pids.isdisjoint(parent_pids), "a child ran on a session of its parent"
    assert answers and all(a == 42 for a in answers), [a for a in answers if a != 42][:5]
    # The children closed (or left behind) nothing of the parent's: its sessions still answer, the same ones.
    assert _parent_sessions(used_engine, 2) == parent_pids
    with used_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM joblease_outbox")).scalar_one() == len(children)


def test_a_pooled_connection_checked_out_in_a_child_is_never_the_parents(used_engine: sa.Engine) -> None:
    """The pid guard on checkout, without the fork hook's dispose: a child that somehow still holds the
    parent's pool (here, a pool object taken before the fork) gets a fresh session from it."""
    parent_pids = _parent_sessions(used_engine, 2)
    pool = used_engine.pool
    results = FORK.Queue()

    def child() -> None:
        connection = pool.connect()
        try:
            cursor = connection.cursor()
            cursor.execute("SELECT pg_backend_pid()")
            row = cursor.fetchone()
            assert row is not None
            results.put(("ok", "pool", [row[0]]))
        finally:
            connection.close()

    process = FORK.Process(target=child)
    process.start()
    (got,) = _collect([process], results, 1)
    assert got[0] == "ok" and got[2][0] not in parent_pids
    assert _parent_sessions(used_engine, 2) == parent_pids


def _fork(engine: sa.Engine, key: str, results: Any) -> BaseProcess:
    child = FORK.Process(target=_child_work, args=(engine, key, results))
    child.start()
    return child


def test_a_fork_while_the_claim_registry_is_locked_does_not_hang_the_child(pg_url: str) -> None:
    """A thread of the parent is inside the registry of claim connections (a first claim on a new
    engine) at the moment of the fork: the child's own first claim must not wait for it forever."""
    engine = create_engine(pg_url)
    results = FORK.Queue()
    try:
        with autocommit._registry_lock:  # what a first claim on another thread holds for a moment
            child = _fork(engine, "locked", results)
        (got,) = _collect([child], results, 1)
        assert got[0] == "ok", got
    finally:
        engine.dispose()


def test_forks_racing_first_claims_on_new_engines_never_hang(pg_url: str) -> None:
    """Threads keep making the first claim (and the first connection) on fresh engines while the main
    thread forks children that claim on those engines: every child finishes."""
    engines = [create_engine(pg_url, pool_size=2) for _ in range(12)]
    gates = [threading.Event() for _ in engines]
    first_connect_entered = [threading.Event() for _ in engines]

    for engine, gate, entered in zip(engines, gates, first_connect_entered, strict=True):

        def slow_first_connect(
            _dbapi: Any, _record: Any, gate: threading.Event = gate, entered: threading.Event = entered
        ) -> None:
            if os.getpid() == parent and not entered.is_set():
                entered.set()
                gate.wait(30)  # the parent's thread is inside the engine's first connect at the fork

        sa.event.listen(engine, "connect", slow_first_connect)

    parent = os.getpid()
    results = FORK.Queue()
    children: list[BaseProcess] = []
    threads = []
    try:
        for i, engine in enumerate(engines):
            service = LeaseService(engine, lease_ms=60_000)
            thread = threading.Thread(
                target=service.acquire, args=(JobIdentity.schedule("fork-race", f"parent-{i}"),)
            )
            thread.start()
            threads.append(thread)
            if i % 2 == 0:
                assert first_connect_entered[i].wait(30)
            children.append(_fork(engine, f"race-{i}", results))
            gates[i].set()
        got = _collect(children, results, len(children))
        assert [r for r in got if r[0] != "ok"] == []
    finally:
        for gate in gates:
            gate.set()
        for thread in threads:
            thread.join(30)
        for engine in engines:
            engine.dispose()


def test_a_child_forked_while_the_parent_initializes_the_dialect_initializes_its_own(pg_url: str) -> None:
    """A thread of the parent is inside SQLAlchemy's one-time dialect initialization (the engine's very
    first connect) at the moment of the fork. SQLAlchemy's once-only wrapper is used up before it runs, so
    the child inherits a half-initialized dialect that nothing would ever finish: its first claim must
    initialize the dialect itself and succeed (it failed with ``'PGDialect_psycopg' object has no
    attribute 'default_isolation_level'``)."""
    engine = create_engine(pg_url, pool_size=2)
    entered, gate = threading.Event(), threading.Event()
    parent = os.getpid()
    real_initialize = engine.dialect.initialize

    def slow_initialize(connection: sa.Connection) -> None:
        if os.getpid() == parent:
            entered.set()
            gate.wait(30)  # the fork happens here, before any of the dialect's attributes are set
        real_initialize(connection)

    engine.dialect.initialize = slow_initialize  # type: ignore[method-assign]
    service = LeaseService(engine, lease_ms=60_000)
    thread = threading.Thread(target=service.acquire, args=(JobIdentity.schedule("fork-init", "parent"),))
    results = FORK.Queue()
    try:
        thread.start()
        assert entered.wait(30)
        assert not hasattr(engine.dialect, "default_isolation_level")
        child = _fork(engine, "init", results)
        gate.set()
        (got,) = _collect([child], results, 1)
        assert got[0] == "ok", got
        thread.join(30)
        assert engine.dialect.default_isolation_level  # the parent finished its own initialization
    finally:
        gate.set()
        thread.join(30)
        engine.dispose()


def test_a_child_of_an_engine_made_fork_safe_after_its_first_connect_works(pg_url: str) -> None:
    """An engine of the user's own, connected before the library made it fork-safe: the child cannot
    know its dialect's initialization finished, initializes it again, and claims and queries."""
    engine = sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        LeaseService(engine, lease_ms=60_000)  # applies fork_safe to an engine already initialized
        results = FORK.Queue()
        (got,) = _collect([_fork(engine, "late", results)], results, 1)
        assert got[0] == "ok", got
    finally:
        engine.dispose()
