"""The consumer side: run an effect at most once per idempotency key and replay its recorded response.

Processing a key is **one transaction**: look the key up, run the effect on the same connection, and
insert the key as ``DONE`` with the effect's response. The effect, the stored response and the ``DONE``
state commit together or not at all, so a consumer that crashes at any point leaves the key new again
(never applied but unrecorded), and a retry can process it at once.

On PostgreSQL the lookup also takes a transaction-scoped advisory lock on the key without waiting, so a
concurrent duplicate is told the key is in flight (HTTP 409) instead of queueing behind the effect. The
lock ends with the transaction: when the consumer commits, rolls back, or loses its session (killed,
or idle inside its effect for longer than ``lock_ms``, which is the transaction's
``idle_in_transaction_session_timeout``). If two transactions ever both ran an effect for one key (the
lookup's snapshot predates the other's commit), the unique key makes the second record fail and its
effect roll back; it then replays the first one's response.

Rows ``IN_PROGRESS`` (a claim with a ``lock_token`` and ``locked_until`` on the database clock) were
written by the two-step consumer of earlier versions; a live one is still honoured (409 with its
remaining lock), an expired one is taken over.

This follows the IETF ``Idempotency-Key`` draft (400 missing key, 409 in flight, 422 same key with another
payload, replay of the first response) and Brandur Leach's Stripe-like design.

On SQLite, writers are serialized (``BEGIN IMMEDIATE``), so a second caller for a key that is being
processed in this same database waits for the effect to commit and then gets the replay instead of 409.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from dagster_joblease import errors, outbox
from dagster_joblease.options import MAX_DURATION_MS
from dagster_joblease.storage.clock import db_now, db_now_plus_ms, ms_until
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import inbox_table

__all__ = [
    "ADVISORY_LOCK_CLASS",
    "DEFAULT_LOCK_MS",
    "MAX_KEY_LENGTH",
    "Effect",
    "Inbox",
    "InboxResult",
    "InboxStatus",
    "InvalidInboxInputError",
    "request_fingerprint",
    "validate_idempotency_key",
]

logger = logging.getLogger(__name__)

DEFAULT_LOCK_MS = 30_000
MIN_LOCK_MS = 1
MAX_LOCK_MS = 24 * 3600 * 1000
MAX_KEY_LENGTH = outbox.MAX_KEY_LENGTH
MAX_BODY_CHARS = 1_000_000

#: An effect runs inside the inbox's transaction and returns the response to record: (HTTP status, body).
Effect = Callable[[sa.Connection], tuple[int, str]]


class InboxStatus(enum.StrEnum):
    IN_PROGRESS = "IN_PROGRESS"  #: claimed by a consumer until locked_until (database clock)
    DONE = "DONE"  #: the effect committed; the stored response is replayed


InvalidInboxInputError = errors.InvalidInboxInputError


@dataclasses.dataclass(frozen=True)
class InboxResult:
    """The response for a key: freshly produced by the effect, or ``replayed`` from the first time."""

    status_code: int
    body: str
    replayed: bool


#: C0 controls, DEL and C1 controls: never part of a key.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def validate_idempotency_key(key: object) -> str:
    """Return ``key`` if it is a usable idempotency key, else raise :class:`InvalidInboxInputError`."""
    if not isinstance(key, str):
        raise InvalidInboxInputError("idempotency_key", f"must be a str, got {type(key).__name__}")
    if not key.strip():
        raise InvalidInboxInputError("idempotency_key", f"{key!r} is blank; send a non-empty key")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInboxInputError(
            "idempotency_key", f"is {len(key)} characters; at most {MAX_KEY_LENGTH} are allowed, shorten it"
        )
    control = _CONTROL.search(key)
    if control is not None:
        raise InvalidInboxInputError(
            "idempotency_key",
            f"{key[:40]!r} contains the control character U+{ord(control.group()):04X}; remove it",
        )
    return key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: What ``json.loads(raw, parse_constant=…)`` does, without building a decoder per request body.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def request_fingerprint(payload: Any) -> str:
    """SHA-256 hex of the payload, insensitive to JSON formatting.

    Python values are hashed as :func:`outbox.canonical_json`. ``bytes``/``str`` are taken as a request
    body: if they parse as JSON, the canonical form of the parsed value is hashed (so key order and
    whitespace do not matter); otherwise the raw bytes (UTF-8 for ``str``) are hashed.
    """
    if isinstance(payload, bytes | bytearray | str):
        raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else bytes(payload)
        try:
            parsed = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
            return outbox.payload_fingerprint(parsed)
        except (ValueError, RecursionError, errors.InvalidPayloadError):
            return hashlib.sha256(raw).hexdigest()
    return outbox.payload_fingerprint(payload)


def _check_lock_ms(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_LOCK_MS <= value <= MAX_LOCK_MS:
        raise InvalidInboxInputError(
            "lock_ms",
            f"{value!r} must be an int between {MIN_LOCK_MS} and {MAX_LOCK_MS} (milliseconds); make it "
            "longer than the slowest effect, since a claim older than that is taken over",
        )
    return value


def _check_response(key: str, value: object) -> tuple[int, str]:
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and 100 <= value[0] <= 599
        and isinstance(value[1], str)
        and len(value[1]) <= MAX_BODY_CHARS
    ):
        return value[0], value[1]
    raise InvalidInboxInputError(
        "effect result",
        f"the effect for key {key!r} returned {value!r:.80}; it must return (status_code, body) with an int "
        f"HTTP status 100-599 and a str body of at most {MAX_BODY_CHARS} characters",
    )


def _insert(dialect_name: str) -> Any:
    return (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(inbox_table)


class _Retry(Exception):
    """The key was completed by another transaction this one's snapshot did not see: look again."""


