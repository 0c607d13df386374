"""The transactional outbox: record an effect in the same transaction as the domain change that causes it.

A row is written once per idempotency key (``INSERT … ON CONFLICT DO NOTHING``), so re-running the
producer is harmless; the dispatcher (:mod:`dagster_joblease.dispatch`) later delivers it with that key.
Everything that could make a row undeliverable (a payload that is not JSON, too large, a bad topic or key)
is refused here, before anything is written, rather than discovered by the dispatcher.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from dagster_joblease import errors
from dagster_joblease.storage.clock import db_now, ms_until
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import outbox_table
from dagster_joblease.storage.transaction import callers_transaction

if TYPE_CHECKING:
    from sqlalchemy import orm

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_KEY_LENGTH",
    "MAX_TOPIC_LENGTH",
    "DueSummary",
    "OutboxStatus",
    "canonical_json",
    "due_clause",
    "due_summary",
    "enqueue_once",
    "payload_fingerprint",
]

DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
MAX_TOPIC_LENGTH = 128
MAX_KEY_LENGTH = 320
#: C0 and C1 control characters (and DEL): never valid in a key or a topic.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


class OutboxStatus(enum.StrEnum):
    PENDING = "PENDING"  #: waiting for (another) delivery attempt at next_attempt_at
    SENT = "SENT"  #: the downstream answered 2xx
    DEAD = "DEAD"  #: parked: permanent failure or attempts exhausted; requeue deliberately


# The partial index ix_joblease_outbox_due is declared WHERE status = 'PENDING'. PostgreSQL only uses it
# when the query repeats that predicate with a literal (a bound parameter cannot be proven to match once
# psycopg switches to a prepared, generic plan), so the predicate is spelled out as SQL text.
_PENDING_TEXT = sa.literal_column("'PENDING'", sa.String())
_PENDING = outbox_table.c.status == _PENDING_TEXT


def due_clause() -> sa.ColumnElement[bool]:
    """Rows a dispatcher may claim now: pending, due on the database clock, and not claimed (or expired)."""
    t = outbox_table
    return sa.and_(
        _PENDING,
        t.c.next_attempt_at <= db_now(),
        sa.or_(t.c.claim_expires_at.is_(None), t.c.claim_expires_at < db_now()),
    )


#: One encoder for every payload (``json.dumps`` with options builds a new one per call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(payload: Any) -> str:
    """The payload as canonical JSON (sorted keys, compact, UTF-8 text); the basis of its fingerprint.

    Raises :class:`InvalidPayloadError` for values JSON cannot represent faithfully: non-serializable
    objects, NaN and ±Infinity, lone surrogates, and NUL characters (PostgreSQL's jsonb rejects them).
    """
    try:
        text = _CANONICAL.encode(payload)
    except ValueError as exc:  # allow_nan=False, circular references
        raise errors.InvalidPayloadError(
            "payload",
            f"is not valid JSON ({exc}); replace NaN/Infinity with null or a string, and break cycles",
        ) from None
    except TypeError as exc:
        raise errors.InvalidPayloadError(
            "payload",
            f"is not JSON-serializable ({exc}); pass only dict/list/str/int/float/bool/None "
            "(convert dates to ISO strings, Decimals to strings)",
        ) from None
    except RecursionError:
        raise errors.InvalidPayloadError(
            "payload", "is nested too deeply to serialize; keep payloads small and flat"
        ) from None
    if "\\u0000" in text:
        raise errors.InvalidPayloadError(
            "payload", "contains a NUL character (U+0000), which PostgreSQL jsonb cannot store; remove it"
        )
    return text


def _encode(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.InvalidPayloadError(
            "payload", "contains a lone surrogate that is not valid UTF-8; fix the string's encoding"
        ) from None


def payload_fingerprint(payload: Any) -> str:
    """SHA-256 hex digest of :func:`canonical_json` (UTF-8): equal payloads, equal fingerprints."""
    return hashlib.sha256(_encode(canonical_json(payload))).hexdigest()


def _check_text(field: str, value: object, max_length: int, *, ascii_only: bool) -> str:
    if not isinstance(value, str):
        raise errors.InvalidPayloadError(field, f"must be a str, got {type(value).__name__}")
    if not value.strip():
        raise errors.InvalidPayloadError(field, f"{value!r} is blank; give a non-empty value")
    if len(value) > max_length:
        raise errors.InvalidPayloadError(
            field, f"is {len(value)} characters; at most {max_length} are allowed, shorten it"
        )
    control = _CONTROL.search(value)
    if control is not None:
        raise errors.InvalidPayloadError(
            field, f"{value[:40]!r} contains the control character U+{ord(control.group()):04X}; remove it"
        )
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise errors.InvalidPayloadError(
                field,
                f"contains the lone surrogate U+{ord(value[exc.start]):04X}, which is not valid Unicode "
                "text (the database cannot store it); fix the string's encoding",
            ) from None
    if ascii_only:
        if not value.isascii():
            raise errors.InvalidPayloadError(
                field,
                f"{value[:40]!r} is not ASCII; it travels as the Idempotency-Key HTTP header, so use "
                "ASCII (e.g. a key from idempotency_key() or effect_key())",
            )
        if value != value.strip():
            raise errors.InvalidPayloadError(
                field,
                f"{value[:40]!r} has surrounding whitespace, which HTTP strips from header values; trim it",
            )
    return value


def _check_max_bytes(max_payload_bytes: object) -> int:
    if isinstance(max_payload_bytes, bool) or not isinstance(max_payload_bytes, int) or max_payload_bytes < 2:
        raise errors.InvalidPayloadError(
            "max_payload_bytes", f"{max_payload_bytes!r} must be an int >= 2 (bytes of canonical JSON)"
        )
    return max_payload_bytes


@functools.cache
def _insert_statement(dialect_name: str) -> Any:
    """The enqueue INSERT, built once per dialect with bound parameters (its compiled form is cached too)."""
    t = outbox_table
    # Bind the canonical text as-is instead of letting the JSON type encode the payload a second time.
    payload: sa.ColumnElement[Any] = sa.bindparam("payload_text", type_=sa.Text())
    if dialect_name == "postgresql":
        payload = sa.cast(payload, postgresql.JSONB())
    insert = (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(t)
    return (
        insert.values(
            idempotency_key=sa.bindparam("key", type_=sa.String()),
            topic=sa.bindparam("topic", type_=sa.String()),
            payload=payload,
            payload_sha256=sa.bindparam("sha256", type_=sa.String()),
            status=_PENDING_TEXT,
            attempts=sa.literal_column("0", sa.Integer()),
            next_attempt_at=db_now(),
            created_at=db_now(),
            updated_at=db_now(),
        )
        .on_conflict_do_nothing(index_elements=[t.c.idempotency_key])
        .returning(t.c.id)
    )


_EXISTING = sa.select(outbox_table.c.payload_sha256, outbox_table.c.topic).where(
    outbox_table.c.idempotency_key == sa.bindparam("key", type_=sa.String())
)
_PARAMS = ("key", "topic", "payload_text", "sha256")


@functools.cache
def _psycopg_sql() -> tuple[str, str]:
    """The INSERT (positional ``%s`` parameters in the order of ``_PARAMS``) and the read of an existing
    row, compiled once by SQLAlchemy for psycopg.

    Compiled for a fresh psycopg dialect, not each engine's, so the cache holds one entry.
    """
    dialect = psycopg_dialect.dialect(paramstyle="format")  # type: ignore[no-untyped-call]
    compiled = _insert_statement("postgresql").compile(dialect=dialect)
    assert compiled.positiontup == list(_PARAMS), compiled.positiontup
    return str(compiled), str(_EXISTING.compile(dialect=dialect))


_Existing = tuple[str, str] | None
_Params = tuple[str, str, str, str]  #: key, topic, payload_text, sha256 (the order of _PARAMS)


def _run_psycopg(driver: psycopg.Connection[Any], params: _Params) -> tuple[bool, _Existing]:
    """The enqueue on the caller's own psycopg connection (so inside its transaction), as a prepared
    statement without SQLAlchemy's per-execution work, which cost as much as the INSERT's round trip."""
    insert_sql, existing_sql = _psycopg_sql()
    with translate_errors("enqueue an outbox row"), driver.cursor() as cursor:
        cursor.execute(insert_sql, params, prepare=True)
        if cursor.fetchone() is not None:
            return True, None
        cursor.execute(existing_sql, (params[0],), prepare=True)
        row = cursor.fetchone()
        return False, None if row is None else (row[0], row[1])


def _run_generic(connection: sa.Connection, params: _Params) -> tuple[bool, _Existing]:
    with translate_errors("enqueue an outbox row"):
        named = dict(zip(_PARAMS, params, strict=True))
        if connection.execute(_insert_statement(connection.dialect.name), named).first() is not None:
            return True, None
        row = connection.execute(_EXISTING, {"key": params[0]}).first()
        return False, None if row is None else (row[0], row[1])


def enqueue_once(
    connection: sa.Connection | psycopg.Connection[Any] | orm.Session,
    *,
    idempotency_key: str,
    topic: str,
    payload: Any,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> bool:
    """Add a pending outbox row inside the caller's transaction; True if inserted, False if already there.

    Call it on the connection that holds the domain change, so both commit (or roll back) together: a
    SQLAlchemy ``Connection`` (PostgreSQL or SQLite; in ``engine.begin()``, or from ``engine.connect()``
    followed by ``conn.commit()``), an ORM ``Session`` (``session.commit()`` commits the row) or, on
    PostgreSQL, a plain psycopg 3 ``Connection`` (which skips SQLAlchemy's per-transaction work
    altogether). A connection on which the row would commit on its own (autocommit outside a transaction
    block) is refused; :func:`dagster_joblease.storage.transaction.callers_transaction` is the rule. A
    repeat with the same key, topic and payload is a no-op (returns False); the same key with a different
    payload *or another topic* raises :class:`OutboxConflictError`. The key alone is the effect's
    identity downstream (the receiver deduplicates on ``Idempotency-Key``), so a second row under one key
    could never be delivered as a second effect: it would be swallowed as a replay. Invalid input raises
    :class:`InvalidPayloadError` before any SQL is sent.

    Example::

        with engine.begin() as conn:
            conn.execute(invoices.insert().values(...))
            enqueue_once(conn, idempotency_key=effect_key(lease.idempotency_key, "invoice-mail"),
                         topic="mail", payload={"v": 1, "invoice": 42})

        with psycopg.connect(dsn) as pg, pg.transaction():  # or on your own psycopg connection
            pg.execute("INSERT INTO invoices …")
            enqueue_once(pg, idempotency_key=…, topic="mail", payload={"v": 1, "invoice": 42})
    """
    target = callers_transaction(connection, clause=outbox_table)
    driver = target.driver
    _check_text("idempotency_key", idempotency_key, MAX_KEY_LENGTH, ascii_only=True)
    _check_text("topic", topic, MAX_TOPIC_LENGTH, ascii_only=False)
    limit = _check_max_bytes(max_payload_bytes)
    text = canonical_json(payload)
    data = _encode(text)
    if len(data) > limit:
        raise errors.InvalidPayloadError(
            "payload",
            f"is {len(data)} bytes of canonical JSON; at most {limit} are allowed. Keep payloads minimal "
            "(send ids, let the consumer fetch the rest) or raise max_payload_bytes",
        )
    fingerprint = hashlib.sha256(data).hexdigest()
    params = (idempotency_key, topic, text, fingerprint)
    # Two rounds: a conflicting row can vanish between the INSERT and the read (a concurrent purge or a
    # rolled-back writer); the second INSERT then simply succeeds.
    for _ in range(2):
        if driver is not None:
            inserted, existing = _run_psycopg(driver, params)
        else:
            assert target.connection is not None
            inserted, existing = _run_generic(target.connection, params)
        if inserted:
            return True
        if existing is None:
            continue
        existing_sha256, existing_topic = existing
        if existing_sha256 == fingerprint and existing_topic == topic:
            return False
        raise errors.OutboxConflictError(
            idempotency_key=idempotency_key,
            existing_sha256=existing_sha256,
            new_sha256=fingerprint,
            existing_topic=existing_topic,
            new_topic=topic,
        )
    raise errors.StorageError(
        f"outbox key {idempotency_key!r} conflicted but could not be read back twice; retry the transaction"
    )


@dataclasses.dataclass(frozen=True)
class DueSummary:
    """How much is waiting: rows a dispatcher could claim now, how long the oldest has waited, and how many
    pending rows already failed at least once (due now or waiting out a backoff, not in flight)."""

    due: int
    oldest_due_age_ms: int | None
    retrying: int = 0


def _check_topics(topics: object) -> list[str] | None:
    if topics is None:
        return None
    if isinstance(topics, str | bytes) or not isinstance(topics, Collection):
        raise errors.ConfigurationError(
            f"topics={topics!r} must be a collection of topic names (e.g. a list or set), or None for all"
        )
    names = sorted(set(topics))
    for name in names:
        if not isinstance(name, str):
            raise errors.ConfigurationError(f"topics must hold str topic names, got {name!r}")
    return names


def due_summary(
    engine_or_connection: sa.Engine | sa.Connection, *, topics: Collection[str] | None = None
) -> DueSummary:
    """Count due rows, the age of the oldest and the retrying rows, in one query over pending rows only
    (the partial index of pending rows, or the status/topic index when ``topics`` narrows it).

    ``topics`` limits the summary to those topics (a dispatcher's routed topics); ``None`` means all.
    """
    names = _check_topics(topics)
    if names == []:
        return DueSummary(due=0, oldest_due_age_ms=None, retrying=0)
    t = outbox_table
    due = sa.and_(
        t.c.next_attempt_at <= db_now(),
        sa.or_(t.c.claim_expires_at.is_(None), t.c.claim_expires_at < db_now()),
    )
    not_in_flight = sa.or_(t.c.claim_expires_at.is_(None), t.c.claim_expires_at < db_now())
    stmt = (
        sa.select(
            sa.func.count().filter(due),
            -ms_until(sa.func.min(t.c.next_attempt_at).filter(due)),
            sa.func.count().filter(sa.and_(t.c.attempts > 0, not_in_flight)),
        )
        .select_from(t)
        .where(_PENDING)
    )
    if names is not None:
        stmt = stmt.where(t.c.topic.in_(names))
    with translate_errors("summarize the outbox"):
        if isinstance(engine_or_connection, sa.Engine):
            with engine_or_connection.connect() as conn:
                row = conn.execute(stmt).one()
        else:
            row = engine_or_connection.execute(stmt).one()
    count, age, retrying = row
    return DueSummary(
        due=int(count),
        oldest_due_age_ms=None if age is None else max(0, int(age)),
        retrying=int(retrying),
    )


@dataclasses.dataclass(frozen=True)
class DeliveryHealth:
    """What a location's delivery checks look at, on the database clock.

    ``due``/``oldest_due_age_ms``/``retrying``: as :func:`due_summary` counts them for the routed topics.
    ``dead``: routed rows parked DEAD. ``unrouted``: pending rows of topics this location does not route
    that are older than the threshold (another location should deliver them; if none does, they would
    otherwise sit unseen).
    """

    due: int
    oldest_due_age_ms: int | None
    retrying: int
    dead: int
    unrouted: int
    oldest_unrouted_age_ms: int | None
    unrouted_topics: tuple[str, ...]


def delivery_health(
    engine_or_connection: sa.Engine | sa.Connection,
    *,
    topics: Collection[str] | None = None,
    unrouted_after_ms: int = 15 * 60_000,
) -> DeliveryHealth:
    """Summarize delivery for ``topics`` (``None``: every topic) in a few indexed queries.

    Pending rows are read through the partial index of pending rows; dead rows through the
    ``(status, topic)`` index. All ages come from the database clock.
    """
    import contextlib

    from dagster_joblease.storage.clock import db_now_plus_ms

    scoped = _check_topics(topics)
    if isinstance(unrouted_after_ms, bool) or not isinstance(unrouted_after_ms, int) or unrouted_after_ms < 0:
        raise errors.ConfigurationError(
            f"unrouted_after_ms={unrouted_after_ms!r} must be an int >= 0 (milliseconds)"
        )
    t = outbox_table
    routed: sa.ColumnElement[bool] = sa.true() if scoped is None else t.c.topic.in_(scoped)
    dead_stmt = (
        sa.select(sa.func.count()).select_from(t).where(t.c.status == sa.literal_column("'DEAD'"), routed)
    )
    with translate_errors("summarize outbox delivery health"), contextlib.ExitStack() as stack:
        if isinstance(engine_or_connection, sa.Engine):
            conn = stack.enter_context(engine_or_connection.connect())
        else:
            conn = engine_or_connection
        summary = due_summary(conn, topics=scoped)
        dead = int(conn.execute(dead_stmt).scalar_one())
        unrouted, unrouted_age, unrouted_topics = 0, None, ()
        if scoped is not None:
            old = sa.and_(
                _PENDING,
                t.c.topic.not_in(scoped),
                t.c.created_at < db_now_plus_ms(sa.literal(-unrouted_after_ms, sa.BigInteger())),
            )
            unrouted, unrouted_age = conn.execute(
                sa.select(sa.func.count(), -ms_until(sa.func.min(t.c.created_at))).select_from(t).where(old)
            ).one()
            if unrouted:
                unrouted_topics = tuple(
                    conn.execute(sa.select(t.c.topic).where(old).distinct().order_by(t.c.topic).limit(20))
                    .scalars()
                    .all()
                )
    return DeliveryHealth(
        due=summary.due,
        oldest_due_age_ms=summary.oldest_due_age_ms,
        retrying=summary.retrying,
        dead=dead,
        unrouted=int(unrouted),
        oldest_unrouted_age_ms=None if unrouted_age is None else max(0, int(unrouted_age)),
        unrouted_topics=unrouted_topics,
    )
