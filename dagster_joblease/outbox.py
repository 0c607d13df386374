"""The transactional outbox: record an effect in the same transaction as the domain change that causes it.

A row is written once per idempotency key (``INSERT … ON CONFLICT DO NOTHING``), so re-running the
producer is harmless; the dispatcher (:mod:`dagster_joblease.dispatch`) later delivers it with that key.
Everything that could make a row undeliverable (a payload that is not JSON, too large, a bad topic or key)
is refused here, before anything is written, rather than discovered by the dispatcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
import sqlalchemy as sa

from dagster_joblease import checks, errors, tracing
from dagster_joblease.storage import driver, route_groups, rowset
from dagster_joblease.storage import outbox as store
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import outbox_table
from dagster_joblease.storage.transaction import callers_transaction

if TYPE_CHECKING:
    from sqlalchemy import orm

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_KEY_LENGTH",
    "MAX_ORDERING_KEY_LENGTH",
    "MAX_TOPIC_LENGTH",
    "DueSummary",
    "GroupPause",
    "OutboxItem",
    "OutboxStatus",
    "canonical_json",
    "check_ordering_key",
    "due_summary",
    "enqueue_many",
    "enqueue_once",
    "paused_groups",
    "unrouted_due",
    "payload_fingerprint",
]

DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
MAX_TOPIC_LENGTH = 128
MAX_KEY_LENGTH = 320
#: The longest ordering key (characters; the column is VARCHAR(128)).
MAX_ORDERING_KEY_LENGTH = 128
#: C0 and C1 control characters (and DEL): never valid in a key or a topic.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


class OutboxStatus(enum.StrEnum):
    PENDING = "PENDING"  #: waiting for (another) delivery attempt at next_attempt_at
    SENT = "SENT"  #: the downstream answered 2xx
    DEAD = "DEAD"  #: parked: permanent failure or attempts exhausted; requeue deliberately
    SKIPPED = (
        "SKIPPED"  #: a person decided this row is never sent (``joblease outbox skip``); requeue undoes it
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
    if (
        type(value) is str
        and 0 < len(value) <= max_length
        and value.isascii()
        and value.isprintable()  # printable ASCII: no control character, and space is its only blank
        and value[0] != " "
        and value[-1] != " "
    ):
        return value  # the common key or topic: every rule below holds
    if not isinstance(value, str):
        raise errors.InvalidPayloadError(field, f"must be a str, got {type(value).__name__}")
    refusal = text_refusal(value, max_length, ascii_only=ascii_only)
    if refusal is not None:
        raise errors.InvalidPayloadError(field, refusal)
    return value


def text_refusal(value: str, max_length: int, *, ascii_only: bool) -> str | None:
    """What is wrong with a key or topic, and what to do (None: nothing). Blank, too long, a control
    character, a lone surrogate; with ``ascii_only`` (it travels as an HTTP header), not ASCII or
    surrounding whitespace."""
    if not value.strip():
        return f"{value!r} is blank; give a non-empty value"
    if len(value) > max_length:
        return f"is {len(value)} characters; at most {max_length} are allowed, shorten it"
    control = _CONTROL.search(value)
    if control is not None:
        return f"{value[:40]!r} contains the control character U+{ord(control.group()):04X}; remove it"
    if value.isascii():
        return _header_refusal(value) if ascii_only else None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"contains the lone surrogate U+{ord(value[exc.start]):04X}, which is not valid Unicode "
            "text (the database cannot store it); fix the string's encoding"
        )
    if ascii_only:
        return (
            f"{value[:40]!r} is not ASCII; it travels as the Idempotency-Key HTTP header, so use "
            "ASCII (e.g. a key from idempotency_key() or effect_key())"
        )
    return None


def _header_refusal(value: str) -> str | None:
    if value != value.strip():
        return f"{value[:40]!r} has surrounding whitespace, which HTTP strips from header values; trim it"
    return None


def check_ordering_key(value: object) -> str | None:
    """``value`` if it is a valid ordering key (or None: no ordering), else
    :class:`~dagster_joblease.errors.InvalidOrderingKeyError` saying what is allowed: a str of 1 to
    :data:`MAX_ORDERING_KEY_LENGTH` characters, none of them a control character (NUL included), without
    leading or trailing whitespace and not a lone surrogate."""
    if value is None:
        return None
    allowed = (
        f"an ordering key is a str of 1 to {MAX_ORDERING_KEY_LENGTH} characters without control characters "
        "(NUL included) or surrounding whitespace, e.g. 'customer-42'; or None for no ordering"
    )
    try:
        _check_text("ordering_key", value, MAX_ORDERING_KEY_LENGTH, ascii_only=False)
    except errors.InvalidPayloadError as exc:
        raise errors.InvalidOrderingKeyError("ordering_key", f"{exc.rule}; {allowed}") from None
    assert isinstance(value, str)
    if value != value.strip():
        raise errors.InvalidOrderingKeyError(
            "ordering_key", f"{value[:40]!r} has surrounding whitespace; {allowed}"
        )
    return value


def check_max_bytes(max_payload_bytes: object) -> int:
    return checks.integer(
        "max_payload_bytes", max_payload_bytes, minimum=2, why="bytes of canonical JSON", error=checks.payload
    )


_Params = tuple[str, str, str, str]  #: key, topic, payload_text, sha256
_Row = tuple[str, str, str, str, str | None]  #: key, topic, payload_text, sha256, ordering_key


class _ReadBackFailed(errors.StorageError):
    """A key conflicted, yet its row could not be read in two rounds (it kept vanishing): retryable."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"outbox key {key!r} conflicted but could not be read back twice; retry the transaction"
        )


