"""enqueue_once(..., max_pending=N): a retryable refusal that writes nothing, on every connection style."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa

from dagster_joblease import errors, outbox
from dagster_joblease.storage.schema import outbox_table
from tests.dispatch_workers import status_counts


def _enqueue(conn: object, key: str, topic: str = "mail", **kw: object) -> bool:
    return outbox.enqueue_once(conn, idempotency_key=key, topic=topic, payload={"k": key}, **kw)  # type: ignore[arg-type]


def test_max_pending_refuses_retryably_and_writes_nothing(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert _enqueue(conn, "v2:a", max_pending=2)
        assert _enqueue(conn, "v2:b", max_pending=2)
        assert _enqueue(conn, "v2:other", topic="other", max_pending=2)  # another topic's backlog
    with pytest.raises(errors.OutboxBackpressureError) as info, engine.begin() as conn:
        _enqueue(conn, "v2:c", max_pending=2)
    assert info.value.retryable and info.value.pending == 2 and info.value.max_pending == 2
    assert "'mail' already has 2 pending row(s)" in str(info.value)
    assert status_counts(engine) == {"PENDING": 3}  # nothing written
    with engine.begin() as conn:
        assert _enqueue(conn, "v2:a", max_pending=2) is False  # a repeat stays a no-op, not a refusal
        assert _enqueue(conn, "v2:c")  # no bound given: no count, no refusal
    with engine.begin() as conn:
        conn.execute(sa.update(outbox_table).where(outbox_table.c.topic == "mail").values(status="SENT"))
        assert _enqueue(conn, "v2:d", max_pending=2)  # the backlog drained: accepted again


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3"])
def test_max_pending_is_validated(engine: sa.Engine, bad: object) -> None:
    with pytest.raises(errors.InvalidPayloadError, match="max_pending"), engine.begin() as conn:
        _enqueue(conn, "v2:a", max_pending=bad)


def test_max_pending_on_a_plain_psycopg_connection(pg_url: str, pg_engine: sa.Engine) -> None:
    dsn = sa.engine.make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn) as pg:
        with pg.transaction():
            assert _enqueue(pg, "v2:a", max_pending=1)
        with pytest.raises(errors.OutboxBackpressureError), pg.transaction():
            _enqueue(pg, "v2:b", max_pending=1)
        with pg.transaction():
            assert _enqueue(pg, "v2:a", max_pending=1) is False
    assert status_counts(pg_engine) == {"PENDING": 1}
