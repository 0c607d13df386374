"""A small reference downstream: an HTTP receiver that applies each ``Idempotency-Key`` once, via the inbox.

It answers as the IETF ``Idempotency-Key`` draft asks: 400 without the header, 409 while the same key is
in flight, 422 for the same key with another payload, and the first response again on a replay (with
``Idempotent-Replayed: true``). Its effect is one row per key in ``joblease_receiver_effect``, written in
the inbox's transaction; every POST it receives in full is logged in ``joblease_receiver_request`` so
tests and the demo can count deliveries against effects. That log is written in batches off the request
path (:meth:`ReceiverServer.flush_log` waits for it); it is a debugging aid, not part of the guarantees.

It is built to face hostile clients: a body shorter than its ``Content-Length`` never reaches the effect
(400), a stalled request times out (408), idle connections are closed, the number of open connections is
bounded (503 beyond it), a malformed ``Content-Length`` gets 400/411/413, and database errors reach the
client only as a generic 503 (the detail goes to the log).

The fault options (:class:`Faults`) are testing aids: they make the receiver fail, hang, drop connections
or reject a topic, so the dispatcher's retry and dead-letter paths can be exercised against a real server.
"""

from __future__ import annotations

import collections
import dataclasses
import email.parser
import email.utils
import functools
import http.client
import io
import json
import json.encoder
import logging
import math
import re
import signal
import threading
import time
import types
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit

import psycopg
import sqlalchemy as sa

from dagster_joblease import errors, inbox
from dagster_joblease.storage.autocommit import AutocommitConnections, autocommit_connections
from dagster_joblease.storage.clock import db_now
from dagster_joblease.storage.engine import create_engine, translate_errors
from dagster_joblease.storage.migrate import migrate as migrate_schema

__all__ = [
    "APPLY_FUNCTION",
    "FAULT_KINDS",
    "MAX_BODY_BYTES",
    "Faults",
    "ReceiverServer",
    "apply_function_state",
    "effect_count",
    "effect_table",
    "effects",
    "ensure_tables",
    "receiver_metadata",
    "request_count",
    "request_log",
    "request_table",
    "serve",
]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_IDLE_TIMEOUT_S = 15.0
DEFAULT_READ_TIMEOUT_S = 10.0
MAX_TOPIC_LENGTH = 320
REPLAYED_HEADER = "Idempotent-Replayed"
# "jlrecv" as an int: serializes concurrent receivers creating their tables on PostgreSQL.
_CREATE_LOCK_ID = 0x6A6C72656376

_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_Time = sa.DateTime(timezone=True)

#: The receiver's own tables, apart from the package's migrated schema (they belong to this downstream).
receiver_metadata = sa.MetaData()

effect_table = sa.Table(
    "joblease_receiver_effect",
    receiver_metadata,
    sa.Column("idempotency_key", sa.String(320), primary_key=True),
    sa.Column("topic", sa.String(MAX_TOPIC_LENGTH), nullable=False),
    sa.Column("payload", sa.Text(), nullable=False),
    sa.Column("applied_at", _Time, nullable=False),
)

request_table = sa.Table(
    "joblease_receiver_request",
    receiver_metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("idempotency_key", sa.Text(), nullable=True),
    sa.Column("topic", sa.Text(), nullable=False),
    sa.Column("received_at", _Time, nullable=False),
    sa.Column("status_code", sa.Integer(), nullable=True),
)


@dataclasses.dataclass(frozen=True)
class Faults:
    """Testing aids. The "first N" counters are per receiver process and count POSTs in arrival order.

    Combined, they apply in sequence: the first ``drop_first`` POSTs are dropped, the next ``hang_first``
    hang, the next ``fail_first`` fail; later POSTs are served normally.
    """

    fail_first: int = 0
    fail_status: int = 500
    hang_first: int = 0
    hang_ms: int = 30_000
    drop_first: int = 0
    always_status: Mapping[str, int] = dataclasses.field(default_factory=dict)
    delay_after_apply_ms: int = 0
    effect_delay_ms: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_first", "hang_first", "hang_ms", "drop_first", "delay_after_apply_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise errors.ConfigurationError(f"receiver fault {name}={value!r} must be an int >= 0")
        if self.effect_delay_ms < 0:
            raise errors.ConfigurationError(f"effect_delay_ms={self.effect_delay_ms!r} must be >= 0")
        for topic, status in {"": self.fail_status, **self.always_status}.items():
            if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
                raise errors.ConfigurationError(
                    f"receiver fault status {status!r} (topic {topic!r}) must be an HTTP status 100-599"
                )

    def fault_for(self, ordinal: int) -> str | None:
        """Which "first N" fault applies to the ``ordinal``-th POST (1-based): drop, hang, fail or none."""
        if ordinal <= self.drop_first:
            return "drop"
        if ordinal <= self.drop_first + self.hang_first:
            return "hang"
        if ordinal <= self.drop_first + self.hang_first + self.fail_first:
            return "fail"
        return None


#: The faults :meth:`ReceiverServer.inject_next` knows.
FAULT_KINDS = ("fail", "drop_after_apply", "slow")


@dataclasses.dataclass
class _Injected:
    """One queued :meth:`ReceiverServer.inject_next` call: ``remaining`` POSTs still to take ``kind``."""

    kind: str
    remaining: int
    status: int
    seconds: float


def _check_injection(n: object, fault: object, status: object, seconds: object) -> _Injected:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise errors.InvalidFaultError(f"inject_next n={n!r} must be an int >= 1 (how many POSTs to fault)")
    if not isinstance(fault, str) or fault not in FAULT_KINDS:
        raise errors.InvalidFaultError(
            f"inject_next fault={fault!r} is not a known fault; use one of {', '.join(FAULT_KINDS)}"
        )
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise errors.InvalidFaultError(f"inject_next status={status!r} must be an int HTTP status 100-599")
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise errors.InvalidFaultError(f"inject_next seconds={seconds!r} must be a finite number >= 0")
    return _Injected(kind=fault, remaining=n, status=status, seconds=float(seconds))


