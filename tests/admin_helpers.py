"""Shared setup for the admin and CLI tests: outbox rows in given states, and backdating on the DB clock.

Rows are enqueued with the real ``enqueue_once``; a state a dispatcher would reach (SENT, DEAD, claimed,
backed off) is then set with one plain UPDATE, so these tests do not depend on HTTP.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from dagster_joblease import outbox
from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.storage.schema import lease_table, outbox_table

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def add_outbox_row(
    engine: sa.Engine,
    key: str,
    topic: str,
    *,
    status: str = "PENDING",
    attempts: int = 0,
    last_status: int | None = None,
    last_error: str | None = None,
    next_in_ms: int = 0,
    sent_ago_ms: int | None = None,
    claimed_for_ms: int | None = None,
) -> int:
    """Enqueue one row, then put it in the given state; returns its id."""
    o = outbox_table
    with engine.begin() as conn:
        assert outbox.enqueue_once(conn, idempotency_key=key, topic=topic, payload={"key": key})
        values: dict[str, Any] = {
            "status": status,
            "attempts": attempts,
            "last_status": last_status,
            "last_error": last_error,
            "next_attempt_at": db_now_plus_ms(sa.literal(next_in_ms, sa.BigInteger())),
        }
        if sent_ago_ms is not None:
            values["sent_at"] = db_now_plus_ms(sa.literal(-sent_ago_ms, sa.BigInteger()))
        if claimed_for_ms is not None:
            values["claim_token"] = "t" * 32
            values["claim_expires_at"] = db_now_plus_ms(sa.literal(claimed_for_ms, sa.BigInteger()))
        conn.execute(sa.update(o).where(o.c.idempotency_key == key).values(**values))
        row_id: int = conn.execute(sa.select(o.c.id).where(o.c.idempotency_key == key)).scalar_one()
    return row_id


def backdate_finished(engine: sa.Engine, ms: int) -> None:
    """Pretend every finished lease row finished ``ms`` earlier (database clock)."""
    t = lease_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.finished_at.is_not(None))
            .values(finished_at=db_now_plus_ms(sa.literal(-ms, sa.BigInteger())))
        )


def backdate_acquired(engine: sa.Engine, lease_id: int, ms: int) -> None:
    t = lease_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.id == lease_id)
            .values(acquired_at=db_now_plus_ms(sa.literal(-ms, sa.BigInteger())))
        )


def count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def lease_statuses(engine: sa.Engine) -> dict[int, str]:
    t = lease_table
    with engine.connect() as conn:
        return {r.id: r.status for r in conn.execute(sa.select(t.c.id, t.c.status))}


def purge_worker(url: str, what: str, window_ms: int, out: Any) -> None:
    """Run one purge in this (separate) process and put its count, or the error text, on ``out``."""
    from dagster_joblease import admin
    from dagster_joblease.storage import create_engine

    engine = create_engine(url)
    try:
        if what == "leases":
            deleted = admin.purge_leases(engine, finished_before_ms=window_ms, min_replay_window_ms=window_ms)
        else:
            deleted = admin.purge_sent(engine, older_than_ms=window_ms, min_retention_ms=window_ms)
        out.put(deleted)
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")
    finally:
        engine.dispose()


def waiting_on_a_lock(engine: sa.Engine, statement_prefix: str) -> bool:
    """True once a backend runs a statement starting with ``statement_prefix`` and waits on a lock."""
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE :prefix"
            ),
            {"prefix": statement_prefix + "%"},
        ).scalar_one()
    return int(found) > 0


__all__ = [
    "DAY_MS",
    "HOUR_MS",
    "add_outbox_row",
    "backdate_acquired",
    "backdate_finished",
    "count",
    "lease_statuses",
    "purge_worker",
    "waiting_on_a_lock",
]