#: PostgreSQL: the first key of the two-int advisory lock that marks a key in flight ("jlin"), apart from
#: one-bigint advisory locks an application may use. Keys in flight show in ``pg_locks`` with this classid.
ADVISORY_LOCK_CLASS = 0x6A6C696E


def _lookup_statement(dialect_name: str) -> Any:
    """The key's row if any; on PostgreSQL also whether this transaction won the key's in-flight lock.

    On PostgreSQL the same round trip takes a transaction-scoped advisory lock on the key without
    waiting (a concurrent duplicate gets "in flight" at once, HTTP 409) and sets this transaction's
    ``idle_in_transaction_session_timeout`` to the lock time, so a consumer that hangs inside its effect
    loses its session (and the effect) after ``lock_ms`` instead of holding the key forever.
    """
    t = inbox_table
    key = sa.bindparam("key", type_=sa.String())
    columns = (
        t.c.status,
        t.c.payload_sha256,
        t.c.response_status,
        t.c.response_body,
        ms_until(t.c.locked_until).label("lock_left_ms"),
    )
    if dialect_name != "postgresql":
        return sa.select(sa.true().label("got"), *columns).where(t.c.idempotency_key == key)
    lock = sa.select(
        sa.func.pg_try_advisory_xact_lock(
            sa.literal(ADVISORY_LOCK_CLASS, sa.Integer()), sa.func.hashtext(key)
        ).label("got"),
        sa.func.set_config(
            sa.literal("idle_in_transaction_session_timeout", sa.Text()),
            sa.bindparam("idle_ms", type_=sa.Text()),
            sa.true(),
        ).label("idle"),
    ).subquery("claim")
    return sa.select(lock.c.got, *columns).select_from(lock.outerjoin(t, t.c.idempotency_key == key))


def _done_statement(dialect_name: str) -> Any:
    """Record the key as DONE with its response; takes over only an expired claim left by a crash."""
    t = inbox_table
    stmt = _insert(dialect_name).values(
        idempotency_key=sa.bindparam("key", type_=sa.String()),
        payload_sha256=sa.bindparam("sha256", type_=sa.String()),
        status=InboxStatus.DONE.value,
        response_status=sa.bindparam("response_status", type_=sa.Integer()),
        response_body=sa.bindparam("response_body", type_=sa.Text()),
        created_at=db_now(),
        completed_at=db_now(),
    )
    return stmt.on_conflict_do_update(
        index_elements=[t.c.idempotency_key],
        set_={
            "payload_sha256": stmt.excluded.payload_sha256,
            "status": InboxStatus.DONE.value,
            "lock_token": None,
            "locked_until": None,
            "response_status": stmt.excluded.response_status,
            "response_body": stmt.excluded.response_body,
            "completed_at": db_now(),
        },
        where=sa.and_(t.c.status == InboxStatus.IN_PROGRESS.value, t.c.locked_until < db_now()),
    ).returning(t.c.idempotency_key)


@functools.cache
def _statements(dialect_name: str) -> tuple[Any, Any]:
    return _lookup_statement(dialect_name), _done_statement(dialect_name)