def enqueue_once(
    connection: sa.Connection | psycopg.Connection[Any] | orm.Session,
    *,
    idempotency_key: str,
    topic: str,
    payload: Any,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    max_pending: int | None = None,
    ordering_key: str | None = None,
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

    ``max_pending`` (optional backlog bound): when the topic already has this many PENDING rows, raise
    the retryable :class:`OutboxBackpressureError` and write nothing (a repeat of a row already there
    still returns False). The count (at most ``max_pending`` rows read) runs only when the argument is
    given. The bound is soft under concurrent writers: at READ COMMITTED two transactions can both see
    N-1 pending rows and both insert, so the backlog can pass N by the number of concurrent producers.

    ``ordering_key`` (optional, e.g. ``"customer-42"``): rows with the same ordering key are delivered one
    at a time, in the order they were enqueued (their commit order), by every dispatcher together; rows of
    other keys, and rows without one, flow past them. A row of the key that is retrying holds the key's
    later rows back, and a DEAD one blocks them until a person requeues or skips it (``joblease outbox
    requeue ID`` / ``skip ID``). On PostgreSQL the enqueue takes a transaction-scoped advisory lock on the
    key (``pg_advisory_xact_lock``, so it works behind PgBouncer in transaction mode): a second
    transaction enqueueing the same key waits until this one ends, so a key's rows get ids in commit
    order. Hold such a transaction briefly. An invalid key raises :class:`InvalidOrderingKeyError`
    (:func:`check_ordering_key` says what is allowed); a repeat of a row under another ordering key raises
    :class:`OutboxConflictError`.

    Trace context: when an OpenTelemetry span is active, the enqueue opens a ``create {topic}`` span and
    the same INSERT writes its W3C ``traceparent`` / ``tracestate`` with the row
    (:mod:`dagster_joblease.tracing`); otherwise the row has none.

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
    key, _topic, text, fingerprint = prepare_row(
        idempotency_key, topic, payload, check_max_bytes(max_payload_bytes)
    )
    ordering = check_ordering_key(ordering_key)
    db = driver.in_transaction(target)
    if max_pending is not None:
        with translate_errors("count pending outbox rows"):
            _check_backlog(db, key, topic, _check_max_pending(max_pending))
    with (
        translate_errors("enqueue an outbox row"),
        tracing.creating(topic, idempotency_key=key) as traced,
    ):
        if ordering is not None:
            store.lock_ordering_keys(db, [ordering])
        # Two rounds: a conflicting row can vanish between the INSERT and the read (a concurrent purge or
        # a rolled-back writer); the second INSERT then simply succeeds.
        for _ in range(2):
            if store.insert_pending(db, key, topic, text, fingerprint, ordering, traced):
                return True
            found = store.existing(db, key)
            if found is None:
                continue
            if found == (fingerprint, topic, ordering):
                return False
            raise _conflict(key, found, (fingerprint, topic, ordering))
    raise _ReadBackFailed(key)


def _conflict(key: str, found: tuple[str, str, str | None], new: tuple[str, str, str | None]) -> Exception:
    """The :class:`OutboxConflictError` of a row under ``key`` holding ``found`` (fingerprint, topic,
    ordering key) where ``new`` was enqueued."""
    return errors.OutboxConflictError(
        idempotency_key=key,
        existing_sha256=found[0],
        new_sha256=new[0],
        existing_topic=found[1],
        new_topic=new[1],
        existing_ordering_key=found[2],
        new_ordering_key=new[2],
    )


def _check_max_pending(value: object) -> int:
    return checks.integer(
        "max_pending",
        value,
        minimum=1,
        none="no bound",
        why="pending rows of the topic",
        error=checks.payload,
    )


def _check_backlog(db: driver.Statements, key: str, topic: str, max_pending: int) -> None:
    """Raise :class:`OutboxBackpressureError` when the topic has ``max_pending`` pending rows, unless this
    very row is already there (a repeat stays a no-op)."""
    pending = store.pending_count(db, topic, max_pending)
    if pending >= max_pending and store.existing(db, key) is None:
        raise errors.OutboxBackpressureError(topic=topic, pending=pending, max_pending=max_pending)


# -- enqueue_many: one multi-row statement for a set of rows ----------------------------------------------


class OutboxItem(NamedTuple):
    """One row for :func:`enqueue_many` (a plain ``(idempotency_key, topic, payload)`` or
    ``(idempotency_key, topic, payload, ordering_key)`` tuple works too)."""

    idempotency_key: str
    topic: str
    payload: Any
    #: Rows with the same ordering key are delivered one at a time, in enqueue order (see enqueue_once).
    ordering_key: str | None = None


def prepare_row(idempotency_key: object, topic: object, payload: Any, limit: int) -> _Params:
    """Validate one outbox row (key, topic, payload of at most ``limit`` bytes); its parameters (key,
    topic, canonical text, sha256). :func:`enqueue_once` and :func:`enqueue_many` share it."""
    _check_text("idempotency_key", idempotency_key, MAX_KEY_LENGTH, ascii_only=True)
    _check_text("topic", topic, MAX_TOPIC_LENGTH, ascii_only=False)
    assert isinstance(idempotency_key, str) and isinstance(topic, str)
    text = canonical_json(payload)
    data = _encode(text)
    if len(data) > limit:
        raise errors.InvalidPayloadError(
            "payload",
            f"is {len(data)} bytes of canonical JSON; at most {limit} are allowed. Keep payloads minimal "
            "(send ids, let the consumer fetch the rest) or raise max_payload_bytes",
        )
    return (idempotency_key, topic, text, hashlib.sha256(data).hexdigest())


def _check_items(items: object, limit: int) -> list[_Row]:
    if isinstance(items, str | bytes | dict) or not isinstance(items, Iterable):
        raise errors.InvalidPayloadError(
            "rows", "must be a list (or another iterable) of OutboxItem(idempotency_key, topic, payload)"
        )
    prepared: list[_Row] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        if len(prepared) >= rowset.MAX_ROWS:
            raise errors.InvalidPayloadError(
                "rows", f"hold more than {rowset.MAX_ROWS} rows; at most that many per call, split the set"
            )
        if not isinstance(item, tuple) or len(item) not in (3, 4):
            raise errors.InvalidPayloadError(
                f"row {index}",
                "must be an OutboxItem(idempotency_key, topic, payload[, ordering_key]) or a 3- or 4-tuple, "
                f"got {type(item).__name__}",
            )
        key, topic, payload, *rest = item
        try:
            row = (*prepare_row(key, topic, payload, limit), check_ordering_key(rest[0] if rest else None))
        except errors.InvalidPayloadError as exc:
            raise type(exc)(f"{exc.field} of row {index} (key {key!r:.60})", exc.rule) from None
        if row[0] in seen:
            raise errors.InvalidPayloadError(
                f"row {index}", f"repeats the idempotency key {row[0]!r}; one key is one effect, pass it once"
            )
        seen.add(row[0])
        prepared.append(row)
    if not prepared:
        raise errors.InvalidPayloadError("rows", "is empty; pass at least one row")
    return prepared


def enqueue_many(
    connection: sa.Connection | psycopg.Connection[Any] | orm.Session,
    rows: Iterable[OutboxItem | tuple[str, str, Any]],
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> tuple[bool, ...]:
    """Add one pending outbox row per item inside the caller's transaction, with one multi-row statement.

    Per row, the result (in the given order) is True if inserted, False if the same key was already
    there with the same topic and payload: :func:`enqueue_once`'s rules, for a set. The connection
    styles and the refusal of a connection that would commit on its own are :func:`enqueue_once`'s
    (one rule: :func:`dagster_joblease.storage.transaction.callers_transaction`).
    Every row is validated as :func:`enqueue_once` validates one (errors name the row's index and key)
    before any SQL is sent; a key repeated within the call is refused too. If any key already holds
    another payload or topic, :class:`OutboxConflictError` names it (the first in key order) and the
    call writes nothing (rows it had inserted are taken back in the same transaction). At most
    :data:`~dagster_joblease.storage.rowset.MAX_ROWS` rows per call; rows are written in key order.

    Statements: one ``INSERT … SELECT … ON CONFLICT DO NOTHING RETURNING`` per 10,000 rows; a read of
    the rows that were already there only when some were.

    Ordering keys (``OutboxItem(..., ordering_key="customer-42")``): rows of one ordering key are
    enqueued in the list's order, and delivered in it (see :func:`enqueue_once`). On PostgreSQL the call
    first takes each distinct ordering key's advisory lock (in key order), or, for more than
    :data:`~dagster_joblease.storage.outbox.MAX_KEY_LOCKS` keys, one lock over every key (which waits for
    the keyed enqueues in progress and holds the others back until this transaction ends); the set is then
    written ordered by ordering key and, within a key, by list position (rows without one by idempotency
    key).

    Trace context: when an OpenTelemetry span is active, the call opens one ``create {topic}`` span per
    row (children of the active span) and writes each row's own W3C ``traceparent`` / ``tracestate`` in
    the INSERT, so the dispatcher's send span of a row links to that row's creation alone
    (:mod:`dagster_joblease.tracing`); otherwise the rows have none.

    Example, one outbox row per day of a range, in the transaction that bills the range::

        with fenced_transaction_many(service, claim.leases) as conn:
            conn.execute(...)
            enqueue_many(conn, [OutboxItem(x.idempotency_key, "billing", {"day": x.identity.run_key})
                                for x in claim.leases])
    """
    target = callers_transaction(connection, clause=outbox_table)
    limit = check_max_bytes(max_payload_bytes)
    prepared = _check_items(rows, limit)
    db = driver.in_transaction(target)
    ordering_keys = sorted({row[4] for row in prepared if row[4] is not None})
    ordered = _insert_order(prepared) if ordering_keys else sorted(prepared, key=lambda row: row[0])
    inserted: set[str] = set()
    with translate_errors("enqueue outbox rows"):
        try:
            store.lock_ordering_keys(db, ordering_keys)
            for start in range(0, len(ordered), rowset.ROWS_PER_STATEMENT):
                chunk = ordered[start : start + rowset.ROWS_PER_STATEMENT]
                # One create span per row around its statement (so at most one statement's rows' spans
                # are held open); each row stores its own span's context. None: no span is active.
                with tracing.creating_each([(row[1], row[0]) for row in chunk]) as contexts:
                    traced = (
                        None if contexts is None else dict(zip((r[0] for r in chunk), contexts, strict=True))
                    )
                    _enqueue_chunk(db, chunk, inserted, traced)
        except (errors.OutboxConflictError, _ReadBackFailed):
            if inserted:  # take back what this call inserted: it writes all of its rows or none
                store.take_back(db, sorted(inserted))
            raise
    return tuple(row[0] in inserted for row in prepared)


def _insert_order(rows: list[_Row]) -> list[_Row]:
    """The order a set with ordering keys is written in: rows without one by idempotency key, then each
    ordering key's rows (keys in order) in the list's order, so that their ids follow the list."""
    position = {row[0]: index for index, row in enumerate(rows)}
    return sorted(rows, key=lambda r: (0, r[0], 0) if r[4] is None else (1, r[4], position[r[0]]))


def _enqueue_chunk(
    db: driver.Statements,
    chunk: list[_Row],
    inserted: set[str],
    traced: Mapping[str, tracing.TraceContext] | None,
) -> None:
    pending = chunk
    keyed = any(row[4] is not None for row in chunk)
    # Two rounds, as enqueue_once: a conflicting row can vanish between the INSERT and the read.
    for _ in range(2):
        traces = None if traced is None else [traced[row[0]] for row in pending]
        if keyed:
            inserted.update(store.insert_many_keyed(db, pending, traces))
        else:
            inserted.update(store.insert_many(db, [row[:4] for row in pending], traces))
        met = [row for row in pending if row[0] not in inserted]
        if not met:
            return
        found = store.existing_many(db, [row[0] for row in met])
        vanished = []
        for row in met:
            key, topic, _text, fingerprint, ordering = row
            if key not in found:
                vanished.append(row)
                continue
            if found[key] != (fingerprint, topic, ordering):
                raise _conflict(key, found[key], (fingerprint, topic, ordering))
        if not vanished:
            return
        pending = _insert_again(db, chunk, vanished, inserted)
    raise _ReadBackFailed(pending[0][0])


def _insert_again(
    db: driver.Statements, chunk: list[_Row], vanished: list[_Row], inserted: set[str]
) -> list[_Row]:
    """The rows of ``chunk`` (in its order) to insert again once the rows met under ``vanished`` keys were
    deleted between the INSERT and the read-back (a purge): those, and the rows of their ordering keys that
    this call inserted after them, taken back first so that a key's ids follow the list again (else the
    vanished row would go after the rows it precedes)."""
    position = {row[0]: index for index, row in enumerate(chunk)}
    first: dict[str, int] = {}
    for row in vanished:
        if row[4] is not None:
            first[row[4]] = min(first.get(row[4], len(chunk)), position[row[0]])
    later = [
        row[0]
        for index, row in enumerate(chunk)
        if row[4] in first and index > first[row[4]] and row[0] in inserted
    ]
    if later:
        store.take_back(db, sorted(later))
        inserted.difference_update(later)
    again = {row[0] for row in vanished}.union(later)
    return [row for row in chunk if row[0] in again]


@dataclasses.dataclass(frozen=True)
class DueSummary:
    """How much is waiting: rows a dispatcher could claim now, how long the oldest has waited, and how many
    pending rows already failed at least once (due now or waiting out a backoff, not in flight)."""

    due: int
    oldest_due_age_ms: int | None
    retrying: int = 0
    #: Due rows not counted in ``due`` because their limit group is paused (see ``pauses``).
    paused_due: int = 0
    pauses: tuple[GroupPause, ...] = ()


@dataclasses.dataclass(frozen=True)
class GroupPause:
    """A limit group paused now (a downstream's Retry-After, or repeated connection failures)."""

    limit_group: str
    paused_until: str  #: ISO 8601, UTC
    remaining_ms: int
    reason: str
    topics: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"limit group {self.limit_group} (topics {', '.join(self.topics)}) is paused for another "
            f"{self.remaining_ms / 1000:.1f} s, until {self.paused_until}: {self.reason}"
        )


def paused_groups(conn: sa.Connection, topic_groups: Mapping[str, str]) -> tuple[GroupPause, ...]:
    """The groups of ``topic_groups`` (topic → limit group) paused now, on the database clock."""
    if not topic_groups:
        return ()
    states = route_groups.read_states(conn, set(topic_groups.values()))
    pauses = []
    for name, state in states.items():
        if state.paused and state.paused_until is not None:
            pauses.append(
                GroupPause(
                    limit_group=name,
                    paused_until=state.paused_until.isoformat(),
                    remaining_ms=state.pause_remaining_ms,
                    reason=state.pause_reason or "",
                    topics=tuple(sorted(t for t, g in topic_groups.items() if g == name)),
                )
            )
    return tuple(pauses)


def _check_groups(groups: object) -> dict[str, str] | None:
    if groups is None:
        return None
    if not isinstance(groups, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in groups.items()
    ):
        raise errors.ConfigurationError(
            f"groups={groups!r} must map topic names to limit group names (e.g. {{t: r.limit_group for t, r "
            "in routes.items()}}), or be None"
        )
    return dict(groups)


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
    engine_or_connection: sa.Engine | sa.Connection,
    *,
    topics: Collection[str] | None = None,
    groups: Mapping[str, str] | None = None,
) -> DueSummary:
    """Count due rows, the age of the oldest and the retrying rows, in one query over pending rows only
    (the partial index of pending rows, ``topics`` filtering them).

    ``topics`` limits the summary to those topics (a dispatcher's routed topics); ``None`` means all.
    ``groups`` (topic → limit group, e.g. ``{t: r.limit_group for t, r in routes.items()}``) leaves out
    rows of groups paused now: they are counted in ``paused_due`` instead, and ``pauses`` says why and
    until when (one more read of the small group table; a second count only while a group is paused).
    """
    names = _check_topics(topics)
    topic_groups = _check_groups(groups)
    if names == []:
        return DueSummary(due=0, oldest_due_age_ms=None, retrying=0)
    with translate_errors("summarize the outbox"), _connection(engine_or_connection) as conn:
        pauses = paused_groups(conn, topic_groups) if topic_groups else ()
        paused_topics = sorted({t for p in pauses for t in p.topics})
        if paused_topics:
            summary = _due_summary(conn, names, exclude=paused_topics)
            paused_due = _due_summary(conn, paused_topics).due
            return dataclasses.replace(summary, paused_due=paused_due, pauses=pauses)
        return _due_summary(conn, names)