#: PostgreSQL: the receiver's whole POST as one function, so it costs one round trip and one commit.
#: It takes the inbox's in-flight advisory lock on the key (same class and hash as :mod:`inbox`, so it
#: interoperates with :meth:`inbox.Inbox.process` on the same keys), reads the key's inbox row and
#: either answers from it (replay, conflict, in flight) or writes the effect row and the DONE row with
#: the response the receiver computed beforehand. Called in autocommit, the statement is its own
#: transaction: the effect, the stored response and DONE commit together or not at all.
APPLY_FUNCTION = "joblease_receiver_apply"
_DONE = inbox.InboxStatus.DONE.value
_APPLY_SIGNATURE = f"{APPLY_FUNCTION}(text, text, text, text, integer, text)"
#: The function's body as PostgreSQL stores it (``pg_proc.prosrc``): how a receiver tells this version's
#: function from an older one it must not call.
_APPLY_BODY = f"""
DECLARE
    found_row record;
BEGIN
    IF NOT pg_try_advisory_xact_lock({inbox.ADVISORY_LOCK_CLASS}, hashtext(p_key)) THEN
        RETURN QUERY SELECT 'in-flight'::text, NULL::integer, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    SELECT i.status, i.payload_sha256, i.response_status AS status_code, i.response_body AS body,
           CAST(EXTRACT(EPOCH FROM (i.locked_until - clock_timestamp())) * 1000 AS BIGINT) AS left_ms
      INTO found_row
      FROM joblease_inbox AS i WHERE i.idempotency_key = p_key;
    IF FOUND THEN
        IF found_row.payload_sha256 <> p_sha256
           AND (found_row.status = '{_DONE}' OR found_row.left_ms IS NULL OR found_row.left_ms >= 0) THEN
            RETURN QUERY SELECT 'conflict'::text, NULL::integer, NULL::text, NULL::bigint;
            RETURN;
        END IF;
        IF found_row.status = '{_DONE}' THEN
            RETURN QUERY SELECT 'replay'::text, found_row.status_code, found_row.body, NULL::bigint;
            RETURN;
        END IF;
        IF found_row.left_ms IS NULL OR found_row.left_ms >= 0 THEN
            -- a live claim of the older two-step consumer
            RETURN QUERY SELECT 'in-flight'::text, NULL::integer, NULL::text, found_row.left_ms;
            RETURN;
        END IF;
        -- an expired claim: its holder is gone and left no effect
        DELETE FROM joblease_inbox WHERE idempotency_key = p_key;
    END IF;
    INSERT INTO joblease_receiver_effect (idempotency_key, topic, payload, applied_at)
        VALUES (p_key, p_topic, p_payload, clock_timestamp());
    INSERT INTO joblease_inbox (idempotency_key, payload_sha256, status, response_status, response_body,
                                created_at, completed_at)
        VALUES (p_key, p_sha256, '{_DONE}', p_status, p_body, clock_timestamp(), clock_timestamp());
    RETURN QUERY SELECT 'applied'::text, p_status, p_body, NULL::bigint;
END
"""
_APPLY_FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION {APPLY_FUNCTION}(
    p_key text, p_sha256 text, p_topic text, p_payload text, p_status integer, p_body text
) RETURNS TABLE(outcome text, response_status integer, response_body text, lock_left_ms bigint)
LANGUAGE plpgsql AS $fn${_APPLY_BODY}$fn$
"""
#: The function's body if it exists (in the search path), else no row.
_APPLY_LOOKUP = f"SELECT prosrc FROM pg_catalog.pg_proc WHERE oid = to_regprocedure('{_APPLY_SIGNATURE}')"
_APPLY_CALL = (
    f"SELECT outcome, response_status, response_body, lock_left_ms FROM {APPLY_FUNCTION}"
    "(%s::text, %s::text, %s::text, %s::text, %s::integer, %s::text)"
)


def ensure_tables(engine: sa.Engine, *, function: bool = True) -> None:
    """The receiver's set-up: create its tables if missing and, on PostgreSQL with ``function``, its
    one-round-trip function :data:`APPLY_FUNCTION` if it is missing or not this version's.

    Safe when several receivers start at once: on PostgreSQL they take turns under an advisory lock.
    Creating the function needs the right to create functions in the schema (PostgreSQL 15 grants
    nobody CREATE on ``public`` by default) and, to replace an older one, ownership of it; a role that
    has neither leaves it as it is (logged), and the receiver then uses the generic inbox path (see
    :attr:`ReceiverServer.fast_path`). Pass ``function=False`` to create tables only.
    """
    with translate_errors("create the receiver tables"), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _CREATE_LOCK_ID})
        receiver_metadata.create_all(conn, checkfirst=True)
        if function and conn.dialect.name == "postgresql" and _function_state(conn) != "current":
            try:
                with conn.begin_nested():
                    conn.exec_driver_sql(_APPLY_FUNCTION_SQL)
            except sa.exc.DBAPIError as exc:
                if not isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
                    raise
                logger.info("could not create %s: %s", APPLY_FUNCTION, str(exc.orig).strip().splitlines()[0])


def _function_state(conn: sa.Connection) -> str:
    """``current`` (this version's body), ``other`` (an older or foreign body) or ``missing``."""
    found = conn.exec_driver_sql(_APPLY_LOOKUP).scalar_one_or_none()
    if found is None:
        return "missing"
    return "current" if found == _APPLY_BODY else "other"


def apply_function_state(engine: sa.Engine) -> str:
    """Whether :data:`APPLY_FUNCTION` is usable here: ``current``, ``other`` (not this version's: never
    called), ``missing``, or ``unsupported`` (not PostgreSQL with psycopg)."""
    dialect = engine.dialect
    if (dialect.name, dialect.driver) != ("postgresql", "psycopg"):
        return "unsupported"
    with translate_errors("look up the receiver's function"), engine.connect() as conn:
        return _function_state(conn)


def _warn_generic_path(state: str) -> None:
    what = "is missing" if state == "missing" else "is not this version's (and was not replaced)"
    logger.warning(
        "%s %s: using the generic inbox path (3 round trips per POST); to create it, run the receiver "
        "once with --migrate as a role that may create functions in its schema (and owns an older one)",
        APPLY_FUNCTION,
        what,
    )


def _has(conn: sa.Connection, table: sa.Table) -> bool:
    return sa.inspect(conn).has_table(table.name)


def effect_count(engine: sa.Engine, *, idempotency_key: str | None = None) -> int:
    """How many effects the receiver applied (one per key), optionally for one key; 0 before it started."""
    stmt = sa.select(sa.func.count()).select_from(effect_table)
    if idempotency_key is not None:
        stmt = stmt.where(effect_table.c.idempotency_key == idempotency_key)
    with translate_errors("count receiver effects"), engine.connect() as conn:
        return int(conn.execute(stmt).scalar_one()) if _has(conn, effect_table) else 0


def effects(engine: sa.Engine) -> list[tuple[str, str, str]]:
    """The applied effects as ``(idempotency_key, topic, payload text)``, in the order they were applied."""
    t = effect_table
    stmt = sa.select(t.c.idempotency_key, t.c.topic, t.c.payload).order_by(
        t.c.applied_at, t.c.idempotency_key
    )
    with translate_errors("read receiver effects"), engine.connect() as conn:
        if not _has(conn, t):
            return []
        return [(row[0], row[1], row[2]) for row in conn.execute(stmt)]


def request_count(engine: sa.Engine, *, idempotency_key: str | None = None) -> int:
    """How many POSTs the receiver received (faulted ones included), optionally for one key.

    The log is written in batches: from the same process call :meth:`ReceiverServer.flush_log` first
    for an exact count; from another, wait for the count (or stop the receiver, which flushes).
    """
    stmt = sa.select(sa.func.count()).select_from(request_table)
    if idempotency_key is not None:
        stmt = stmt.where(request_table.c.idempotency_key == idempotency_key)
    with translate_errors("count receiver requests"), engine.connect() as conn:
        return int(conn.execute(stmt).scalar_one()) if _has(conn, request_table) else 0


def request_log(engine: sa.Engine) -> list[tuple[str | None, str, int | None]]:
    """Every POST as ``(idempotency_key, topic, status_code)`` in arrival order (status None: dropped)."""
    t = request_table
    stmt = sa.select(t.c.idempotency_key, t.c.topic, t.c.status_code).order_by(t.c.id)
    with translate_errors("read the receiver request log"), engine.connect() as conn:
        if not _has(conn, t):
            return []
        return [(row[0], row[1], row[2]) for row in conn.execute(stmt)]


def parse_idempotency_key(raw: str) -> str:
    """The key from the header value: an RFC 8941 sf-string (``"abc"``) or, leniently, a bare token."""
    value = raw.strip()
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        out: list[str] = []
        escaped = False
        for ch in value[1:-1]:
            if escaped:
                out.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            else:
                out.append(ch)
        return "".join(out)
    return value


class _LogEntry:
    """One received POST on its way to the request log; ``status`` None until answered (or dropped)."""

    __slots__ = ("key", "received_at", "row_id", "status", "topic", "written")

    def __init__(self, key: str | None, topic: str) -> None:
        self.key = key
        self.topic = topic
        self.received_at = time.monotonic()
        self.status: int | None = None
        self.row_id: int | None = None
        self.written = False


class _RequestLog:
    """The request log, written off the request path by one thread in batches.

    It is a debugging and testing aid, not part of the receiver's guarantees: a batch is one transaction
    (on PostgreSQL one statement on an autocommit connection, with ``synchronous_commit`` off; late
    statuses are a second one), so a POST costs no log round trip or commit of its own, and the last
    moments before a crash may be missing. Arrival order is kept (row ids follow it). A status known
    when the row is first written goes in with it; a later one is an UPDATE in a later batch. The writer
    holds back the entries from the first one still unanswered and younger than :attr:`SETTLE_S` (a POST
    being processed) to the next batch, so statuses nearly always go in with their rows: a batch that cut
    in-flight POSTs off needed a second statement, the UPDATE, in 85 of 98 batches under load.
    :meth:`flush` writes everything pending now, for readers that need exact counts.
    """

    #: How long the writer waits for more entries before writing a batch.
    LINGER_S = 0.05
    #: An unanswered entry younger than this waits for the next batch (with those after it, keeping order).
    SETTLE_S = 0.25
    #: Entries kept while the database refuses the log (beyond this the oldest are dropped, with a warning).
    MAX_PENDING = 100_000

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        dialect = engine.dialect
        self._raw_pg = (dialect.name, dialect.driver) == ("postgresql", "psycopg")
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._new: list[_LogEntry] = []
        self._updates: list[_LogEntry] = []
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="joblease-receiver-log", daemon=True)
        self._thread.start()

    def received(self, key: str | None, topic: str) -> _LogEntry:
        entry = _LogEntry(key, topic)
        with self._lock:
            self._new.append(entry)
            if len(self._new) > self.MAX_PENDING:
                del self._new[0]
                logger.warning("the receiver's request log is behind; dropped its oldest pending entry")
        if not self._wake.is_set():  # set() takes a lock and notifies even when already set
            self._wake.set()
        return entry

    def answered(self, entry: _LogEntry, status: int) -> None:
        with self._lock:
            entry.status = status
            if entry.written:
                self._updates.append(entry)
        if not self._wake.is_set():
            self._wake.set()

    def flush(self, *, settled_only: bool = False) -> None:
        """Write every pending entry and status now (raises StorageError if the database refuses).

        ``settled_only`` (the writer's batches): stop at the first entry unanswered for less than
        :attr:`SETTLE_S`; it and the entries after it stay pending.
        """
        with self._write_lock:
            with self._lock:
                new, self._new = self._new, []
                if settled_only:
                    young = time.monotonic() - self.SETTLE_S
                    for index, entry in enumerate(new):
                        if entry.status is None and entry.received_at > young:
                            new, self._new = new[:index], new[index:]
                            break
                updates, self._updates = self._updates, []
                for entry in new:
                    entry.written = True
            if not new and not updates:
                return
            try:
                self._write(new, updates)
            except BaseException:
                with self._lock:
                    for entry in new:
                        entry.written = False
                    self._new[:0] = new
                    self._updates[:0] = updates
                raise

    def _write(self, new: list[_LogEntry], updates: list[_LogEntry]) -> None:
        if self._raw_pg:
            self._write_pg(new, updates)
            return
        t = request_table
        with translate_errors("write the receiver's request log"), self._engine.begin() as conn:
            if new:
                rows = [{"idempotency_key": e.key, "topic": e.topic, "status_code": e.status} for e in new]
                ids = conn.execute(_LOG_INSERT.returning(t.c.id, sort_by_parameter_order=True), rows)
                for entry, row_id in zip(new, ids.scalars(), strict=True):
                    entry.row_id = row_id
            if updates:
                conn.execute(_LOG_UPDATE, [{"row_id": e.row_id, "new_status": e.status} for e in updates])

    def _write_pg(self, new: list[_LogEntry], updates: list[_LogEntry]) -> None:
        """A batch as (at most) two fixed statements over arrays on an autocommit connection: no per-row
        SQL to build, plan or parse, no pool checkout, one round trip and one (asynchronous) commit each.

        The statuses go first: re-sent after a failure they only set the same status again, whereas
        rows inserted before a failure would be inserted twice (the rows go back to the queue).
        """
        connections = autocommit_connections(self._engine)
        with translate_errors("write the receiver's request log"), connections.connection(self._engine) as h:
            cursor = h.cursor
            if updates:
                params = ([e.row_id for e in updates], [e.status for e in updates])
                cursor.execute(_PG_LOG_UPDATE, params, prepare=True)
            if new:
                params3 = ([e.key for e in new], [e.topic for e in new], [e.status for e in new])
                cursor.execute(_PG_LOG_INSERT, params3, prepare=True)
                # Identity values are drawn row by row in the SELECT's order, so sorted ids follow arrival.
                ids = sorted(row[0] for row in cursor.fetchall())
                for entry, row_id in zip(new, ids, strict=True):
                    entry.row_id = row_id

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait()
            self._closed.wait(self.LINGER_S)
            self._wake.clear()
            try:
                self.flush(settled_only=True)
                if self._new:  # held back: look again after the next linger even if nothing arrives
                    self._wake.set()
            except errors.StorageError as exc:
                logger.warning("could not write the receiver's request log (will retry): %s", exc)
                self._closed.wait(1.0)

    def close(self) -> None:
        """Stop the writer after a last flush of everything received so far."""
        self._closed.set()
        self._wake.set()
        self._thread.join(30)
        try:
            self.flush()
        except errors.StorageError as exc:
            logger.warning("could not write the receiver's request log at shutdown: %s", exc)