def _delete_expired_statement() -> Any:
    """Remove a claim left by an older version's crashed two-step consumer, once its lock has passed."""
    t = inbox_table
    return sa.delete(t).where(
        t.c.idempotency_key == sa.bindparam("key", type_=sa.String()),
        t.c.status == InboxStatus.IN_PROGRESS.value,
        t.c.locked_until < db_now(),
    )


_BEGIN = "BEGIN"
_COMMIT = "COMMIT"


def _insert_done_statement() -> Any:
    """The DONE record as a plain INSERT: a key recorded meanwhile makes it fail (unique violation)."""
    return inbox_table.insert().values(
        idempotency_key=sa.bindparam("key", type_=sa.String()),
        payload_sha256=sa.bindparam("sha256", type_=sa.String()),
        status=InboxStatus.DONE.value,
        response_status=sa.bindparam("response_status", type_=sa.Integer()),
        response_body=sa.bindparam("response_body", type_=sa.Text()),
        created_at=db_now(),
        completed_at=db_now(),
    )


class _HotPath(NamedTuple):
    """The PostgreSQL hot path's statements (psycopg placeholders) and the constants they bind."""

    lookup: str
    expire: str
    done: str
    #: Without server-side preparation: ``BEGIN; lookup`` and ``expire; done; COMMIT``, each one message.
    plain_begin_lookup: str
    plain_record_commit: str
    constants: dict[str, Any]


@functools.cache
def _hot_path() -> _HotPath:
    """The hot path's three statements, compiled once by SQLAlchemy, and the constants they bind.

    Prepared, they run with psycopg's extended protocol and are prepared on the server once per session
    (``prepare=True``): protocol-level preparation only, never SQL-level ``PREPARE``, so one URL rule
    (``?prepare_threshold=none`` behind PgBouncer in transaction mode) holds for the whole library, and
    PgBouncer's ``max_prepared_statements`` can track them. Protocol-level statements go one per
    message, so they are pipelined (:meth:`Inbox._transaction_psycopg`) to keep two round trips.
    With ``prepare_threshold=None`` nothing is prepared, and the same two round trips are two
    multi-statement messages of the simple query protocol (psycopg's client-side binding): a pipeline
    of unprepared statements measured slower than that.
    """
    dialect = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]
    own = {"key", "idle_ms", "sha256", "response_status", "response_body"}
    constants: dict[str, Any] = {}
    texts = []
    for stmt in (_lookup_statement("postgresql"), _delete_expired_statement(), _insert_done_statement()):
        compiled = stmt.compile(dialect=dialect)
        for bind, value in compiled.params.items():
            if bind not in own:
                assert constants.get(bind, value) == value, f"bind {bind!r} has two values"
                constants[bind] = value
        texts.append(str(compiled))
    lookup, expire, done = texts
    return _HotPath(
        lookup=lookup,
        expire=expire,
        done=done,
        plain_begin_lookup=f"{_BEGIN}; {lookup}",
        plain_record_commit=f"{expire}; {done}; {_COMMIT}",
        constants=constants,
    )


def _pipeline(driver: psycopg.Connection[Any]) -> contextlib.AbstractContextManager[Any]:
    """psycopg's pipeline mode (one round trip for the statements inside), or plain statements where the
    libpq in use has none (before PostgreSQL 14's libpq: one round trip each, same effect)."""
    return driver.pipeline() if psycopg.Pipeline.is_supported() else contextlib.nullcontext()


class _Row(NamedTuple):
    """What the lookup read: the in-flight lock's outcome and the key's row (``status`` None if absent)."""

    got: bool
    status: str | None
    payload_sha256: str | None
    response_status: int | None
    response_body: str | None
    lock_left_ms: int | None


_ABSENT = _Row(True, None, None, None, None, None)


def _row(found: Any) -> _Row:
    return _ABSENT if found is None else _Row(*found)


def _decide(key: str, fingerprint: str, row: _Row) -> InboxResult | None:
    """From the lookup: the replay to return, an error to raise, or None to run the effect."""
    if not row.got:
        raise errors.InboxInProgressError(idempotency_key=key)
    if row.status == InboxStatus.DONE.value:
        if row.payload_sha256 != fingerprint:
            raise errors.InboxConflictError(idempotency_key=key)
        return InboxResult(
            status_code=int(row.response_status or 0), body=row.response_body or "", replayed=True
        )
    if row.status is not None:
        # A claim committed by an older version's two-step consumer. While it is live, leave it be; once
        # expired its holder is gone and left no effect, so any payload may take it over.
        left = row.lock_left_ms
        if left is None or int(left) >= 0:
            if row.payload_sha256 != fingerprint:
                raise errors.InboxConflictError(idempotency_key=key)
            raise errors.InboxInProgressError(
                idempotency_key=key, retry_after_ms=None if left is None else int(left)
            )
    return None


