"""Every statement on ``joblease_outbox``, each named for the question it answers.

The enqueue side (:mod:`dagster_joblease.outbox`), admin, delivery status and the testing helpers call
these and hold no SQL of their own; the dispatcher's delivery statements have their own section at the
end. Enqueue statements are :class:`~dagster_joblease.storage.driver.Query` objects run in the caller's
transaction (:func:`dagster_joblease.storage.driver.in_transaction`); operator reads whose shape depends
on their filters are built per call and run through SQLAlchemy.

The partial index of pending rows is declared ``WHERE status = 'PENDING'``: PostgreSQL only uses it when
the query repeats that predicate with a literal (a bound parameter cannot be proven to match once a
statement runs with a generic plan), so statuses are written into the SQL, not bound.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from dagster_joblease.storage import driver, purge, route_groups, rowset
from dagster_joblease.storage.clock import claim_now, db_now, db_now_plus_ms, ms_until, readable_ts
from dagster_joblease.storage.driver import Statements
from dagster_joblease.storage.schema import outbox_table, route_group_table

__all__ = [
    "ENQUEUE_COLUMNS",
    "SwapResult",
    "SwapShape",
    "claim_due",
    "claim_for_group",
    "count_in_flight",
    "counts_by_topic_and_status",
    "dead_count",
    "dead_rows",
    "delete_all",
    "delivery_counts_by_topic",
    "due_backlog",
    "due_by_topic",
    "due_clause",
    "due_counts",
    "any_due",
    "expire_past_window",
    "give_back",
    "existing",
    "existing_many",
    "head_of_its_key",
    "insert_many_keyed",
    "lock_ordering_keys",
    "in_flight_by_group",
    "insert_many",
    "insert_pending",
    "blocked_keys",
    "last_id",
    "live_claim",
    "lock_for_skip",
    "lock_for_requeue",
    "mark_sent",
    "outbox_rows",
    "payload_param",
    "pending_count",
    "pending_total",
    "purge_sent",
    "record_dead",
    "record_retry",
    "requeue_dead",
    "requeue_one",
    "skip_dead",
    "skipped_count",
    "look_at_slots",
    "swap",
    "take_back",
    "unrouted_backlog",
    "unrouted_topics",
]

_t = outbox_table

_PENDING_TEXT = sa.literal_column("'PENDING'", sa.String())
_DEAD_TEXT = sa.literal_column("'DEAD'", sa.String())
#: Terminal: a person decided the row is never sent (``joblease outbox skip``). Not live: it holds no key.
_SKIPPED_TEXT = sa.literal_column("'SKIPPED'", sa.String())
_PENDING = _t.c.status == _PENDING_TEXT
_DEAD = _t.c.status == _DEAD_TEXT
_SKIPPED = _t.c.status == _SKIPPED_TEXT
#: A row that holds its ordering key's later rows back: still to be delivered (PENDING: due, waiting out a
#: backoff, or in flight) or parked DEAD until a person requeues or skips it (SKIPPED is not live: a
#: skipped row keeps its key and holds nothing back). The predicate of
#: ``ix_joblease_outbox_ordering``, written with literals so that a generic plan proves it.
_LIVE_STATUSES = (_PENDING_TEXT, _DEAD_TEXT)


def live_claim(row: sa.FromClause = _t) -> sa.ColumnElement[bool]:
    """A claim is live: its expiry is later than the database clock now. The one spelling of it (a
    claim expiring exactly now is over); a timed-out request's grace (:func:`record_retry`'s ``hold``) is
    a live claim without a token. False or NULL for a row without a claim."""
    return row.c.claim_expires_at > db_now()


def _not_in_flight() -> sa.ColumnElement[bool]:
    """No claim, or an expired one: no dispatcher is delivering the row now (not :func:`live_claim`)."""
    return sa.or_(_t.c.claim_expires_at.is_(None), sa.not_(live_claim()))


def head_of_its_key(row: sa.TableClause | sa.Table = _t) -> sa.ColumnElement[bool]:
    """Per-key ordering, the one spelling of it: ``row`` has no ordering key, or no other row of its key
    is PENDING or DEAD with a smaller id (due, retry-scheduled, in flight or parked) or PENDING with a
    :func:`live_claim` whatever its id (in flight, or a timed-out request's grace). So only the head of
    each key goes, one at a time and in id order; a DEAD row holds its key until a person requeues or
    skips it; and a row requeued while a later row of its key is in flight waits for that request to
    end (claims, ``outbox requeue`` and ``outbox skip`` all meet this one rule, at the claim).

    ``row`` is the outbox table as the claim names it (``outbox_table``, or an alias a hand-written claim
    uses). One probe of ``ix_joblease_outbox_ordering`` per keyed candidate (the key's live rows); a row
    without a key costs nothing (the ``IS NULL`` arm is decided first).
    """
    ahead = _t.alias("ahead")
    blocking = (
        sa.select(ahead.c.id)
        .where(
            ahead.c.ordering_key == row.c.ordering_key,
            ahead.c.status.in_(_LIVE_STATUSES),
            ahead.c.id != row.c.id,
            sa.or_(ahead.c.id < row.c.id, live_claim(ahead)),
        )
        .correlate(row)
    )
    return sa.or_(row.c.ordering_key.is_(None), ~blocking.exists())


def due_clause() -> sa.ColumnElement[bool]:
    """Rows a dispatcher may claim now: pending, due on the database clock, not claimed (or expired), and
    the head of their ordering key (:func:`head_of_its_key`)."""
    return sa.and_(_PENDING, _t.c.next_attempt_at <= db_now(), _not_in_flight(), head_of_its_key())


# -- enqueue: in the caller's transaction -----------------------------------------------------------------

_KEY = sa.bindparam("key", type_=sa.String())
_TOPIC = sa.bindparam("topic", type_=sa.String())


def payload_param(dialect_name: str) -> sa.ColumnElement[Any]:
    """The ``payload_text`` parameter as a JSON column's value: the canonical text bound as-is (rather than
    letting the JSON type encode the payload a second time), cast to jsonb on PostgreSQL."""
    payload: sa.ColumnElement[Any] = sa.bindparam("payload_text", type_=sa.Text())
    if dialect_name == "postgresql":
        payload = sa.cast(payload, postgresql.JSONB())
    return payload


def _insert(dialect_name: str, *, keyed: bool = False, traced: bool = False) -> Any:
    """``INSERT … ON CONFLICT (idempotency_key) DO NOTHING RETURNING id``: a new pending row, due now
    (``keyed``: with the ``ordering_key`` parameter; ``traced``: with the ``traceparent`` and
    ``tracestate`` parameters; a statement without them never names those columns)."""
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(_t)
    return (
        insert.values(
            idempotency_key=_KEY,
            topic=_TOPIC,
            payload=payload_param(dialect_name),
            payload_sha256=sa.bindparam("sha256", type_=sa.String()),
            status=_PENDING_TEXT,
            attempts=sa.literal_column("0", sa.Integer()),
            next_attempt_at=db_now(),
            created_at=db_now(),
            updated_at=db_now(),
            **({"ordering_key": _ORDERING_KEY} if keyed else {}),
            **({"traceparent": _TRACEPARENT, "tracestate": _TRACESTATE} if traced else {}),
        )
        .on_conflict_do_nothing(index_elements=[_t.c.idempotency_key])
        .returning(_t.c.id)
    )


#: The row's W3C trace context (:mod:`dagster_joblease.tracing`), written by the same INSERT as the row.
_TRACEPARENT = sa.bindparam("traceparent", type_=sa.String())
_TRACESTATE = sa.bindparam("tracestate", type_=sa.String())
_ORDERING_KEY = sa.bindparam("ordering_key", type_=sa.String())
#: PostgreSQL: the first key of the two-int advisory lock an enqueue takes on its ordering key ("jlok").
ORDERING_LOCK_CLASS = 0x6A6C6F6B
#: PostgreSQL: the class of the one advisory lock every keyed enqueue holds shared ("jloa", key 0), and a
#: set with more than :data:`MAX_KEY_LOCKS` ordering keys takes exclusively instead of one lock per key.
ORDERING_ALL_CLASS = 0x6A6C6F61
#: The most ordering-key locks one enqueue takes; a set with more keys takes the all-keys lock. Advisory
#: locks live in the server's shared lock table (max_locks_per_transaction x max_connections entries for
#: every session together): a set of 10,000 keys must not fill it.
MAX_KEY_LOCKS = 32

#: The enqueue's INSERT by (keyed, traced): one statement, naming the optional columns a row has.
INSERT_PENDING = {
    (keyed, traced): driver.query(
        _insert("postgresql", keyed=keyed, traced=traced), _insert("sqlite", keyed=keyed, traced=traced)
    )
    for keyed in (False, True)
    for traced in (False, True)
}
#: PostgreSQL: wait for (then hold, until the transaction ends) the ordering key's enqueue lock.
_ALL_KEYS = (sa.literal_column(str(ORDERING_ALL_CLASS), sa.Integer()), sa.literal_column("0", sa.Integer()))
LOCK_ORDERING_KEY = driver.query(
    sa.select(
        sa.func.pg_advisory_xact_lock_shared(*_ALL_KEYS),  # evaluated first: the all-keys lock, shared
        sa.func.pg_advisory_xact_lock(
            sa.literal_column(str(ORDERING_LOCK_CLASS), sa.Integer()), sa.func.hashtext(_ORDERING_KEY)
        ),
    )
)
#: Every ordering key at once (a set with more than MAX_KEY_LOCKS keys): waits for every keyed enqueue.
LOCK_ALL_ORDERING_KEYS = driver.query(sa.select(sa.func.pg_advisory_xact_lock(*_ALL_KEYS)))
EXISTING = driver.query(
    sa.select(_t.c.payload_sha256, _t.c.topic, _t.c.ordering_key).where(_t.c.idempotency_key == _KEY)
)
#: Pending rows of a topic, counted up to a cap (at most ``cap`` rows read).
PENDING_COUNT = driver.query(
    sa.select(sa.func.count()).select_from(
        sa.select(_t.c.id)
        .where(_PENDING, _t.c.topic == _TOPIC)
        .limit(sa.bindparam("cap", type_=sa.Integer()))
        .subquery()
    )
)


def insert_pending(
    db: Statements,
    key: str,
    topic: str,
    payload_text: str,
    sha256: str,
    ordering_key: str | None = None,
    trace: tuple[str | None, str | None] = (None, None),
) -> bool:
    """Add a pending row (its payload as canonical JSON text; its ordering key and its trace context
    ``(traceparent, tracestate)``, if any); False when the key already has one."""
    params: dict[str, Any] = {"key": key, "topic": topic, "payload_text": payload_text, "sha256": sha256}
    if ordering_key is not None:
        params["ordering_key"] = ordering_key
    if trace[0] is not None:
        params["traceparent"], params["tracestate"] = trace
    return db.first(INSERT_PENDING[ordering_key is not None, trace[0] is not None], params) is not None


def lock_ordering_keys(db: Statements, ordering_keys: Sequence[str]) -> None:
    """PostgreSQL: take each ordering key's enqueue lock (in the given order; pass them sorted), held until
    the caller's transaction ends. A second enqueue of the same key waits for this transaction, so it
    takes its id after this one committed or rolled back: ids of one key are in commit order, and a
    dispatcher never sees a key's later row before an earlier one. SQLite serializes writers anyway.

    At most :data:`MAX_KEY_LOCKS` keys are locked one by one (each beside the all-keys lock, shared); a
    set with more takes the all-keys lock exclusively instead: one lock, which waits for every keyed
    enqueue in progress and holds every other one back until this transaction ends."""
    if db.dialect != "postgresql" or not ordering_keys:
        return
    if len(ordering_keys) > MAX_KEY_LOCKS:
        db.first(LOCK_ALL_ORDERING_KEYS, {})
        return
    for ordering_key in ordering_keys:
        db.first(LOCK_ORDERING_KEY, {"ordering_key": ordering_key})


def existing(db: Statements, key: str) -> tuple[str, str, str | None] | None:
    """The fingerprint, topic and ordering key of the row under ``key``, or None."""
    row = db.first(EXISTING, {"key": key})
    return None if row is None else (str(row[0]), str(row[1]), None if row[2] is None else str(row[2]))


def pending_count(db: Statements, topic: str, cap: int) -> int:
    """How many rows of ``topic`` are pending, counting no further than ``cap``."""
    row = db.first(PENDING_COUNT, {"topic": topic, "cap": cap})
    assert row is not None
    return int(row[0])


#: The columns of a set of rows to enqueue, in the order :func:`insert_many` takes them.
ENQUEUE_COLUMNS = (
    ("key", sa.String()),
    ("topic", sa.String()),
    ("payload_text", sa.Text()),
    ("sha256", sa.String()),
)
_ENQUEUE_NAMES = tuple(name for name, _ in ENQUEUE_COLUMNS)


#: :data:`ENQUEUE_COLUMNS` and each row's ordering key (or null) and its place in the insert order.
ENQUEUE_KEYED_COLUMNS = (*ENQUEUE_COLUMNS, ("ordering_key", sa.String()), ("seq", sa.Integer()))
_ENQUEUE_KEYED_NAMES = tuple(name for name, _ in ENQUEUE_KEYED_COLUMNS)
#: Each row's own trace context, after the columns above (a set whose rows carry one).
TRACE_COLUMNS = (("traceparent", sa.String()), ("tracestate", sa.String()))
_TRACE_NAMES = tuple(name for name, _ in TRACE_COLUMNS)


def _insert_many(dialect_name: str, *, keyed: bool = False, traced: bool = False) -> Any:
    """``INSERT … SELECT … FROM <rows> ORDER BY key ON CONFLICT DO NOTHING RETURNING idempotency_key``
    (``keyed``: with each row's ordering key, inserted in the order of ``seq``, so ids follow it;
    ``traced``: with each row's own ``traceparent`` and ``tracestate``, :data:`TRACE_COLUMNS`)."""
    source = rowset.rows_source(
        dialect_name,
        (*(ENQUEUE_KEYED_COLUMNS if keyed else ENQUEUE_COLUMNS), *(TRACE_COLUMNS if traced else ())),
        joined=False,
    )
    payload: sa.ColumnElement[Any] = source.c.payload_text
    if dialect_name == "postgresql":
        payload = sa.cast(payload, postgresql.JSONB())
    rows = (
        sa.select(
            source.c.key,
            source.c.topic,
            payload,
            source.c.sha256,
            _PENDING_TEXT,
            sa.literal_column("0", sa.Integer()),
            db_now(),
            db_now(),
            db_now(),
            *([source.c.ordering_key] if keyed else []),
            *([source.c.traceparent, source.c.tracestate] if traced else []),
        )
        .select_from(source)
        .where(sa.true())  # SQLite: INSERT … SELECT … ON CONFLICT needs a WHERE to parse
        # key order: overlapping sets wait for each other, never deadlock (keyed: see insert_many_keyed)
        .order_by(source.c.seq if keyed else source.c.key)
    )
    columns = ["idempotency_key", "topic", "payload", "payload_sha256", "status", "attempts"]
    columns += ["next_attempt_at", "created_at", "updated_at"]
    columns += ["ordering_key"] if keyed else []
    columns += ["traceparent", "tracestate"] if traced else []
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(_t)
    return (
        insert.from_select(columns, rows)
        .on_conflict_do_nothing(index_elements=[_t.c.idempotency_key])
        .returning(_t.c.idempotency_key)
    )


def _existing_many(dialect_name: str) -> Any:
    """``(idempotency_key, payload_sha256, topic, ordering_key)`` of the rows under the given keys."""
    keys = rowset.rows_source(dialect_name, (("key", sa.String()),))
    read = (_t.c.idempotency_key, _t.c.payload_sha256, _t.c.topic, _t.c.ordering_key)
    if dialect_name == "postgresql":
        # One index lookup per key (LATERAL): linear whatever the planner's row estimates say.
        found = sa.select(*read).where(_t.c.idempotency_key == keys.c.key).lateral("l")
        return sa.select(*(found.c[c.name] for c in read)).select_from(keys.join(found, sa.true()))
    return sa.select(*read).select_from(_t.join(keys, _t.c.idempotency_key == keys.c.key))


def _take_back(dialect_name: str) -> Any:
    """Delete the rows under the given keys (``RETURNING`` the keys: a pipeline reads it like a row)."""
    keys = rowset.rows_source(dialect_name, (("key", sa.String()),), joined=False)
    return (
        sa.delete(_t).where(_t.c.idempotency_key.in_(sa.select(keys.c.key))).returning(_t.c.idempotency_key)
    )


#: The set's INSERT by (keyed, traced), as :data:`INSERT_PENDING`.
INSERT_MANY = {
    (keyed, traced): driver.query(
        _insert_many("postgresql", keyed=keyed, traced=traced),
        _insert_many("sqlite", keyed=keyed, traced=traced),
    )
    for keyed in (False, True)
    for traced in (False, True)
}
EXISTING_MANY = driver.query(_existing_many("postgresql"), _existing_many("sqlite"))
TAKE_BACK = driver.query(_take_back("postgresql"), _take_back("sqlite"))


def insert_many(
    db: Statements,
    rows: Sequence[tuple[str, str, str, str]],
    traces: Sequence[tuple[str | None, str | None]] | None = None,
) -> list[str]:
    """Add pending rows (key, topic, payload text, sha256; in key order) for keys that have none, each
    with its own trace context ``(traceparent, tracestate)`` from ``traces`` (one per row, in the rows'
    order; None: no row has one): the keys inserted."""
    traced = traces is not None
    params = rowset.bind_rows(
        db.dialect, (*_ENQUEUE_NAMES, *(_TRACE_NAMES if traced else ())), _with_traces(rows, traces)
    )
    return [str(row[0]) for row in db.rows(INSERT_MANY[False, traced], params)]


def insert_many_keyed(
    db: Statements,
    rows: Sequence[tuple[str, str, str, str, str | None]],
    traces: Sequence[tuple[str | None, str | None]] | None = None,
) -> list[str]:
    """:func:`insert_many` for rows (key, topic, payload text, sha256, ordering key or None) some of which
    have an ordering key: inserted in the given order (ids follow it), so the caller orders them. The keys
    inserted."""
    numbered = [(*row, seq) for seq, row in enumerate(rows)]
    traced = traces is not None
    params = rowset.bind_rows(
        db.dialect,
        (*_ENQUEUE_KEYED_NAMES, *(_TRACE_NAMES if traced else ())),
        _with_traces(numbered, traces),
    )
    return [str(row[0]) for row in db.rows(INSERT_MANY[True, traced], params)]


def _with_traces(
    rows: Sequence[tuple[Any, ...]], traces: Sequence[tuple[str | None, str | None]] | None
) -> Sequence[tuple[Any, ...]]:
    """Each row followed by its trace context (``traces`` None: the rows as they are)."""
    if traces is None:
        return rows
    return [(*row, *trace) for row, trace in zip(rows, traces, strict=True)]


def existing_many(db: Statements, keys: Sequence[str]) -> dict[str, tuple[str, str, str | None]]:
    """Key → (fingerprint, topic, ordering key) of the rows under ``keys``."""
    params = rowset.bind_rows(db.dialect, ("key",), [(key,) for key in keys])
    return {
        str(key): (str(sha), str(topic), None if ordering is None else str(ordering))
        for key, sha, topic, ordering in db.rows(EXISTING_MANY, params)
    }


def take_back(db: Statements, keys: Sequence[str]) -> int:
    """Delete the rows under ``keys`` (what a refused enqueue of a set had inserted); how many."""
    params = rowset.bind_rows(db.dialect, ("key",), [(key,) for key in keys])
    return len(db.rows(TAKE_BACK, params))


# -- what is waiting: summaries, delivery health ----------------------------------------------------------


def due_counts(
    conn: sa.Connection, topics: Sequence[str] | None, exclude: Sequence[str] = ()
) -> tuple[int, int | None, int]:
    """Over pending rows of ``topics`` (None: all) less ``exclude``: rows due now (claimable: a row its
    ordering key holds back is not), ms since the oldest became due (None: none due), and rows that
    already failed at least once (not in flight)."""
    due = sa.and_(_t.c.next_attempt_at <= db_now(), _not_in_flight(), head_of_its_key())
    stmt = (
        sa.select(
            sa.func.count().filter(due),
            -ms_until(sa.func.min(_t.c.next_attempt_at).filter(due)),
            sa.func.count().filter(sa.and_(_t.c.attempts > 0, _not_in_flight())),
        )
        .select_from(_t)
        .where(_PENDING)
    )
    if topics is not None:
        stmt = stmt.where(_t.c.topic.in_(topics))
    if exclude:
        stmt = stmt.where(_t.c.topic.not_in(exclude))
    count, age, retrying = conn.execute(stmt).one()
    return int(count), None if age is None else int(age), int(retrying)


def _routed(topics: Sequence[str] | None) -> sa.ColumnElement[bool]:
    return sa.true() if topics is None else _t.c.topic.in_(topics)


def pending_total(conn: sa.Connection) -> int:
    """Rows PENDING, every topic (due or waiting out a backoff, claimed or not)."""
    return int(conn.execute(sa.select(sa.func.count()).select_from(_t).where(_PENDING)).scalar_one())


def topic_count(conn: sa.Connection, topic: str) -> int:
    """Rows of ``topic``, any status."""
    stmt = sa.select(sa.func.count()).select_from(_t).where(_t.c.topic == topic)
    return int(conn.execute(stmt).scalar_one())


def dead_count(conn: sa.Connection, topics: Sequence[str] | None) -> int:
    """Rows of ``topics`` (None: all) parked DEAD."""
    stmt = sa.select(sa.func.count()).select_from(_t).where(_DEAD, _routed(topics))
    return int(conn.execute(stmt).scalar_one())


def skipped_count(conn: sa.Connection, topics: Sequence[str] | None) -> int:
    """Rows of ``topics`` (None: all) a person marked SKIPPED (never sent; not dead)."""
    stmt = sa.select(sa.func.count()).select_from(_t).where(_SKIPPED, _routed(topics))
    return int(conn.execute(stmt).scalar_one())


def dead_rows(conn: sa.Connection, topics: Sequence[str] | None, limit: int) -> list[Any]:
    """The first ``limit`` DEAD rows of ``topics`` (None: all) by id: id, idempotency_key, topic, attempts,
    last_status, last_error."""
    stmt = (
        sa.select(_t.c.id, _t.c.idempotency_key, _t.c.topic, _t.c.attempts, _t.c.last_status, _t.c.last_error)
        .where(_DEAD, _routed(topics))
        .order_by(_t.c.id)
        .limit(limit)
    )
    return list(conn.execute(stmt).all())


def _blocking_heads(topics: Sequence[str] | None) -> Any:
    """Per ordering key with a DEAD row (of ``topics``; None: all): the key and its first DEAD row's id,
    read through ``ix_joblease_outbox_ordering`` (DEAD keyed rows are in it)."""
    return (
        sa.select(_t.c.ordering_key, sa.func.min(_t.c.id).label("id"))
        .where(_t.c.ordering_key.is_not(None), _t.c.status.in_(_LIVE_STATUSES), _DEAD, _routed(topics))
        .group_by(_t.c.ordering_key)
        .subquery("heads")
    )


def blocked_keys(conn: sa.Connection, topics: Sequence[str] | None, limit: int) -> tuple[int, list[Any]]:
    """Ordering keys a DEAD row (of ``topics``; None: all) blocks: how many, and the first ``limit`` by the
    blocking row's id: ``ordering_key``, ``id`` (the blocking row: its first DEAD row), ``topic`` and
    ``held`` (PENDING rows of the key after it, which no dispatcher claims until it is requeued or
    skipped)."""
    heads = _blocking_heads(topics)
    count = int(conn.execute(sa.select(sa.func.count()).select_from(heads)).scalar_one())
    if count == 0:
        return 0, []
    later = _t.alias("later")
    held = (
        sa.select(sa.func.count())
        .where(later.c.ordering_key == heads.c.ordering_key, later.c.status.in_(_LIVE_STATUSES))
        .where(later.c.status == _PENDING_TEXT, later.c.id > heads.c.id)
        .scalar_subquery()
    )
    stmt = (
        sa.select(heads.c.ordering_key, heads.c.id, _t.c.topic, held.label("held"))
        .select_from(heads.join(_t, _t.c.id == heads.c.id))
        .order_by(heads.c.id)
        .limit(limit)
    )
    return count, list(conn.execute(stmt).all())


def _unrouted(topics: Sequence[str], older_than_ms: int) -> sa.ColumnElement[bool]:
    return sa.and_(
        _PENDING,
        _t.c.topic.not_in(topics),
        _t.c.created_at < db_now_plus_ms(sa.literal(-older_than_ms, sa.BigInteger())),
    )


def unrouted_backlog(
    conn: sa.Connection, topics: Sequence[str], older_than_ms: int
) -> tuple[int, int | None]:
    """Pending rows of topics other than ``topics`` created more than ``older_than_ms`` ago: how many,
    and the age in ms of the oldest (None: none)."""
    stmt = (
        sa.select(sa.func.count(), -ms_until(sa.func.min(_t.c.created_at)))
        .select_from(_t)
        .where(_unrouted(topics, older_than_ms))
    )
    count, age = conn.execute(stmt).one()
    return int(count), None if age is None else int(age)


def unrouted_topics(conn: sa.Connection, topics: Sequence[str], older_than_ms: int, limit: int) -> list[str]:
    """The first ``limit`` topics (by name) of :func:`unrouted_backlog`'s rows."""
    where = _unrouted(topics, older_than_ms)
    stmt = sa.select(_t.c.topic).where(where).distinct().order_by(_t.c.topic).limit(limit)
    return [str(topic) for topic in conn.execute(stmt).scalars()]


def due_by_topic(conn: sa.Connection, *, not_in: Sequence[str]) -> dict[str, int]:
    """Due rows per topic (topics in ``not_in`` left out), in topic order."""
    stmt = (
        sa.select(_t.c.topic, sa.func.count()).where(due_clause()).group_by(_t.c.topic).order_by(_t.c.topic)
    )
    if not_in:
        stmt = stmt.where(_t.c.topic.not_in(not_in))
    return {str(topic): int(n) for topic, n in conn.execute(stmt)}


# -- operators (admin, delivery status) ------------------------------------------------------------------


def counts_by_topic_and_status(conn: sa.Connection) -> list[tuple[str, str, int]]:
    """(topic, status, rows) for every pair that has rows, in that order."""
    stmt = (
        sa.select(_t.c.topic, _t.c.status, sa.func.count())
        .group_by(_t.c.topic, _t.c.status)
        .order_by(_t.c.topic, _t.c.status)
    )
    return [(str(topic), str(status), int(n)) for topic, status, n in conn.execute(stmt)]


def due_backlog(conn: sa.Connection) -> tuple[int, int | None]:
    """Rows due now and the ms until the oldest one's ``next_attempt_at`` (negative: overdue by that
    much; None: no row is due)."""
    stmt = sa.select(sa.func.count(), ms_until(readable_ts(sa.func.min(_t.c.next_attempt_at)))).where(
        due_clause()
    )
    due, oldest = conn.execute(stmt).one()
    return int(due), None if oldest is None else int(oldest)


def _claimed() -> sa.ColumnElement[bool]:
    """A dispatcher holds a :func:`live_claim` on the row."""
    return sa.case((live_claim(), sa.true()), else_=sa.false()).label("claimed")


def _rows_select() -> sa.Select[Any]:
    """One outbox row as operators see it: without its payload, timestamps clamped, the ms until it is
    due (PENDING rows; database clock) and whether it is claimed now."""
    return sa.select(
        _t.c.id,
        _t.c.idempotency_key,
        _t.c.topic,
        _t.c.status,
        _t.c.attempts,
        readable_ts(_t.c.next_attempt_at).label("next_attempt_at"),
        sa.case((_PENDING, ms_until(readable_ts(_t.c.next_attempt_at))), else_=sa.null()).label("due_in_ms"),
        _claimed(),
        _t.c.last_status,
        _t.c.last_error,
        readable_ts(_t.c.created_at).label("created_at"),
        readable_ts(_t.c.updated_at).label("updated_at"),
        readable_ts(_t.c.sent_at).label("sent_at"),
        _t.c.ordering_key,
    )


def outbox_rows(
    conn: sa.Connection, *, status: str | None = None, topic: str | None = None, limit: int = 100
) -> list[sa.Row[Any]]:
    """Rows as operators see them (see :func:`_rows_select`), newest first, by status and topic."""
    stmt = _rows_select()
    if status is not None:
        stmt = stmt.where(_t.c.status == status)
    if topic is not None:
        stmt = stmt.where(_t.c.topic == topic)
    return list(conn.execute(stmt.order_by(_t.c.id.desc()).limit(limit)))


def _requeued() -> dict[str, Any]:
    """A row made due again: its key kept, attempts and claim cleared, the retention window restarted
    (``first_attempt_at``: a person's requeue is their decision to send again)."""
    return {
        "status": "PENDING",
        "attempts": 0,
        "next_attempt_at": db_now(),
        "claim_token": None,
        "claim_expires_at": None,
        "first_attempt_at": None,
        "claim_group": None,
        "deferrals": 0,
        "updated_at": db_now(),
    }


def lock_for_requeue(conn: sa.Connection, row_id: int) -> tuple[str, bool] | None:
    """The status of row ``row_id`` and whether it is claimed now, its row locked until the transaction
    of ``conn`` ends; None when there is no such row."""
    stmt = sa.select(_t.c.status, _claimed()).where(_t.c.id == row_id).with_for_update()
    row = conn.execute(stmt).first()
    return None if row is None else (str(row[0]), bool(row[1]))


def requeue_one(conn: sa.Connection, row_id: int, status: str) -> int:
    """Make row ``row_id`` due again if it still has ``status``: DEAD or SKIPPED, or PENDING and nobody is
    delivering it; how many rows changed (0 or 1)."""
    unchanged = (
        sa.and_(_PENDING, _not_in_flight())
        if status == "PENDING"
        else _t.c.status == (_SKIPPED_TEXT if status == "SKIPPED" else _DEAD_TEXT)
    )
    return int(conn.execute(sa.update(_t).where(_t.c.id == row_id, unchanged).values(**_requeued())).rowcount)


def lock_for_skip(conn: sa.Connection, row_id: int) -> tuple[str, str | None, str | None] | None:
    """The status, ordering key and last error of row ``row_id``, its row locked until the transaction of
    ``conn`` ends; None when there is no such row."""
    stmt = (
        sa.select(_t.c.status, _t.c.ordering_key, _t.c.last_error).where(_t.c.id == row_id).with_for_update()
    )
    row = conn.execute(stmt).first()
    return None if row is None else (str(row[0]), row[1], row[2])


def skip_dead(conn: sa.Connection, row_id: int, last_error: str) -> int:
    """DEAD row ``row_id`` becomes SKIPPED (never sent), with ``last_error``, its ``updated_at`` the
    database clock (the time ``purge_sent`` ages a skipped row by). It keeps its ordering key, which no
    longer holds the key's later rows back. How many rows changed (0 or 1)."""
    stmt = (
        sa.update(_t)
        .where(_t.c.id == row_id, _DEAD)
        .values(status=_SKIPPED_TEXT, last_error=last_error, updated_at=db_now())
    )
    return int(conn.execute(stmt).rowcount)


def requeue_dead(conn: sa.Connection, topic: str | None) -> int:
    """Make every DEAD row (of ``topic``, when given) due again; how many. SKIPPED rows are not touched."""
    where = _DEAD if topic is None else sa.and_(_DEAD, _t.c.topic == topic)
    return int(conn.execute(sa.update(_t).where(where).values(**_requeued())).rowcount)


def purge_sent(conn: sa.Connection, *, sent_before_ms: int, dry_run: bool, limit: int) -> int:
    """Delete at most ``limit`` (or count all, ``dry_run``) SENT rows delivered more than
    ``sent_before_ms`` ago on the database clock, then SKIPPED rows skipped that long ago (their
    ``updated_at``, which the skip set to the database clock and nothing changes after): one batch (see
    :func:`dagster_joblease.storage.purge.batch`)."""
    cutoff = purge.cutoff(sent_before_ms)
    sent = sa.and_(_t.c.status == _SENT_TEXT, _t.c.sent_at < cutoff)
    count = purge.batch(conn, _t, sent, dry_run=dry_run, limit=limit)
    skipped = sa.and_(_SKIPPED, _t.c.updated_at < cutoff)
    return count + purge.batch(conn, _t, skipped, dry_run=dry_run, limit=limit - count)


def delivery_counts_by_topic(conn: sa.Connection) -> dict[str, list[int]]:
    """Topic → [due now, in flight, waiting (a backoff or a pause), retrying, dead, skipped], from one
    grouped read of the pending, dead and skipped rows."""
    idle = sa.and_(_PENDING, _not_in_flight())
    stmt = (
        sa.select(
            _t.c.topic,
            sa.func.count().filter(sa.and_(idle, _t.c.next_attempt_at <= db_now())),
            sa.func.count().filter(sa.and_(_PENDING, live_claim())),
            sa.func.count().filter(sa.and_(idle, _t.c.next_attempt_at > db_now())),
            sa.func.count().filter(sa.and_(idle, _t.c.attempts > 0)),
            sa.func.count().filter(_DEAD),
            sa.func.count().filter(_SKIPPED),
        )
        .where(_t.c.status.in_([_PENDING_TEXT, _DEAD_TEXT, _SKIPPED_TEXT]))
        .group_by(_t.c.topic)
        .order_by(_t.c.topic)
    )
    return {str(row[0]): [int(v) for v in row[1:]] for row in conn.execute(stmt)}


def in_flight_by_group(conn: sa.Connection) -> dict[str, int]:
    """Limit group → unexpired claims holding its capacity (every dispatcher)."""
    stmt = (
        sa.select(_t.c.claim_group, sa.func.count())
        .where(_t.c.claim_group.is_not(None), live_claim(), _PENDING)
        .group_by(_t.c.claim_group)
    )
    return {str(group): int(n) for group, n in conn.execute(stmt)}


def _in_flight_query(group: str) -> sa.Select[Any]:
    """``SELECT count(*)`` of the claims holding ``group``'s capacity now (see :func:`count_in_flight`);
    a limited claim counts it as a subquery in its own LIMIT (:func:`_slots_left`)."""
    return sa.select(sa.func.count()).select_from(_t).where(_t.c.claim_group == group, live_claim(), _PENDING)


def _slots_left(
    dialect_name: str, group: str, max_in_flight: int, want: int | sa.ColumnElement[int]
) -> sa.ColumnElement[int]:
    """``min(want, max_in_flight - in flight now)``, at least 0, as an SQL expression: a claim's LIMIT, so
    the count and the claim are one statement (under the group's lock, its snapshot sees every claim and
    release committed before)."""
    if isinstance(want, int):
        want = sa.literal(want, sa.Integer())
    left = sa.literal(max_in_flight, sa.Integer()) - _in_flight_query(group).scalar_subquery()
    if dialect_name == "postgresql":
        return sa.func.greatest(0, sa.func.least(want, left), type_=sa.Integer())
    return sa.func.max(0, sa.func.min(want, left), type_=sa.Integer())


def count_in_flight(conn: sa.Connection, group: str) -> int:
    """Requests of ``group`` in flight now: unexpired claims holding its capacity (any dispatcher)."""
    return int(conn.execute(_in_flight_query(group)).scalar_one())


def delete_all(conn: sa.Connection) -> None:
    """Delete every outbox row (the testing kit's reset between tests)."""
    conn.execute(sa.delete(_t))


def last_id(conn: sa.Connection) -> int:
    """The highest row id so far (0 when the table is empty)."""
    return int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(_t.c.id), 0))).scalar_one())


