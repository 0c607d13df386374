"""The dispatcher's limit groups (issue 36): outcomes the downstream gave are recorded whatever else
fails (a dropped database connection mid-batch), and group rows are written in the order claims lock
them. Real PostgreSQL (and SQLite where the rule is the backend's too), a real downstream
(tests/limit_server.py); nothing measures time."""

from __future__ import annotations

import socket
from typing import Any

import sqlalchemy as sa

from dagster_joblease.dispatch.dispatcher import Dispatcher
from dagster_joblease.dispatch.routes import Route
from tests.dispatch_workers import enqueue_many


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
