"""Every statement on ``joblease_outbox_event`` (the CDC hand-over, :mod:`dagster_joblease.cdc`).

The table is insert-only: one ``INSERT … ON CONFLICT (id) DO NOTHING`` per event (a repeat writes nothing,
so the WAL holds exactly one INSERT per event), a read of an existing row to tell a repeat from a conflict,
and retention's DELETE. Nothing here ever UPDATEs a row: Debezium's Outbox Event Router treats an UPDATE of
an outbox table as invalid.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from dagster_joblease.storage import driver, purge
from dagster_joblease.storage.clock import db_now
from dagster_joblease.storage.driver import Statements
from dagster_joblease.storage.outbox import payload_param
from dagster_joblease.storage.schema import outbox_event_table

__all__ = ["existing", "insert", "purge_older_than"]

_t = outbox_event_table
_ID = sa.bindparam("id", type_=sa.String())


def _insert(dialect_name: str) -> Any:
    """``INSERT … ON CONFLICT (id) DO NOTHING RETURNING id``: the event, unless its key has one."""
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(_t)
    return (
        insert.values(
            id=_ID,
            aggregatetype=sa.bindparam("topic", type_=sa.String()),
            aggregateid=sa.bindparam("aggregateid", type_=sa.String()),
            type=sa.bindparam("topic", type_=sa.String()),
            payload=payload_param(dialect_name),
            tracingspancontext=sa.bindparam("tracingspancontext", type_=sa.Text()),
            payload_sha256=sa.bindparam("sha256", type_=sa.String()),
            created_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=[_t.c.id])
        .returning(_t.c.id)
    )


INSERT = driver.query(_insert("postgresql"), _insert("sqlite"))
EXISTING = driver.query(
    sa.select(_t.c.payload_sha256, _t.c.aggregatetype, _t.c.aggregateid).where(_t.c.id == _ID)
)


def insert(
    db: Statements,
    *,
    key: str,
    topic: str,
    aggregateid: str,
    payload_text: str,
    sha256: str,
    tracingspancontext: str | None,
) -> bool:
    """Add the event (its payload as canonical JSON text); False when ``key`` already has one."""
    params = {
        "id": key,
        "topic": topic,
        "aggregateid": aggregateid,
        "payload_text": payload_text,
        "sha256": sha256,
        "tracingspancontext": tracingspancontext,
    }
    return db.first(INSERT, params) is not None


def existing(db: Statements, key: str) -> tuple[str, str, str] | None:
    """The fingerprint, topic and aggregate id of the event under ``key``, or None."""
    row = db.first(EXISTING, {"id": key})
    return None if row is None else (str(row[0]), str(row[1]), str(row[2]))


def purge_older_than(conn: sa.Connection, *, older_than_ms: int, dry_run: bool, limit: int) -> int:
    """Delete at most ``limit`` (or count all, ``dry_run``) events inserted more than ``older_than_ms`` ago
    on the database clock: one batch (see :func:`dagster_joblease.storage.purge.batch`)."""
    old = _t.c.created_at < purge.cutoff(older_than_ms)
    return purge.batch(conn, _t, old, dry_run=dry_run, limit=limit)