def _due_summary(conn: sa.Connection, names: list[str] | None, exclude: Sequence[str] = ()) -> DueSummary:
    """The due summary over ``names`` (None: every topic) less the ``exclude`` topics."""
    count, age, retrying = store.due_counts(conn, names, exclude)
    return DueSummary(
        due=count,
        oldest_due_age_ms=None if age is None else max(0, age),
        retrying=retrying,
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
    #: As in :class:`DueSummary`: due rows of paused groups (left out of ``due``) and the pauses.
    paused_due: int = 0
    pauses: tuple[GroupPause, ...] = ()


def delivery_health(
    engine_or_connection: sa.Engine | sa.Connection,
    *,
    topics: Collection[str] | None = None,
    unrouted_after_ms: int = 15 * 60_000,
    groups: Mapping[str, str] | None = None,
) -> DeliveryHealth:
    """Summarize delivery for ``topics`` (``None``: every topic) in a few indexed queries; ``groups``
    (topic → limit group) leaves paused groups' rows out of ``due``, as :func:`due_summary` does.

    Pending rows are read through the partial index of pending rows; dead rows through the partial
    index of dead rows. All ages come from the database clock.
    """

    scoped = _check_topics(topics)
    checks.milliseconds("unrouted_after_ms", unrouted_after_ms)
    with translate_errors("summarize outbox delivery health"), _connection(engine_or_connection) as conn:
        summary = due_summary(conn, topics=scoped, groups=groups)
        dead = store.dead_count(conn, scoped)
        unrouted: int = 0
        unrouted_age: int | None = None
        unrouted_topics: tuple[str, ...] = ()
        if scoped is not None:
            unrouted, unrouted_age = store.unrouted_backlog(conn, scoped, unrouted_after_ms)
            if unrouted:
                unrouted_topics = tuple(store.unrouted_topics(conn, scoped, unrouted_after_ms, 20))
    return DeliveryHealth(
        due=summary.due,
        oldest_due_age_ms=summary.oldest_due_age_ms,
        retrying=summary.retrying,
        dead=dead,
        unrouted=unrouted,
        oldest_unrouted_age_ms=None if unrouted_age is None else max(0, unrouted_age),
        unrouted_topics=unrouted_topics,
        paused_due=summary.paused_due,
        pauses=summary.pauses,
    )


def unrouted_due(
    engine_or_connection: sa.Engine | sa.Connection, *, topics: Collection[str]
) -> tuple[int, dict[str, int]]:
    """Due rows of topics *not* in ``topics`` (another location's, or nobody's): the total and the count
    per topic (at most 20 topics named). One query over the partial index of pending rows."""
    scoped = _check_topics(topics) or []
    with translate_errors("count unrouted due outbox rows"), _connection(engine_or_connection) as conn:
        counts = store.due_by_topic(conn, not_in=scoped)
    return sum(counts.values()), dict(list(counts.items())[:20])


@contextlib.contextmanager
def _connection(engine_or_connection: sa.Engine | sa.Connection) -> Iterator[sa.Connection]:
    """The caller's connection, or one of the engine's for the block."""
    if isinstance(engine_or_connection, sa.Engine):
        with engine_or_connection.connect() as conn:
            yield conn
    else:
        yield engine_or_connection