# == The dispatcher's delivery statements (claim, sent, give-back, swap) ===================================
# Everything above this line is the enqueue side's, admin's and delivery status's; below, each statement
# the dispatcher (dagster_joblease.dispatch) runs on this table, spelled once. The claim's columns (what it
# writes and what it returns) are :func:`_claim_update`'s, which every claim (the plain one, a limited
# group's, the swap) builds on: a new claim column is added there.

_SENT_TEXT = sa.literal_column("'SENT'", sa.String())


def _claim_update(
    dialect_name: str,
    limit: int | sa.ColumnElement[int],
    claim_ms: int,
    topics: tuple[str, ...] | None,
    claim_group: str | None,
) -> sa.Update:
    """The claim without its token: lock up to ``limit`` due rows (``FOR UPDATE SKIP LOCKED`` on
    PostgreSQL), stamp an expiry and ``claim_group``, count the attempt, record the first attempt's time if
    this is it, and return the claim's columns (see :func:`claim_due`)."""
    due = sa.select(_t.c.id).where(due_clause())
    if topics is not None:
        due = due.where(_t.c.topic.in_(topics))
    due = due.order_by(_t.c.next_attempt_at, _t.c.id).limit(limit)
    payload: sa.ColumnElement[Any]
    if dialect_name == "postgresql":
        # A locking CTE is evaluated exactly once; rows another dispatcher holds are skipped.
        locked = due.with_for_update(skip_locked=True).cte("due")
        stmt = sa.update(_t).where(_t.c.id == locked.c.id)
        payload = sa.cast(_t.c.payload, sa.Text())
    else:
        # SQLite: the engine's BEGIN IMMEDIATE already serializes claimers.
        stmt = sa.update(_t).where(_t.c.id.in_(due.scalar_subquery()))
        payload = sa.type_coerce(_t.c.payload, sa.Text())
    return stmt.values(
        claim_token=None,
        claim_expires_at=db_now_plus_ms(sa.literal(claim_ms, sa.BigInteger())),
        claim_group=sa.literal(claim_group, sa.String()) if claim_group is not None else None,
        attempts=_t.c.attempts + 1,
        first_attempt_at=sa.func.coalesce(_t.c.first_attempt_at, claim_now()),
        updated_at=db_now(),
    ).returning(
        _t.c.id,
        _t.c.idempotency_key,
        _t.c.topic,
        # As plain INTEGER: migration 0006 retypes the column to a domain, and a prepared statement whose
        # result type changed fails once per connection ("cached plan must not change result type").
        sa.cast(_t.c.attempts, sa.Integer()).label("attempts"),
        payload.label("payload"),
        _t.c.deferrals,
        _t.c.first_attempt_at,
        claim_now().label("claim_now"),
        _t.c.ordering_key,
        # The row's creation trace context (0010) and its INSERT time: the send span's link, the headers'
        # traceparent, and the time in the outbox (dagster_joblease.tracing).
        _t.c.traceparent,
        _t.c.tracestate,
        _t.c.created_at,
    )


