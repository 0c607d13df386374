"""Every statement on ``joblease_inbox``, named for its question; the inbox runs them on any connection.

Each is a :class:`~dagster_joblease.storage.driver.Query`, built once at import. The inbox
(:mod:`dagster_joblease.inbox`) runs them on a SQLAlchemy ``Connection`` (through
:func:`~dagster_joblease.storage.driver.in_transaction`: on psycopg, its driver connection), a SQLAlchemy
``AsyncConnection`` (``Query.statement``) or a raw psycopg ``AsyncConnection`` (``Query.sql`` and
``Query.args``). One transaction processes a key:

1. :data:`LOCK_KEY` (PostgreSQL only) takes the key's in-flight advisory lock without waiting and bounds
   the transaction's idle time; a second caller is told "in flight" at once (HTTP 409).
2. :data:`READ_KEY` reads the key's row. It is a statement of its own, after the lock: in READ COMMITTED
   its snapshot is taken once the lock is held, so it sees the row of any transaction that held the lock
   before (a lock is released only after its commit is visible). The effect then never runs for a key a
   finished transaction already recorded, even when the effect writes outside the inbox's transaction.
3. The effect runs on the same connection; :data:`RECORD_DONE` stores the answer (``ON CONFLICT DO
   NOTHING``: no row back means another transaction recorded the key first, and this one rolls back).
   :data:`RECORD_NEW` is the same row without ``ON CONFLICT``, for a caller that sends the COMMIT in the
   same round trip: a key recorded first fails it with a unique violation on this table, the server
   skips the COMMIT behind it, and the transaction rolls back.

:data:`EXPIRE_CLAIM` removes a claim left by an older version's crashed two-step consumer;
:data:`RAISE_FENCE` keeps the highest fencing number accepted under a key; :data:`PURGE_DONE` is retention.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from dagster_joblease.storage import driver
from dagster_joblease.storage.clock import db_now, db_now_plus_ms, ms_until
from dagster_joblease.storage.schema import inbox_table

__all__ = [
    "ADVISORY_LOCK_CLASS",
    "EXPIRE_CLAIM",
    "LOCK_KEY",
    "PURGE_DONE",
    "RAISE_FENCE",
    "READ_KEY",
    "RECORD_DONE",
    "RECORD_NEW",
    "InboxStatus",
    "KeyRow",
    "delete_all",
]

#: PostgreSQL: the first key of the two-int advisory lock that marks a key in flight ("jlin"), apart from
#: one-bigint advisory locks an application may use. Keys in flight show in ``pg_locks`` with this classid.
ADVISORY_LOCK_CLASS = 0x6A6C696E


class InboxStatus(enum.StrEnum):
    IN_PROGRESS = "IN_PROGRESS"  #: a claim of an older two-step consumer, until locked_until (database clock)
    DONE = "DONE"  #: the effect committed; the stored answer is replayed


class KeyRow(NamedTuple):
    """What :func:`read_key` returns for a key that has a row."""

    status: str
    payload_sha256: str
    response_status: int | None
    response_body: str | None
    response_content: bytes | None
    response_headers: str | None
    fence: int | None
    lock_left_ms: int | None
    #: When the key was first seen (the database clock): a 422 names it.
    created_at: Any = None


_t = inbox_table
_key = sa.bindparam("key", type_=sa.String())


def _lock_key() -> Any:
    """PostgreSQL: ``got`` (whether this transaction took the key's in-flight lock, without waiting).

    The same statement sets this transaction's ``idle_in_transaction_session_timeout`` to ``idle_ms``, so
    a consumer that hangs inside its effect loses its session (and the effect) instead of holding the key.
    """
    return sa.select(
        sa.func.pg_try_advisory_xact_lock(
            sa.literal_column(str(ADVISORY_LOCK_CLASS), sa.Integer()), sa.func.hashtext(_key)
        ).label("got"),
        sa.func.set_config(
            sa.literal_column("'idle_in_transaction_session_timeout'", sa.Text()),
            sa.bindparam("idle_ms", type_=sa.Text()),
            sa.true(),
        ).label("idle"),
    )


def _read_key() -> Any:
    """The key's row as a :class:`KeyRow` (no row: the key is new)."""
    # status is cast to its base type: migration 0006 made it a domain, and a prepared statement whose
    # result type changes under a running transaction fails (0A000) where a pinned one is replanned.
    return sa.select(
        sa.cast(_t.c.status, sa.String(16)).label("status"),
        _t.c.payload_sha256,
        _t.c.response_status,
        _t.c.response_body,
        _t.c.response_content,
        _t.c.response_headers,
        _t.c.fence,
        ms_until(_t.c.locked_until).label("lock_left_ms"),
        _t.c.created_at,
    ).where(_t.c.idempotency_key == _key)


def _record_done(dialect_name: str, *, on_conflict: bool = True) -> Any:
    """Store the key as DONE with its answer and fencing number; returns a row only if this inserted it
    (without ``on_conflict``: a key already recorded fails the statement)."""
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(_t)
    stored = insert.values(
        idempotency_key=_key,
        payload_sha256=sa.bindparam("sha256", type_=sa.String()),
        status=InboxStatus.DONE.value,
        response_status=sa.bindparam("response_status", type_=sa.Integer()),
        response_body=sa.bindparam("response_body", type_=sa.Text()),
        response_content=sa.bindparam("response_content", type_=sa.LargeBinary()),
        response_headers=sa.bindparam("response_headers", type_=sa.Text()),
        fence=sa.bindparam("fence", type_=sa.BigInteger()),
        created_at=db_now(),
        completed_at=db_now(),
    )
    if on_conflict:
        stored = stored.on_conflict_do_nothing(index_elements=[_t.c.idempotency_key])
    return stored.returning(_t.c.idempotency_key)


def _expire_claim() -> Any:
    """Remove an older version's two-step claim on the key once its lock has passed on the database clock."""
    return sa.delete(_t).where(
        _t.c.idempotency_key == _key,
        _t.c.status == InboxStatus.IN_PROGRESS.value,
        _t.c.locked_until < db_now(),
    )


def _raise_fence() -> Any:
    """Record ``fence`` as the key's highest accepted fencing number (never lowers it)."""
    fence = sa.bindparam("fence", type_=sa.BigInteger())
    return (
        sa.update(_t)
        .where(_t.c.idempotency_key == _key, sa.or_(_t.c.fence.is_(None), _t.c.fence < fence))
        .values(fence=fence)
    )


def _purge_done() -> Any:
    """Delete DONE keys completed more than ``older_than_ms`` ago (database clock)."""
    older = sa.bindparam("older_than_ms", type_=sa.BigInteger())
    return sa.delete(_t).where(
        _t.c.status == InboxStatus.DONE.value, _t.c.completed_at < db_now_plus_ms(-older)
    )


LOCK_KEY = driver.query(_lock_key())
READ_KEY = driver.query(_read_key())
RECORD_DONE = driver.query(_record_done("postgresql"), _record_done("sqlite"))
RECORD_NEW = driver.query(_record_done("postgresql", on_conflict=False))
EXPIRE_CLAIM = driver.query(_expire_claim())
RAISE_FENCE = driver.query(_raise_fence())
PURGE_DONE = driver.query(_purge_done())


def delete_all(conn: sa.Connection) -> None:
    """Delete every inbox key's row (the testing kit's reset between tests)."""
    conn.execute(sa.delete(_t))