def _processed(key: str, status_code: int, body: str) -> InboxResult:
    logger.debug("inbox key %r processed (status %d)", key, status_code, extra={"action": "inbox_done"})
    return InboxResult(status_code=status_code, body=body, replayed=False)


class Inbox:
    """Deduplicate incoming requests by idempotency key on a migrated engine (PostgreSQL or SQLite).

    Args:
        engine: an engine over a database migrated with :func:`dagster_joblease.migrate`.
        lock_ms: the longest an effect may sit idle inside its transaction. On PostgreSQL a consumer
            stuck longer than this in its effect loses its database session, so its effect rolls back
            and the key is free again; a key in flight answers 409 meanwhile. It also bounds how long a
            claim left by an older version's crashed consumer blocks its key. Make it comfortably longer
            than the slowest effect.

    Example::

        inbox = Inbox(engine)

        def apply(conn: sa.Connection) -> tuple[int, str]:
            conn.execute(orders.insert().values(...))
            return 201, '{"created": true}'

        result = inbox.process(request.headers["Idempotency-Key"], request.body, apply)
    """

    def __init__(self, engine: sa.Engine, *, lock_ms: int = DEFAULT_LOCK_MS) -> None:
        self.engine = engine
        self.lock_ms = _check_lock_ms(lock_ms)
        dialect = engine.dialect
        self._psycopg = (dialect.name, dialect.driver) == ("postgresql", "psycopg")

    def process(self, idempotency_key: str, payload: Any, effect: Effect) -> InboxResult:
        """Run ``effect`` once for ``idempotency_key``, or return the response recorded the first time.

        ``effect(connection)`` runs inside the transaction that records the key as done and returns
        ``(status_code, body)``; write the effect's rows on that connection so they commit (or roll back)
        together with the record. Everything happens in that one transaction: the key is recorded (as
        ``DONE``, with the response) only if the effect commits, so a crash at any point leaves the key
        new again, never applied but unrecorded.

        Raises:
            InvalidInboxInputError: a bad key (before any SQL) or a malformed effect result.
            InboxConflictError: the key was already used with a different payload (HTTP 422).
            InboxInProgressError: another consumer is processing the key right now (HTTP 409); retry later.

        If ``effect`` raises, its transaction rolls back and the exception propagates: the key can be
        retried at once. Unlike Stripe (and as the IETF draft permits), failures are not stored as the
        key's response, because a failed effect did not happen; only completed results are replayed. An
        effect that wants a rejection to be final returns a 4xx instead of raising.
        """
        key = validate_idempotency_key(idempotency_key)
        if not callable(effect):
            raise InvalidInboxInputError("effect", f"{effect!r:.80} is not callable; pass a function")
        fingerprint = request_fingerprint(payload)
        # A third round is never needed: after a _Retry the completed row is visible to the lookup.
        for _ in range(3):
            try:
                return self._once(key, fingerprint, effect)
            except _Retry:
                continue
        raise errors.InboxInProgressError(idempotency_key=key)

    def _once(self, key: str, fingerprint: str, effect: Effect) -> InboxResult:
        if self._psycopg:
            return self._once_psycopg(key, fingerprint, effect)
        lookup, done = _statements(self.engine.dialect.name)
        with translate_errors("process an inbox key"), self.engine.begin() as conn:
            row = _row(conn.execute(lookup, {"key": key, "idle_ms": str(self.lock_ms)}).first())
            replay = _decide(key, fingerprint, row)
            if replay is not None:
                return replay
            status_code, body = _check_response(key, effect(conn))
            params = {
                "key": key,
                "sha256": fingerprint,
                "response_status": status_code,
                "response_body": body,
            }
            with translate_errors("record an inbox result"):
                recorded = conn.execute(done, params).first() is not None
            if not recorded:
                # Completed by a transaction that committed after our lookup's snapshot: roll our
                # effect back and replay (or refuse) what that one recorded.
                raise _Retry
        return _processed(key, status_code, body)

    def _once_psycopg(self, key: str, fingerprint: str, effect: Effect) -> InboxResult:
        """The same transaction in three round trips (begin + lookup, the effect, record + commit).

        The pooled psycopg connection is switched to autocommit for the duration so that psycopg does
        not send its own BEGIN (a round trip of its own): the transaction is opened by our first
        pipeline and ended by our last. SQLAlchemy's commit then finds the connection idle and sends
        nothing; its rollback (on any error) still sends ROLLBACK, since psycopg checks the server's
        state.
        """
        with translate_errors("process an inbox key"), self.engine.connect() as conn:
            driver = conn.connection.driver_connection
            assert driver is not None, "the connection is closed"
            driver.autocommit = True
            try:
                outcome = self._transaction_psycopg(conn, driver, key, fingerprint, effect)
            finally:
                if driver.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                    driver.autocommit = False
                else:
                    conn.invalidate()  # never hand a connection in an unknown state back to the pool
        if isinstance(outcome, errors.JobLeaseError):
            raise outcome
        return outcome

    def _transaction_psycopg(
        self,
        conn: sa.Connection,
        driver: psycopg.Connection[Any],
        key: str,
        fingerprint: str,
        effect: Effect,
    ) -> InboxResult | errors.InboxConflictError | errors.InboxInProgressError:
        """One round trip opens the transaction and reads the key; the effect runs; one round trip
        records and commits (a pipeline of prepared statements, or one simple-protocol message without
        preparation: see :func:`_hot_path`). Either way the server skips everything after an error up to
        the end of that round trip, so the COMMIT never runs after a failed INSERT: that transaction is
        rolled back.

        A refusal (409, 422) is returned, not raised, so that its read-only transaction ends with a
        COMMIT: after a ROLLBACK psycopg would deallocate the connection's prepared statements.
        """
        sql = _hot_path()
        constants = sql.constants
        prepared = driver.prepare_threshold is not None
        cursor_class = psycopg.Cursor if prepared else psycopg.ClientCursor
        with conn.begin(), cursor_class(driver) as cursor:
            lookup_params = {**constants, "key": key, "idle_ms": str(self.lock_ms)}
            if prepared:
                with _pipeline(driver):
                    cursor.execute(_BEGIN, prepare=False)
                    cursor.execute(sql.lookup, lookup_params, prepare=True)
            else:
                cursor.execute(sql.plain_begin_lookup, lookup_params)
                cursor.nextset()
            row = _row(cursor.fetchone())
            try:
                replay = _decide(key, fingerprint, row)
            except (errors.InboxConflictError, errors.InboxInProgressError) as refusal:
                return refusal
            if replay is not None:
                return replay
            status_code, body = _check_response(key, effect(conn))
            params = {
                **constants,
                "key": key,
                "sha256": fingerprint,
                "response_status": status_code,
                "response_body": body,
            }
            try:
                with translate_errors("record an inbox result"):
                    if prepared:
                        with _pipeline(driver):
                            cursor.execute(sql.expire, params, prepare=True)
                            cursor.execute(sql.done, params, prepare=True)
                            cursor.execute(_COMMIT, prepare=False)
                    else:
                        cursor.execute(sql.plain_record_commit, params)
            except errors.StorageError as exc:
                if isinstance(exc.__cause__, psycopg.errors.UniqueViolation):
                    raise _Retry from None  # recorded meanwhile: see _once
                raise
        return _processed(key, status_code, body)

    def purge(self, older_than_ms: int) -> int:
        """Delete completed keys finished more than ``older_than_ms`` ago (database clock); return how many.

        A purged key is new again: a replay after purging runs the effect a second time. Keep
        ``older_than_ms`` longer than the longest time a producer may retry (its outbox retention).
        """
        if (
            isinstance(older_than_ms, bool)
            or not isinstance(older_than_ms, int)
            or not 0 <= older_than_ms <= MAX_DURATION_MS
        ):
            raise InvalidInboxInputError(
                "older_than_ms",
                f"{older_than_ms!r} must be an int from 0 to {MAX_DURATION_MS} (100 years; milliseconds "
                "since completion)",
            )
        t = inbox_table
        cutoff = db_now_plus_ms(sa.literal(-older_than_ms, sa.BigInteger()))
        with translate_errors("purge inbox keys"), self.engine.begin() as conn:
            result = conn.execute(
                sa.delete(t).where(t.c.status == InboxStatus.DONE.value, t.c.completed_at < cutoff)
            )
        return int(result.rowcount)
