"""Each kind of limit group's error paths, at its interface (issue 36): a group's ``complete`` (the
outcomes' writes and the refill they call for) meets a dropped connection (its session terminated by
``pg_terminate_backend``) right before each of its statements in turn. Whatever failed, every outcome the
downstream gave is recorded (on a fresh connection if need be), and every row left claimed under the
batch's token is one the refill returned (to be sent) — none claimed and lost. Real PostgreSQL, no
downstream (the outcomes are given), nothing timed."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.claims import Finished
from dagster_joblease.dispatch.dispatcher import Dispatcher
from dagster_joblease.dispatch.groups import LockedGroup, Room, SwappingGroup, UnlimitedGroups
from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import outbox_table
from tests.dispatch_workers import enqueue_many

TOKEN = "a" * 32
#: kind → (the route's limits, the implementation the dispatcher picks for its group).
KINDS: dict[str, tuple[dict[str, Any], type]] = {
    "unlimited": ({}, UnlimitedGroups),
    "locked-rate": ({"rate": 1_000}, LockedGroup),
    "locked-max-in-flight": ({"max_in_flight": 2, "dedupe_window": "1h"}, LockedGroup),
    "swapping": ({"max_in_flight": 2}, SwappingGroup),
}
SENT = policy.Decision(policy.Outcome.SENT, 200, "HTTP 200")
RETRY = policy.Decision(policy.Outcome.RETRY, 500, "HTTP 500", delay_ms=60_000)
#: The finished rows' outcomes: all sent with one status (a swapping group's one-statement path), or mixed.
OUTCOMES = {"all-sent": (SENT, SENT), "mixed": (SENT, RETRY)}


class _Statements:
    """Counts the dispatcher's statements; terminates its session right before the ``at``-th (0: never)."""

    def __init__(self, admin: sa.Engine, at: int) -> None:
        self.admin, self.at = admin, at
        self.seen = 0
        self.dropped: str | None = None

    def __call__(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        self.seen += 1
        if self.seen != self.at:
            return
        self.dropped = " ".join(statement.split())[:80]
        with self.admin.connect() as other:
            other.execute(
                sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": cursor.connection.info.backend_pid}
            )


def _complete(pg_url: str, admin: sa.Engine, kind: str, outcomes: str, at: int) -> tuple[Any, ...]:
    """Claim two rows of the kind's group, then complete them with ``outcomes`` while the session is
    dropped before the complete's ``at``-th statement; returns what the test checks."""
    enqueue_many(admin, 6, topic="t")
    limits, implementation = KINDS[kind]
    engine = create_engine(pg_url)
    route = Route("http://127.0.0.1:9/t", limit_group="g", **limits)
    report = DispatchReport()
    drop = _Statements(admin, at)
    try:
        with Dispatcher(engine, {"t": route}, concurrency=4, claim_ms=30_000) as dispatcher:
            groups = dispatcher._groups
            kind_object = groups.kinds.get("g", groups.unlimited)
            assert isinstance(kind_object, implementation)
            rows = groups.claim(TOKEN, Room(2, 2), DispatchReport(), limited_only=False).rows
            assert len(rows) == 2
            finished: list[Finished] = list(zip(rows, OUTCOMES[outcomes], strict=True))
            sa.event.listen(engine, "before_cursor_execute", drop)
            try:
                refill = groups.complete(TOKEN, finished, Room(10, 4), report, set())
            finally:
                sa.event.remove(engine, "before_cursor_execute", drop)
    finally:
        engine.dispose()
    t = outbox_table
    with admin.connect() as conn:
        states = {
            r.id: (r.status, r.last_status)
            for r in conn.execute(sa.select(t.c.id, t.c.status, t.c.last_status))
        }
        held = set(conn.execute(sa.select(t.c.id).where(t.c.claim_token == TOKEN)).scalars())
    return finished, refill, report, states, held, drop


def _statement_count(pg_url: str, admin: sa.Engine, kind: str, outcomes: str) -> int:
    *_, drop = _complete(pg_url, admin, kind, outcomes, 0)
    return int(drop.seen)


@pytest.mark.parametrize("outcomes", sorted(OUTCOMES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_dropped_connection_at_each_statement_of_complete_loses_nothing(
    pg_url: str, pg_engine: sa.Engine, kind: str, outcomes: str, request: pytest.FixtureRequest
) -> None:
    """One kind, one mix of outcomes: first its ``complete`` undisturbed (how many statements it runs), then
    once per statement with the session dropped right before it (a fresh database each time)."""
    statements = _statement_count(pg_url, pg_engine, kind, outcomes)
    assert statements >= 1
    for at in range(0, statements + 1):
        with pg_engine.begin() as conn:
            conn.execute(sa.delete(outbox_table))
        finished, refill, report, states, held, drop = _complete(pg_url, pg_engine, kind, outcomes, at)
        where = f"{kind}/{outcomes}, dropped before statement {at}: {drop.dropped!r}"
        assert at == 0 or drop.dropped is not None, where
        # Every outcome the downstream gave is recorded (a retry keeps its 500 as the last status).
        for row, decision in finished:
            assert decision is not None
            expected = "SENT" if decision.outcome is policy.Outcome.SENT else "PENDING"
            assert states[row.id] == (expected, decision.status_code), where
        assert (report.unrecorded, report.lost_claims) == (0, 0), (where, report)
        assert report.sent + report.retried == len(finished), (where, report)
        # Rows claimed under the token are exactly the refill's: none claimed and dropped on the floor.
        assert held == {r.id for r in refill.rows}, (where, held, refill.rows)