@functools.lru_cache(maxsize=256)
def _claim_template(
    dialect_name: str,
    limit: int | sa.ColumnElement[int],
    claim_ms: int,
    topics: tuple[str, ...] | None,
    claim_group: str | None,
) -> sa.Update:
    return _claim_update(dialect_name, limit, claim_ms, topics, claim_group)


def _claim_statement(
    dialect_name: str,
    *,
    token: str | sa.BindParameter[str],
    limit: int | sa.ColumnElement[int],
    claim_ms: int,
    topics: Collection[str] | None = None,
    claim_group: str | None = None,
) -> sa.Update:
    """The claim of :func:`claim_due`, its token bound (a value, or a parameter set per call). The
    statement is built once per shape (dialect, limit, claim_ms, topics, group) and only the token is set
    per call: building it afresh cost more client CPU (about 1.2 ms) than the claim's round trip."""
    key = None if topics is None else tuple(sorted(topics))
    return _claim_template(dialect_name, limit, claim_ms, key, claim_group).values(claim_token=token)


def claim_due(
    conn: sa.Connection,
    *,
    token: str,
    limit: int,
    claim_ms: int,
    topics: Collection[str] | None = None,
) -> list[sa.Row[Any]]:
    """Which due rows does this claim take? Lock up to ``limit`` due rows (of ``topics`` only, when
    given), stamp ``token`` and an expiry, record the first attempt's time if this is it (a give-back
    undoes it), count the attempt, and return ``(id, idempotency_key, topic, attempts, payload as text,
    deferrals, first_attempt_at, claim_now, ordering_key, traceparent, tracestate, created_at)``, run in
    ``conn``'s transaction.

    The payload comes back as text (``jsonb::text`` on PostgreSQL) and is sent as-is: decoding it to
    Python only to encode it again would cost time and could change it.
    """
    key = None if topics is None else tuple(sorted(topics))
    return list(conn.execute(_due_claim(conn.dialect.name, limit, claim_ms, key), {"token": token}))


