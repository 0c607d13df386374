"""The dispatcher's limit groups (issue 36): outcomes the downstream gave are recorded whatever else
fails (a dropped database connection mid-batch), and group rows are written in the order claims lock
them. Real PostgreSQL (and SQLite where the rule is the backend's too), a real downstream
(tests/limit_server.py); nothing measures time."""

from __future__ import annotations

import socket
import threading
import uuid
from typing import Any

import sqlalchemy as sa

from dagster_joblease.dispatch.dispatcher import Dispatcher
from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until
from tests.dispatch_workers import enqueue_many, status_counts
from tests.limit_server import serve


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