#: Each its own transaction (autocommit); ``set_config(..., true)`` is ``SET LOCAL``: the log's commits do
#: not wait for the WAL flush (losing the last moments of a debugging log in a crash is acceptable).
_PG_LOG_INSERT = (
    "INSERT INTO joblease_receiver_request (idempotency_key, topic, received_at, status_code)"
    " SELECT u.k, u.t, clock_timestamp(), u.s"
    " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS c,"
    " unnest(%s::text[], %s::text[], %s::integer[]) WITH ORDINALITY AS u(k, t, s, n) ORDER BY u.n"
    " RETURNING id"
)
_PG_LOG_UPDATE = (
    "UPDATE joblease_receiver_request AS r SET status_code = u.s"
    " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS c,"
    " unnest(%s::bigint[], %s::integer[]) AS u(i, s) WHERE r.id = u.i"
)
_LOG_INSERT = request_table.insert().values(received_at=db_now())
_LOG_UPDATE = (
    sa.update(request_table)
    .where(request_table.c.id == sa.bindparam("row_id"))
    .values(status_code=sa.bindparam("new_status"))
)


class ReceiverServer(ThreadingHTTPServer):
    """The HTTP server: shared state (engine, inbox, faults, the POST counter) for its handler threads.

    To run one in-process (tests, the testing kit)::

        migrate(engine)
        ensure_tables(engine)
        server = ReceiverServer(engine, ("127.0.0.1", 0))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        ...  # POST to server.url + "/topic"
        server.shutdown()
        server.server_close()

    Args:
        engine: a migrated engine (:func:`dagster_joblease.migrate`) holding the receiver's tables
            (:func:`ensure_tables`).
        address: ``(host, port)`` to listen on; port 0 picks a free port (see :attr:`url`).
        faults: static testing faults (the CLI's ``--fail-first`` and friends); none by default.
        lock_ms: the inbox's lock time (how long an effect may stall before it is rolled back).
        max_connections: connections served at once; one more is answered 503 and closed (each
            connection holds a thread while open).
        idle_timeout_s: how long a keep-alive connection may wait for its next request.
        read_timeout_s: how long a request may take to arrive: per read of its head, and in total for
            its body. A slower client gets 408 and the connection is closed; nothing is applied.
    """

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        engine: sa.Engine,
        address: tuple[str, int] = ("127.0.0.1", 0),
        faults: Faults | None = None,
        lock_ms: int = inbox.DEFAULT_LOCK_MS,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise errors.ConfigurationError(
                f"receiver max_connections={max_connections!r} must be an int >= 1"
            )
        for name, value in (("idle_timeout_s", idle_timeout_s), ("read_timeout_s", read_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
                raise errors.ConfigurationError(
                    f"receiver {name}={value!r} must be a number of seconds above 0 and at most 3600"
                )
        self.max_connections = max_connections
        self.idle_timeout_s = float(idle_timeout_s)
        self.read_timeout_s = float(read_timeout_s)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.engine = engine
        self.inbox = inbox.Inbox(engine, lock_ms=lock_ms)
        self.faults = faults or Faults()
        dialect = engine.dialect
        # None: not looked up yet (see fast_path). An effect delay (a testing aid that stalls *inside*
        # the transaction) keeps the generic path, whose stalled transaction dies with its session when
        # the receiver is killed.
        self._fast_path: bool | None = None
        if (dialect.name, dialect.driver) != ("postgresql", "psycopg") or self.faults.effect_delay_ms:
            self._fast_path = False
        self._fast_path_lock = threading.Lock()
        try:
            self.fast_path  # noqa: B018 (looked up now, so POSTs need no pool connection for it)
        except errors.StorageError as exc:
            logger.warning("could not look up %s yet (will on the first POST): %s", APPLY_FUNCTION, exc)
        self._connections: AutocommitConnections | None = None
        self._counter = 0
        self._counter_lock = threading.Lock()
        self._injected: collections.deque[_Injected] = collections.deque()
        super().__init__(address, _Handler)
        self.request_log = _RequestLog(engine)

    @property
    def fast_path(self) -> bool:
        """One round trip per POST (:data:`APPLY_FUNCTION`) on PostgreSQL via psycopg, when this
        version's function is there (:func:`ensure_tables` creates it); otherwise, after a one-line
        warning, the generic inbox path. Looked up once, on first use (a database that cannot be
        reached then raises StorageError, and the next use looks again).
        """
        if self._fast_path is None:
            with self._fast_path_lock:
                if self._fast_path is None:
                    state = apply_function_state(self.engine)
                    if state in ("missing", "other"):
                        _warn_generic_path(state)
                    self._fast_path = state == "current"
        return self._fast_path

    @fast_path.setter
    def fast_path(self, value: bool) -> None:
        self._fast_path = value

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def inject_next(self, n: int, fault: str, *, status: int = 500, seconds: float = 0.0) -> None:
        """Make the next ``n`` POSTs received after this call take ``fault`` (a testing aid; thread-safe).

        Several calls queue in order (first in, first out). Faults:

        - ``"fail"``: answer ``status`` with a problem document; nothing is applied or recorded in the
          inbox.
        - ``"drop_after_apply"``: process the request normally (the effect and the inbox's DONE state
          commit), then close the connection without answering.
        - ``"slow"``: process the request normally, then wait ``seconds`` before answering.

        An injected fault takes precedence over the static :class:`Faults`. Every faulted POST is still
        in the request log (a dropped one with status ``None``).

        Raises:
            InvalidFaultError: ``n`` is not an int >= 1, ``fault`` is unknown, ``status`` is not an
                HTTP status 100-599 or ``seconds`` is not a finite number >= 0.
        """
        injected = _check_injection(n, fault, status, seconds)
        with self._counter_lock:
            self._injected.append(injected)

    def next_ordinal(self) -> tuple[int, _Injected | None]:
        """Number this POST (1-based arrival order) and take the injected fault it gets, if any."""
        with self._counter_lock:
            self._counter += 1
            taken: _Injected | None = None
            if self._injected:
                head = self._injected[0]
                head.remaining -= 1
                if head.remaining == 0:
                    self._injected.popleft()
                taken = head
            return self._counter, taken

    def apply(self, key: str, topic: str, body: bytes) -> inbox.InboxResult:
        """Apply one validated POST once per key, or answer from the inbox (replay, 409, 422).

        Raises what :meth:`inbox.Inbox.process` raises (InboxConflictError, InboxInProgressError,
        StorageError); on PostgreSQL it is one call of :data:`APPLY_FUNCTION` in autocommit.
        """
        payload = body.decode("utf-8", "replace").replace("\x00", "\ufffd")
        # json.dumps({"applied": True, "key": key, "topic": topic}), without the encoder's set-up.
        response = f'{{"applied": true, "key": {_json_str(key)}, "topic": {_json_str(topic)}}}'
        if not self.fast_path:
            return self.inbox.process(key, body, self._effect(key, topic, payload, response))
        params = (key, inbox.request_fingerprint(body), topic, payload, 200, response)
        for attempt in (1, 2):
            try:
                outcome, status_code, stored_body, left_ms = self._call_apply(params)
            except errors.StorageError as exc:
                cause = exc.__cause__
                if isinstance(cause, psycopg.errors.UndefinedFunction):
                    # Dropped while we run (the receiver never creates it outside its set-up).
                    self.fast_path = False
                    _warn_generic_path("missing")
                    return self.inbox.process(key, body, self._effect(key, topic, payload, response))
                if attempt == 1 and isinstance(cause, psycopg.errors.UniqueViolation):
                    continue  # recorded meanwhile outside the key's lock: the next call sees the row
                raise
            if outcome == "applied":
                return inbox.InboxResult(status_code=status_code, body=stored_body, replayed=False)
            if outcome == "replay":
                return inbox.InboxResult(status_code=status_code, body=stored_body, replayed=True)
            if outcome == "conflict":
                raise errors.InboxConflictError(idempotency_key=key)
            raise errors.InboxInProgressError(idempotency_key=key, retry_after_ms=left_ms)
        raise errors.InboxInProgressError(idempotency_key=key)

    def _call_apply(self, params: tuple[str, str, str, str, int, str]) -> tuple[str, int, str, int | None]:
        """One autocommit call of the function: one round trip, one commit.

        It runs on the engine's autocommit connections (:mod:`dagster_joblease.storage.autocommit`, as
        lease claims do): no pool checkout or autocommit switch per POST. The statement is prepared on
        the server unless the URL says ``?prepare_threshold=none`` (PgBouncer's transaction pooling,
        where a prepared statement may be on another server session); a connection that saw an error
        is closed, so a retry runs on another.
        """
        connections = self._connections
        if connections is None:
            connections = self._connections = autocommit_connections(self.engine)
        # The context managers (translate_errors, connections.connection) cost more than the rest of
        # this call's Python: the same handling, spelt out.
        try:
            handle = connections.acquire(self.engine)
        except BaseException:
            with translate_errors("apply a receiver effect"):
                raise
            raise  # not reached: translate_errors re-raises, translated or as it is
        try:
            cursor = handle.cursor
            cursor.execute(_APPLY_CALL, params, prepare=True)
            row = cursor.fetchone()
        except BaseException:
            connections.release(handle, discard=True)
            with translate_errors("apply a receiver effect"):
                raise
            raise  # not reached
        connections.release(handle)
        assert row is not None, f"{APPLY_FUNCTION} returned no row"
        return row[0], row[1], row[2], row[3]

    def _effect(self, key: str, topic: str, payload: str, response: str) -> inbox.Effect:
        """The effect for the generic inbox path (SQLite, or an effect delay for tests)."""
        delay_ms = self.faults.effect_delay_ms
        params = {"key": key, "topic": topic, "payload": payload}

        def apply(conn: sa.Connection) -> tuple[int, str]:
            if delay_ms:
                time.sleep(delay_ms / 1000)
            conn.execute(_EFFECT_INSERT, params)
            return 200, response

        return apply

    def flush_log(self) -> None:
        """Block until every POST received so far is in the request log (see :func:`request_count`).

        The log is written in batches off the request path, so a count read right after an answer can
        lag behind; call this first when the count must be exact. (A POST still being processed is
        logged with status None; its status follows once answered.) :meth:`server_close` flushes too.

        Raises:
            StorageError: the database refused the write (the entries stay pending).
        """
        self.request_log.flush()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection in its own thread if a slot is free; else answer 503 and close it."""
        if not self._slots.acquire(blocking=False):
            logger.warning("refused a connection: %d connections are open", self.max_connections)
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_close(self) -> None:
        """Close the socket, then write what the request log still holds and stop its writer."""
        super().server_close()
        self.request_log.close()
        if self._fast_path:
            autocommit_connections(self.engine).close_idle()


def _problem(status: int, title: str, detail: str) -> bytes:
    return json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()


_BUSY_BODY = _problem(503, "Service Unavailable", "too many open connections; retry later")
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/problem+json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(_BUSY_BODY)
) + _BUSY_BODY
_RETRY_1 = {"Retry-After": "1"}
_json_str = json.encoder.encode_basestring_ascii  # what json.dumps uses for a str
_LENGTH = re.compile(r"[0-9]+", re.ASCII)


#: (second, server string, its ``Server:`` and ``Date:`` lines): formatting the date costs more than the
#: rest of a head, so it is done once per second.
_head_cache: tuple[int, str, str] = (0, "", "")


def _date_lines(server: str) -> str:
    """The ``Server:`` and ``Date:`` header lines, built at most once per second."""
    global _head_cache
    now = int(time.time())
    second, cached_server, lines = _head_cache
    if second != now or cached_server != server:
        lines = f"Server: {server}\r\nDate: {email.utils.formatdate(now, usegmt=True)}\r\n"
        _head_cache = (now, server, lines)
    return lines


@functools.cache
def _status_line(status: int) -> str:
    phrase = BaseHTTPRequestHandler.responses.get(status, ("",))[0]
    return f"HTTP/1.1 {status} {phrase}\r\n"


_NO_HEADERS: Mapping[str, str] = types.MappingProxyType({})
_REPLAYED_HEADERS: Mapping[str, str] = types.MappingProxyType({REPLAYED_HEADER: "true"})


class _Answer(NamedTuple):
    """What to send (a frozen dataclass costs a few microseconds per POST more to build)."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = _NO_HEADERS
    applied: bool = False


def _problem_answer(
    status: int, title: str, detail: str, headers: Mapping[str, str] | None = None
) -> _Answer:
    body = _problem(status, title, detail)
    return _Answer(status, body, "application/problem+json", headers or _NO_HEADERS)


#: A header line the email parser takes as one plain field: a name of printable ASCII other than ':' (so
#: no space or tab, hence no continuation line or ``From `` line), a colon, and a value holding no CR or LF
#: (the email parser would split the line there) before the line's end.
_PLAIN_FIELD = re.compile(r"([!-9;-~]+):[ \t]*([^\r\n]*)\r?\n\Z", re.ASCII)


def _parse_fields(lines: list[bytes]) -> http.client.HTTPMessage:
    """The head's fields as ``http.client.parse_headers`` returns them, without its email parser.

    The email parser costs ~35 us per request, most of the stdlib's cost of a POST. When every line is a
    plain ``Name: value`` field (what every HTTP client sends), the message is built here with what that
    parser would store (the name as sent, the value without its leading blanks, in order, duplicates
    kept, an empty payload); any other line (a continuation, a line without a colon, a stray CR) goes
    through the email parser itself, so the result is always the stdlib's.
    """
    message = http.client.HTTPMessage()
    for line in lines:
        if line in (b"\r\n", b"\n"):
            break
        matched = _PLAIN_FIELD.match(line.decode("iso-8859-1"))
        if matched is None:
            text = b"".join(lines).decode("iso-8859-1")
            parsed = email.parser.Parser(_class=http.client.HTTPMessage).parsestr(text)
            return parsed
        message.set_raw(matched[1], matched[2])
    message.set_payload("")
    return message


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle's algorithm on, keep-alive clients wait ~40 ms
    # for a delayed ACK on every request.
    disable_nagle_algorithm = True
    server: ReceiverServer
    raw_requestline: bytes  #: set by handle_one_request (not in the stubs)
    #: Set by :meth:`_read_fields`: whether Transfer-Encoding is present, and the Content-Length values.
    _framing: tuple[bool, list[str]]

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def handle_one_request(self) -> None:
        # Wait for the next request under the idle timeout, then read it under the read timeout: an idle
        # keep-alive connection or a client that stalls mid-request does not hold a thread for long.
        try:
            self.connection.settimeout(self.server.idle_timeout_s)
            if not cast(io.BufferedReader, self.rfile).peek(1):
                self.close_connection = True
                return
            self.connection.settimeout(self.server.read_timeout_s)
        except (TimeoutError, ConnectionError):
            self.close_connection = True
            return
        super().handle_one_request()

    def parse_request(self) -> bool:
        """``BaseHTTPRequestHandler.parse_request`` (Python 3.11's, the same checks and answers) with the
        head's fields parsed by :func:`_parse_fields` instead of the email parser."""
        self.command = None  # type: ignore[assignment]  # set in case of error on the first line
        self.request_version = version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if not words:
            return False
        if len(words) >= 3:  # enough to determine the protocol version
            version = words[-1]
            try:
                if not version.startswith("HTTP/"):
                    raise ValueError
                base_version_number = version.split("/", 1)[1]
                parts = base_version_number.split(".")
                if len(parts) != 2 or any(not p.isdigit() or len(p) > 10 for p in parts):
                    raise ValueError
                version_number = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request version ({version!r})")
                return False
            if version_number >= (1, 1) and self.protocol_version >= "HTTP/1.1":
                self.close_connection = False
            if version_number >= (2, 0):
                self.send_error(
                    HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"Invalid HTTP version ({base_version_number})"
                )
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({requestline!r})")
            return False
        command, path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if command != "GET":
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad HTTP/0.9 request type ({command!r})")
                return False
        self.command, self.path = command, path
        if self.path.startswith("//"):  # gh-87389: no open redirect through a '//host' path
            self.path = "/" + self.path.lstrip("/")
        try:
            self.headers = _parse_fields(http.client._read_headers(self.rfile))  # type: ignore[attr-defined]
        except http.client.LineTooLong as err:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long", str(err))
            return False
        except http.client.HTTPException as err:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers", str(err))
            return False
        conntype = self.headers.get("Connection", "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive" and self.protocol_version >= "HTTP/1.1":
            self.close_connection = False
        expect = self.headers.get("Expect", "")
        if (
            expect.lower() == "100-continue"
            and self.protocol_version >= "HTTP/1.1"
            and self.request_version >= "HTTP/1.1"
        ):
            return self.handle_expect_100()
        return True

    def _send(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # One write for head and body (two writes cost a delayed-ACK round trip on keep-alive clients).
        if logger.isEnabledFor(logging.DEBUG):
            self.log_request(status, len(body))
        head = _status_line(status) + _date_lines(self.version_string())
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        if headers:
            head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        if self.close_connection:
            head += "Connection: close\r\n"
        try:
            self.wfile.write((head + "\r\n").encode("latin-1") + body)
        except (ConnectionError, TimeoutError):
            # The client gave up (a timeout) before the answer; the request log still records it.
            self.close_connection = True

    def _send_problem(self, status: int, title: str, detail: str, **headers: str) -> int:
        self._send(
            status, _problem(status, title, detail), content_type="application/problem+json", headers=headers
        )
        return status

    def _refuse(self, status: int, title: str, detail: str) -> None:
        """Answer a request whose body was not (fully) read, and close: the stream is out of step."""
        self.close_connection = True
        self._send_problem(status, title, detail)

    def do_GET(self) -> None:
        if urlsplit(self.path).path == "/health":
            self._send(200, b'{"status":"ok"}')
        else:
            self._send_problem(404, "Not Found", "GET /health is the only GET; POST to /<topic>")

    def _content_length(self) -> int | None:
        """The body's length from the headers, or None after answering 400/411/413 (never an exception)."""
        chunked, values = self._framing
        if chunked:
            self._refuse(411, "Length Required", "send the body with a Content-Length header, not chunked")
            return None
        if not values:
            self._refuse(411, "Length Required", "send the body with a Content-Length header")
            return None
        texts = {value.strip() for value in values}
        digits = texts.pop()
        if texts or not _LENGTH.fullmatch(digits):
            self._refuse(400, "Bad Content-Length", "Content-Length must be one decimal number of bytes")
            return None
        # Compare the digits before converting: a 5,000-digit value is a 413, not a ValueError.
        significant = digits.lstrip("0")
        if len(significant) > len(str(MAX_BODY_BYTES)) or int(significant or "0") > MAX_BODY_BYTES:
            self._refuse(413, "Content Too Large", f"the body may be at most {MAX_BODY_BYTES} bytes")
            return None
        return int(significant or "0")

    def _read_body(self, length: int) -> bytes | None:
        """Exactly ``length`` bytes within the read timeout, or None (answered 400/408, closing)."""
        read_timeout_s = self.server.read_timeout_s
        deadline = time.monotonic() + read_timeout_s
        chunks: list[bytes] = []
        missing = length
        # The first read runs under the socket's timeout, which is the read timeout (handle_one_request):
        # it ends by the deadline. Only a body that needs more reads sets a shorter timeout for each.
        shortened = False
        try:
            while missing:
                if chunks:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self.connection.settimeout(left)
                    shortened = True
                chunk = self.rfile.read1(missing)
                if not chunk:
                    # The client closed its side mid-body: a truncated body never reaches the effect.
                    self._refuse(
                        400, "Incomplete body", f"the body ended after {length - missing} of {length} bytes"
                    )
                    return None
                chunks.append(chunk)
                missing -= len(chunk)
        except TimeoutError:
            self._refuse(
                408, "Request Timeout", f"the body did not arrive within {self.server.read_timeout_s:g} s"
            )
            return None
        except ConnectionError:
            self.close_connection = True
            return None
        if shortened:
            self.connection.settimeout(read_timeout_s)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _read_fields(self) -> str | None:
        """One pass over the head's fields (each ``headers.get`` is a pass of its own): sets
        :attr:`_framing` (whether Transfer-Encoding is present, the Content-Length values) and returns
        the first Idempotency-Key value, as ``headers.get`` would (http.client decodes the head as
        Latin-1, so no field needs the policy's fetch-time sanitizing)."""
        chunked = False
        lengths: list[str] = []
        key: str | None = None
        for name, value in self.headers.raw_items():
            lowered = name.lower()
            if lowered == "content-length":
                lengths.append(value)
            elif lowered == "transfer-encoding":
                chunked = True
            elif lowered == "idempotency-key" and key is None:
                key = value
        self._framing = (chunked, lengths)
        return key

    def do_POST(self) -> None:
        raw_key = self._read_fields()
        length = self._content_length()
        if length is None:
            return
        body = self._read_body(length)
        if body is None:
            return
        topic = urlsplit(self.path).path.lstrip("/")
        ordinal, injected = self.server.next_ordinal()
        entry = self.server.request_log.received(raw_key, topic)
        status = self._respond(ordinal, injected, topic, raw_key, body)
        if status is not None:
            self.server.request_log.answered(entry, status)

    def _respond(
        self, ordinal: int, injected: _Injected | None, topic: str, raw_key: str | None, body: bytes
    ) -> int | None:
        """Answer one POST (or drop it); returns the status sent, None when nothing was sent."""
        if injected is not None and injected.kind == "fail":
            return self._send_answer(
                _problem_answer(
                    injected.status, "Simulated failure", f"POST #{ordinal} failed on purpose (inject_next)"
                )
            )
        faults = self.server.faults
        fault = None if injected is not None else faults.fault_for(ordinal)
        if fault == "drop":
            # Close the socket without a byte of response: the client sees a broken connection.
            self.close_connection = True
            return None
        if fault == "hang":
            time.sleep(faults.hang_ms / 1000)
            return self._send_answer(
                _problem_answer(
                    503, "Service Unavailable", f"POST #{ordinal} hung for {faults.hang_ms} ms (--hang-first)"
                )
            )
        if fault == "fail":
            return self._send_answer(
                _problem_answer(
                    faults.fail_status,
                    "Simulated failure",
                    f"POST #{ordinal} failed on purpose (--fail-first)",
                )
            )
        answer = self._process(topic, raw_key, body)
        if injected is not None and injected.kind == "drop_after_apply":
            self.close_connection = True
            return None
        if injected is not None and injected.kind == "slow":
            time.sleep(injected.seconds)
        elif answer.applied and faults.delay_after_apply_ms:
            time.sleep(faults.delay_after_apply_ms / 1000)
        return self._send_answer(answer)

    def _send_answer(self, answer: _Answer) -> int:
        self._send(answer.status, answer.body, content_type=answer.content_type, headers=answer.headers)
        return answer.status

    def _process(self, topic: str, raw_key: str | None, body: bytes) -> _Answer:
        """The answer the inbox gives this request; ``applied`` when its effect committed just now."""
        faults = self.server.faults
        if topic in faults.always_status:
            status = faults.always_status[topic]
            return _problem_answer(
                status,
                "Rejected by configuration",
                f"topic {topic!r} always answers {status} (--always-status-for-topic)",
            )
        if raw_key is None:
            return _problem_answer(
                400, "Missing Idempotency-Key", "this endpoint requires an Idempotency-Key header"
            )
        try:
            key = inbox.validate_idempotency_key(parse_idempotency_key(raw_key))
        except inbox.InvalidInboxInputError as exc:
            return _problem_answer(400, "Invalid Idempotency-Key", str(exc))
        if len(topic) > MAX_TOPIC_LENGTH:
            return _problem_answer(400, "Topic too long", f"the topic has more than {MAX_TOPIC_LENGTH} chars")
        try:
            result = self.server.apply(key, topic, body)
        except errors.InboxConflictError as exc:
            return _problem_answer(422, "Idempotency-Key reused with another payload", str(exc))
        except errors.InboxInProgressError as exc:
            # Retry-After: when the in-flight claim ends at the latest (a crashed consumer's claim included).
            wait_s = 1 if exc.retry_after_ms is None else max(1, math.ceil(exc.retry_after_ms / 1000))
            return _problem_answer(409, "Request in progress", str(exc), {"Retry-After": str(wait_s)})
        except errors.StorageError as exc:
            # The driver's text can name hosts, ports and users: it goes to the log, never to clients.
            logger.warning("the receiver's database failed for key %r: %s", key, exc)
            return _problem_answer(
                503, "Service Unavailable", "the receiver cannot reach its database; retry later", _RETRY_1
            )
        except errors.ConfigurationError as exc:
            # E.g. PgBouncer in transaction mode without ?prepare_threshold=none: say so in the log.
            logger.error("the receiver is misconfigured (key %r): %s", key, exc)
            return _problem_answer(500, "Internal Server Error", "the receiver is misconfigured; see its log")
        except Exception:
            logger.exception("the receiver's effect failed for key %r", key)
            return _problem_answer(500, "Internal Server Error", "the receiver failed; retry later")
        headers = _REPLAYED_HEADERS if result.replayed else _NO_HEADERS
        return _Answer(
            result.status_code, result.body.encode("utf-8"), headers=headers, applied=not result.replayed
        )


#: The effect: one row per key, written in the inbox's transaction (built once, so its SQL is cached).
_EFFECT_INSERT = effect_table.insert().values(
    idempotency_key=sa.bindparam("key", type_=sa.String()),
    topic=sa.bindparam("topic", type_=sa.String()),
    payload=sa.bindparam("payload", type_=sa.Text()),
    applied_at=db_now(),
)


def serve(
    database: str | sa.Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    faults: Faults | None = None,
    lock_ms: int = inbox.DEFAULT_LOCK_MS,
    migrate: bool = True,
    stop: threading.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
) -> None:
    """Run the receiver until ``stop`` is set (or SIGTERM/SIGINT, when called from the main thread).

    ``database`` is a URL or an engine. With ``migrate`` the package's schema (the inbox table) is
    installed or upgraded first and the receiver's function is created or replaced (:func:`ensure_tables`);
    without it nothing is created but the receiver's tables when missing, and the function is used only
    if it is there (else the generic inbox path, with a warning). ``on_ready``
    gets the base URL once the socket listens (port 0 picks a free port). ``max_connections``,
    ``idle_timeout_s`` and ``read_timeout_s`` bound what clients can hold: see :class:`ReceiverServer`.
    """
    engine = create_engine(database) if isinstance(database, str) else database
    stop = stop or threading.Event()
    try:
        if migrate:
            migrate_schema(engine)
        ensure_tables(engine, function=migrate)
        server = ReceiverServer(
            engine,
            (host, port),
            faults or Faults(),
            lock_ms,
            max_connections=max_connections,
            idle_timeout_s=idle_timeout_s,
            read_timeout_s=read_timeout_s,
        )
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():

            def _on_signal(signum: int, frame: FrameType | None) -> None:
                stop.set()

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, _on_signal)
        thread = threading.Thread(target=server.serve_forever, name="joblease-receiver", daemon=True)
        thread.start()
        try:
            if on_ready is not None:
                on_ready(server.url)
            while not stop.wait(0.2):
                pass
        finally:
            server.shutdown()
            server.server_close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if isinstance(database, str):
            engine.dispose()