@functools.lru_cache(maxsize=256)
def _due_claim(dialect_name: str, limit: int, claim_ms: int, topics: tuple[str, ...] | None) -> sa.Update:
    """:func:`claim_due`'s statement, its token a parameter (``token``): one object per shape, so a claim
    neither copies the template to set its token nor walks a fresh statement for its cache key."""
    return _claim_statement(
        dialect_name,
        token=sa.bindparam("token", type_=sa.String()),
        limit=limit,
        claim_ms=claim_ms,
        topics=topics,
    )


@functools.lru_cache(maxsize=256)
def _group_claim(
    dialect_name: str, group: str, topics: tuple[str, ...], claim_ms: int, max_in_flight: int | None
) -> sa.Update:
    want: sa.ColumnElement[int] = sa.bindparam("want", type_=sa.Integer())
    return _claim_statement(
        dialect_name,
        token=sa.bindparam("token", type_=sa.String()),
        limit=want if max_in_flight is None else _slots_left(dialect_name, group, max_in_flight, want),
        claim_ms=claim_ms,
        topics=topics,
        claim_group=group,
    )


def claim_for_group(
    conn: sa.Connection,
    *,
    group: str,
    topics: Collection[str],
    claim_ms: int,
    token: str,
    want: int,
    max_in_flight: int | None = None,
) -> list[sa.Row[Any]]:
    """Which due rows of a limit group does this claim take? :func:`claim_due` for the group's ``topics``
    under ``token``, up to ``want`` rows, the claims holding ``group``'s capacity, run in ``conn``'s
    transaction (the caller holds the group's row lock); the rows sorted by id. ``max_in_flight``: and
    no more than the slots that limit leaves, counted by the statement itself (:func:`_slots_left`). The
    statement is built once per group and shape, bound per call."""
    stmt = _group_claim(conn.dialect.name, group, tuple(sorted(topics)), claim_ms, max_in_flight)
    return sorted(conn.execute(stmt, {"token": token, "want": want}), key=lambda r: r[0])


