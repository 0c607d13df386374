"""The dispatcher's limit groups (issue 36): outcomes the downstream gave are recorded whatever else
fails (a dropped database connection mid-batch), and group rows are written in the order claims lock
them. Real PostgreSQL (and SQLite where the rule is the backend's too), a real downstream
(tests/limit_server.py); nothing measures time."""

from __future__ import annotations

import socket
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease.dispatch.dispatcher import Dispatcher
from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.errors import StorageError
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until
from tests.dispatch_workers import enqueue_many, status_counts
from tests.limit_server import serve

FAST = {"backoff_base_ms": 10, "backoff_max_ms": 100}


def _closed_port() -> int:
    """A local port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_written(statement: str, context: Any) -> str | None:
    """The limit group an INSERT or UPDATE of ``joblease_route_group`` writes (None: another statement)."""
    verb = statement.lstrip().split(None, 1)[0].upper()
    if "joblease_route_group" not in statement or verb not in ("INSERT", "UPDATE"):
        return None
    params = context.compiled_parameters[0]
    return next(str(v) for k, v in params.items() if k.startswith("limit_group"))


def test_outcomes_write_group_rows_in_the_order_claims_lock_them(engine: sa.Engine) -> None:
    """Scenario 4 of issue 36: two dispatchers deadlocked each other on group rows during an outage (four
    groups with pause_after_failures, the downstream refusing): the outcomes wrote the groups' failure
    streaks in finishing order while claims lock groups sorted. Rows that finish in reverse group order
    (inline delivery goes in id order) must write the groups sorted."""
    topics = ["d", "c", "b", "a"]
    for topic in topics:
        enqueue_many(engine, 1, topic=topic, prefix=f"v2:{topic}")
    url = f"http://127.0.0.1:{_closed_port()}/down"
    routes = {t: Route(url, limit_group=f"g-{t}", pause_after_failures=100) for t in topics}
    written: list[str] = []

    def spy(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        group = _group_written(statement, context)
        if group is not None:
            written.append(group)

    sa.event.listen(engine, "before_cursor_execute", spy)
    try:
        with Dispatcher(engine, routes, concurrency=1, backoff_base_ms=10) as dispatcher:
            report = dispatcher.dispatch()
    finally:
        sa.event.remove(engine, "before_cursor_execute", spy)
    assert report.retried == 4
    assert written == ["g-a", "g-b", "g-c", "g-d"]


def _terminate(engine: sa.Engine, application_name: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": application_name},
            ).scalar_one()
        )


def test_a_dropped_connection_mid_batch_loses_no_outcome(pg_url: str, pg_engine: sa.Engine) -> None:
    """Scenario 3 of issue 36: three requests of a max_in_flight=3 group in flight, the dispatcher's
    sessions terminated once. The batch's look for more due rows (idle workers poll for any routed row)
    raised, nothing caught it, the three 200s were never recorded, and the group showed its slots held
    until the claims expired. Every answer the downstream gave must be recorded (on a fresh connection),
    and the batch goes on: a row enqueued after the drop is claimed by a later look."""
    keys = enqueue_many(pg_engine, 6, topic="mif")
    name = f"jl-drop-{uuid.uuid4().hex[:8]}"
    engine = create_engine(pg_url, connect_args={"application_name": name})
    reports: list[DispatchReport] = []
    errors: list[BaseException] = []
    try:
        with serve(latency_s=0.0) as server:
            server.hold.set()
            routes = {
                "mif": Route(server.url + "/mif", max_in_flight=3, timeout_s=20.0),
                "plain": Route(server.url + "/plain", limit_group="plain", timeout_s=20.0),
            }
            with Dispatcher(engine, routes, concurrency=8, claim_ms=60_000) as dispatcher:

                def run() -> None:
                    try:
                        reports.append(dispatcher.dispatch())
                    except BaseException as exc:
                        errors.append(exc)

                batch = threading.Thread(target=run)
                batch.start()
                try:
                    wait_until(lambda: server.in_flight == 3, timeout=30)
                    assert _terminate(pg_engine, name) >= 1
                    keys += enqueue_many(pg_engine, 1, topic="plain", prefix="v2:plain")
                    wait_until(lambda: server.in_flight == 4 or not batch.is_alive(), timeout=30)
                finally:
                    server.released.set()
                    batch.join(60)
        assert not errors, errors
        (report,) = reports
        # The three answered before the drop are recorded; whatever the batch claimed after it too.
        assert report.sent == report.claimed >= 3 and report.unrecorded == 0, report
        with pg_engine.connect() as conn:
            t = outbox_table
            held = conn.execute(
                sa.select(sa.func.count()).where(t.c.claim_expires_at.is_not(None), t.c.status == "PENDING")
            ).scalar_one()
        assert held == 0  # no slot left held by a claim whose answer was lost
        counts = status_counts(pg_engine)
        assert counts.get("SENT") == report.sent and sum(counts.values()) == len(keys), counts
    finally:
        engine.dispose()


#: The three kinds of limit group and a route of each: unlimited (one plain claim for its topics),
#: locked (a rate: every claim under the group row's lock) and swapping (max_in_flight alone: freed slots
#: handed on by a swap, growth under the lock).
GROUP_KINDS = {
    "unlimited": {},
    "locked": {"rate": 1_000},
    "swapping": {"max_in_flight": 2},
}


class _DropAt:
    """Terminates the dispatcher's own database session right before its ``at``-th statement (the
    statement then meets a dropped connection, as when PostgreSQL or a proxy drops it mid-batch)."""

    def __init__(self, engine: sa.Engine, admin: sa.Engine, at: int) -> None:
        self.engine, self.admin, self.at = engine, admin, at
        self.seen = 0
        self.dropped: str | None = None

    def __call__(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        self.seen += 1
        if self.seen != self.at:
            return
        self.dropped = " ".join(statement.split())[:80]
        pid = cursor.connection.info.backend_pid
        with self.admin.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


@pytest.mark.parametrize("at", range(1, 13))
@pytest.mark.parametrize("kind", sorted(GROUP_KINDS))
def test_a_dropped_connection_at_each_statement_loses_no_outcome(
    pg_url: str, pg_engine: sa.Engine, kind: str, at: int
) -> None:
    """Each kind of group, the dispatcher's session dropped right before its ``at``-th statement (a claim,
    a swap, an outcome write, a group read): every row is delivered, each answer is recorded once (no
    row POSTed twice: a lost outcome would be resent when its claim expired), no claim is lost."""
    keys = enqueue_many(pg_engine, 6, topic="t")
    engine = create_engine(pg_url)
    drop = _DropAt(engine, pg_engine, at)
    totals = DispatchReport()
    try:
        with serve(latency_s=0.0) as server:
            route = Route(server.url + "/t", limit_group="g", **GROUP_KINDS[kind])
            with Dispatcher(engine, {"t": route}, concurrency=2, claim_ms=30_000, **FAST) as dispatcher:
                sa.event.listen(engine, "before_cursor_execute", drop)

                def drained() -> bool:
                    nonlocal totals
                    try:
                        totals = totals.merge(dispatcher.dispatch())
                    except StorageError:
                        pass  # the batch's first claim met the drop: nothing was claimed (run() retries)
                    return status_counts(pg_engine) == {"SENT": len(keys)}

                wait_until(drained, timeout=60, interval=0.01)
            posts = [key for _, _, key, _ in server.requests]
    finally:
        sa.event.remove(engine, "before_cursor_execute", drop)
        engine.dispose()
    assert drop.dropped is not None or drop.seen < at, "the drop did not happen"
    assert sorted(posts) == sorted(keys), f"dropped before {drop.dropped!r}: POSTs {posts}"
    assert (totals.unrecorded, totals.lost_claims) == (0, 0), (drop.dropped, totals)