def mark_sent(conn: sa.Connection, ids: Sequence[int], token: str, status_code: int | None) -> list[int]:
    """Which claimed rows did the downstream accept? ``ids`` marked ``SENT`` with ``status_code``, fenced
    by claim ``token``, in one statement for a whole group of outcomes (:func:`_mark_sent_statement`);
    returns the ids it matched (a row whose claim was lost matches nothing)."""
    params = {"ids": list(ids), "token": token, "status_code": status_code}
    return [int(i) for i in conn.execute(_mark_sent_statement(conn.dialect.name), params).scalars()]


@functools.cache
def _mark_sent_statement(dialect_name: str) -> sa.Update:
    """:func:`mark_sent`'s statement, bound with ``ids`` (the rows), ``token`` (the claim token) and
    ``status_code``; returns the ids it matched.

    Built once per dialect, so each group of outcomes costs only its parameters: on PostgreSQL the ids
    travel as one array (``id = ANY(:ids)``), so the SQL text is the same whatever their number (no
    per-call IN-list expansion, and the compiled statement and the driver's parsed query are reused).
    """
    ids: sa.ColumnElement[bool]
    if dialect_name == "postgresql":
        ids = _t.c.id == sa.any_(sa.bindparam("ids", type_=postgresql.ARRAY(sa.BigInteger())))
    else:
        ids = _t.c.id.in_(sa.bindparam("ids", expanding=True))
    return (
        sa.update(_t)
        .where(ids, _t.c.claim_token == sa.bindparam("token", type_=sa.String()), _PENDING)
        .values(_sent())
        .returning(_t.c.id)
    )


def _unclaimed() -> dict[str, Any]:
    """The values that end a claim."""
    return {"claim_token": None, "claim_expires_at": None, "claim_group": None, "updated_at": db_now()}


def _sent() -> dict[str, Any]:
    """The values of a row the downstream accepted (bound with ``status_code``): :func:`mark_sent` and the
    swap's ``done`` step write the same."""
    return {
        **_unclaimed(),
        "last_status": sa.bindparam("status_code", type_=sa.Integer()),
        "status": _SENT_TEXT,
        "sent_at": db_now(),
        "last_error": None,
    }


def _fenced(token: str) -> tuple[sa.ColumnElement[bool], ...]:
    """A claim's outcome write matches only while the claim is this one's and the row still pending."""
    return (_t.c.claim_token == token, _PENDING)


def record_retry(
    conn: sa.Connection,
    row_id: int,
    token: str,
    *,
    status_code: int | None,
    reason: str,
    delay_ms: int,
    deferred: bool,
    hold: tuple[str | None, int] | None = None,
) -> bool:
    """When may a failed row be tried again? In ``delay_ms`` (database clock), fenced by claim; returns
    whether it matched. ``deferred``: a ``Retry-After`` pause, not counted against max_attempts.
    ``hold``: (group or None, ms) the row stays in flight, a :func:`live_claim` without a token (a
    timed-out request the downstream may still be working on): it is not claimed again, its ordering
    key's later rows wait (:func:`head_of_its_key`), and a limited group's slot stays taken."""
    values: dict[str, Any] = {
        **_unclaimed(),
        "last_status": status_code,
        "next_attempt_at": db_now_plus_ms(sa.literal(delay_ms, sa.BigInteger())),
        "last_error": reason,
    }
    if hold is not None:
        group, hold_ms = hold
        values.update(
            claim_group=group, claim_expires_at=db_now_plus_ms(sa.literal(hold_ms, sa.BigInteger()))
        )
    if deferred:
        values.update(attempts=_t.c.attempts - 1, deferrals=_t.c.deferrals + 1)
    stmt = sa.update(_t).where(_t.c.id == row_id, *_fenced(token)).values(**values).returning(_t.c.id)
    return conn.execute(stmt).first() is not None


def record_dead(
    conn: sa.Connection, row_id: int, token: str, *, status_code: int | None, reason: str, unsent: bool
) -> bool:
    """A row that will not be tried again: ``DEAD``, fenced by claim; returns whether it matched.
    ``unsent``: it never reached the downstream, so the attempt its claim counted is undone."""
    values: dict[str, Any] = {
        **_unclaimed(),
        "last_status": status_code,
        "status": _DEAD_TEXT,
        "last_error": reason,
    }
    if unsent:
        values.update(attempts=_t.c.attempts - 1)
    stmt = sa.update(_t).where(_t.c.id == row_id, *_fenced(token)).values(**values).returning(_t.c.id)
    return conn.execute(stmt).first() is not None


def give_back(conn: sa.Connection, ids: Sequence[int], token: str, *, stamped: bool) -> None:
    """Claims given back undelivered: the attempt the claim counted is taken back, and (``stamped``: the
    claim stamped it) so is the first attempt's time (the downstream never saw the row: its
    dedupe_window has not begun)."""
    values: dict[str, Any] = {**_unclaimed(), "attempts": _t.c.attempts - 1}
    if stamped:
        values["first_attempt_at"] = None
    conn.execute(sa.update(_t).where(_t.c.id.in_(ids), *_fenced(token)).values(**values))


def expire_past_window(
    conn: sa.Connection, *, topics: Collection[str], window_ms: int, margin_ms: int, reason: str
) -> list[sa.Row[Any]]:
    """Which due, unclaimed rows of ``topics`` are past their dedupe window? Those whose first attempt is
    ``window_ms - margin_ms`` or more ago are dead-lettered with ``reason`` (the downstream may have
    forgotten the key, so a resend could be a second effect), in ``conn``'s transaction; returns their
    ``(id, idempotency_key, topic, last_status)``."""
    stmt = (
        sa.update(_t)
        .where(
            due_clause(),
            _t.c.topic.in_(sorted(topics)),
            _t.c.first_attempt_at.is_not(None),
            _t.c.first_attempt_at <= db_now_plus_ms(sa.literal(margin_ms - window_ms, sa.BigInteger())),
        )
        .values(status=_DEAD_TEXT, last_error=reason, **_unclaimed())
        .returning(_t.c.id, _t.c.idempotency_key, _t.c.topic, _t.c.last_status)
    )
    return list(conn.execute(stmt))


def _due_in(topics: Collection[str]) -> sa.Select[Any]:
    """Is a row of ``topics`` due now? (one id, or none)."""
    return sa.select(_t.c.id).where(due_clause(), _t.c.topic.in_(sorted(topics))).limit(1)


def any_due(conn: sa.Connection, topics: Collection[str]) -> bool:
    """Whether a row of ``topics`` is due now."""
    return conn.execute(_due_in(topics)).first() is not None


@functools.lru_cache(maxsize=256)
def _slot_look(group: str, topics: tuple[str, ...]) -> sa.Select[Any]:
    return sa.select(_in_flight_query(group).scalar_subquery(), _due_in(topics).exists())


def look_at_slots(conn: sa.Connection, group: str, topics: Collection[str]) -> tuple[int, bool]:
    """A lock-free look at a limit group: its requests in flight (:func:`_in_flight_query`) and whether a
    row of its ``topics`` is due (the statement built once per group)."""
    in_flight, due = conn.execute(_slot_look(group, tuple(sorted(topics)))).one()
    return int(in_flight), bool(due)


@dataclasses.dataclass(frozen=True)
class SwapShape:
    """What a :func:`swap` statement is built for (one statement per shape, bound per call): the limit
    ``group`` and its ``topics``, this dispatcher's ``max_in_flight`` for it, the claim length, how fresh
    a registration must be, whether it records the finished rows SENT itself and commits asynchronously."""

    group: str
    topics: tuple[str, ...]
    max_in_flight: int
    claim_ms: int
    fresh_ms: int
    record_sent: bool
    async_commit: bool = False


def swap(
    conn: sa.Connection,
    shape: SwapShape,
    *,
    ids: Sequence[int],
    token: str,
    want: int,
    status_code: int | None = None,
) -> SwapResult:
    """Run a swap (:func:`_swap_statement`) on ``conn`` (in its transaction, or alone on an autocommit
    connection) for the finished rows ``ids`` of claim ``token``: up to ``want`` due rows claimed in
    their slots (with ``shape.record_sent``: ``ids`` marked SENT with ``status_code`` by the same
    statement)."""
    params: dict[str, Any] = {"ids": list(ids), "token": token, "want": want}
    if shape.record_sent:
        params["status_code"] = status_code
    return _swap_result(conn.execute(_swap_statement(shape), params).all())


@functools.lru_cache(maxsize=256)
def _swap_statement(shape: SwapShape) -> sa.Select[Any]:
    """A swap (PostgreSQL): how many due rows of ``group`` may take the slots of finished rows ``ids``?
    Claims up to ``want`` due rows of ``topics`` under claim ``token``, never more than the rows of
    ``ids`` that still hold the group's capacity under this claim with at least half a claim left on the
    database clock (read from the statement's snapshot), reading the group's row ``FOR SHARE`` (swaps do
    not wait for each other; a pause or a locked claim being written does wait). Run where those rows'
    outcomes are recorded, it leaves the group's count of requests in flight unchanged (or lower), so a
    counter under the lock sees the same count before and after its commit.

    Only while the group's row says: not paused, no rate in force, a ``max_in_flight`` in force no larger
    than this dispatcher's (``max_in_flight``) and registered for more than ``fresh_ms`` (else the locked
    claim runs, which refreshes it); and no more than that limit leaves beside the group's other requests
    in flight (a lowered limit is reached as requests finish).

    ``record_sent``: the statement also marks ``ids`` SENT with ``status_code``, fenced like
    :func:`mark_sent`, and claims no more rows than it recorded (one autocommit statement: no BEGIN, no
    COMMIT, no group row lock held past it). Without it the caller records the outcomes in the same
    transaction, after the swap, and checks that the claim did not outrun them.

    Half a claim left, not just some: a finished row's slot counts as free for everyone once its claim
    expires, so a swap must commit before that; the margin covers a dispatcher stalled between the
    swap's statement and its commit (or a commit waiting on the disk) for up to ``claim_ms / 2``.

    ``async_commit``: the statement's own transaction commits without waiting for the WAL flush
    (``synchronous_commit = off`` for it alone). Bound per call: ``ids``, ``token``, ``want`` (and
    ``status_code`` with ``record_sent``). Returns rows ``(kind, claim columns..., mif, others)``; read
    them with :func:`_swap_result`."""
    group, topics, max_in_flight, claim_ms = shape.group, shape.topics, shape.max_in_flight, shape.claim_ms
    ids = sa.bindparam("ids", type_=postgresql.ARRAY(sa.BigInteger()))
    token = sa.bindparam("token", type_=sa.String())
    want = sa.bindparam("want", type_=sa.Integer())
    mine_ids = _t.c.id == sa.any_(ids)
    handed = (
        sa.select(_t.c.id)
        .where(
            mine_ids,
            _t.c.claim_token == token,
            _PENDING,
            _t.c.claim_group == group,
            _t.c.claim_expires_at > db_now_plus_ms(sa.literal(claim_ms // 2, sa.BigInteger())),
        )
        .cte("handed")
    )
    others = (
        sa.select(sa.func.count().label("n"))
        .select_from(_t)
        .where(_t.c.claim_group == group, live_claim(), _PENDING, sa.not_(mine_ids))
        .cte("others")
    )
    g = route_group_table
    grp = (
        sa.select(g.c.max_in_flight.label("mif"))
        .where(
            g.c.limit_group == group,
            sa.not_(route_groups.paused()),
            sa.not_(sa.and_(g.c.rate.is_not(None), route_groups.in_force(g.c.rate_until))),
            g.c.max_in_flight.is_not(None),
            g.c.max_in_flight <= max_in_flight,
            route_groups.fresh_for(g.c.max_in_flight_until, shape.fresh_ms),
        )
        .with_for_update(read=True)
        .cte("grp")
    )
    done = None
    if shape.record_sent:
        done = (
            sa.update(_t)
            .where(mine_ids, _t.c.claim_token == token, _PENDING)
            .values(_sent())
            .returning(_t.c.id)
            .cte("done")
        )
        slots = sa.select(sa.func.count()).select_from(done.join(handed, done.c.id == handed.c.id))
    else:
        slots = sa.select(sa.func.count()).select_from(handed)
    mif = sa.select(grp.c.mif).scalar_subquery()
    n_others = sa.select(others.c.n).scalar_subquery()
    limit = sa.func.greatest(
        0,
        sa.func.least(want, slots.scalar_subquery(), sa.func.coalesce(mif, 0) - n_others),
        type_=sa.Integer(),
    )
    claimed = _claim_update("postgresql", limit, claim_ms, tuple(sorted(topics)), group)
    claimed_cte = claimed.values(claim_token=token).cte("claimed")
    columns = list(claimed_cte.c)
    nulls = [sa.cast(sa.null(), c.type) for c in columns]
    no_group = (
        sa.cast(sa.null(), sa.Integer()).label("mif"),
        sa.cast(sa.null(), sa.BigInteger()).label("others"),
    )
    parts = [
        sa.select(sa.literal_column("'claim'", sa.String()).label("kind"), *columns, *no_group).select_from(
            claimed_cte
        )
    ]
    if done is not None:
        parts.append(
            sa.select(sa.literal_column("'done'", sa.String()), done.c.id, *nulls[1:], *no_group).select_from(
                done
            )
        )
    summary = sa.select(sa.literal_column("'group'", sa.String()), *nulls, mif, n_others)
    if shape.async_commit:
        # Set for the statement's own (implicit) transaction, in force at its commit.
        summary = summary.where(
            sa.func.set_config(
                sa.literal_column("'synchronous_commit'"), sa.literal_column("'off'"), sa.true()
            )
            == sa.literal_column("'off'")
        )
    return sa.union_all(*parts, summary)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class SwapResult:
    """What a :func:`swap` did: the rows it claimed (each a claim's columns), the ids it recorded SENT
    (with ``record_sent``), the group's max_in_flight if a swap was allowed (else None) and its other
    requests in flight."""

    claimed: list[tuple[Any, ...]]
    done: set[int]
    max_in_flight: int | None
    others: int


def _swap_result(rows: Sequence[Any]) -> SwapResult:
    """A :func:`swap`'s rows, read."""
    claimed = [tuple(r[1:-2]) for r in rows if r[0] == "claim"]  # between kind and (mif, others)
    done = {int(r[1]) for r in rows if r[0] == "done"}
    summary = next(r for r in rows if r[0] == "group")
    mif = None if summary[-2] is None else int(summary[-2])
    return SwapResult(claimed, done, mif, int(summary[-1]))
