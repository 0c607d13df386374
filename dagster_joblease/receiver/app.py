"""A small reference downstream: a Starlette app built from the inbox's ASGI middleware.

It answers as the IETF ``Idempotency-Key`` draft asks (that is :class:`~dagster_joblease.inbox.
InboxMiddleware`'s work): 400 without the header, 409 while the same key is in flight, 422 for the same
key with another request, and the first answer again on a replay (with ``Idempotent-Replayed: true``). Its
effect is one row per key in ``joblease_receiver_effect``, written in the inbox's transaction, so the
effect and the stored answer commit together. Every POST it receives in full is logged in
``joblease_receiver_request`` so tests and the demo can count deliveries against effects; that log is
written in batches off the request path (:meth:`RequestLog.flush` waits for it), a debugging aid outside
the guarantees.

On PostgreSQL it runs the :class:`~dagster_joblease.inbox.AsyncInbox` on a psycopg pool; on SQLite the sync
:class:`~dagster_joblease.inbox.Inbox` in worker threads. HTTP itself (parsing, framing, Content-Length,
keep-alive, connection bounds) is uvicorn's and h11's: see :mod:`dagster_joblease.receiver.server`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import psycopg.rows
import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dagster_joblease import errors, wire
from dagster_joblease.inbox import core
from dagster_joblease.inbox.aio import AsyncInbox
from dagster_joblease.inbox.asgi import (
    ASGIApp,
    InboxMiddleware,
    Message,
    Receive,
    Scope,
    Send,
    inbox_connection,
    problem_json,
)
from dagster_joblease.inbox.sync import Inbox
from dagster_joblease.storage.clock import db_now
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.testing.faults import DROPPED

__all__ = [
    "MAX_TOPIC_LENGTH",
    "RequestLog",
    "RequestLogMiddleware",
    "build_app",
    "effect_count",
    "effect_table",
    "effects",
    "ensure_tables",
    "receiver_metadata",
    "request_count",
    "request_log",
    "request_table",
]

logger = logging.getLogger(__name__)

MAX_TOPIC_LENGTH = 320
# "jlrecv" as an int: serializes concurrent receivers creating their tables on PostgreSQL.
_CREATE_LOCK_ID = 0x6A6C72656376

_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_Time = sa.DateTime(timezone=True)

#: The receiver's own tables, apart from the package's migrated schema (they belong to this downstream).
receiver_metadata = sa.MetaData()

# One row per applied effect. The key is not unique here: the inbox is what applies a key once, and a key
# applied twice (after its retention ended) shows as two rows rather than as a failed insert.
effect_table = sa.Table(
    "joblease_receiver_effect",
    receiver_metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("idempotency_key", sa.String(320), nullable=False, index=True),
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


def ensure_tables(engine: sa.Engine) -> None:
    """Create the receiver's tables if missing (several receivers starting at once take turns)."""
    with translate_errors("create the receiver tables"), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _CREATE_LOCK_ID})
        receiver_metadata.create_all(conn, checkfirst=True)


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

    The log is written in batches: from the same process call :meth:`RequestLog.flush` first for an exact
    count; from another, wait for the count (or stop the receiver, which flushes).
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


_LOG_INSERT = request_table.insert().values(received_at=db_now())
#: PostgreSQL: a batch of log rows as one statement of three arrays, in arrival order (the ORDER BY is the
#: order the rows are inserted, so their ids, sorted, follow it). Far cheaper per row than SQLAlchemy's
#: executemany with RETURNING sorted by parameter order, which the SQLite path keeps.
_LOG_INSERT_PG = (
    "INSERT INTO joblease_receiver_request (idempotency_key, topic, received_at, status_code)"
    " SELECT u.key, u.topic, clock_timestamp(), u.status"
    " FROM unnest(%s::text[], %s::text[], %s::int[]) WITH ORDINALITY AS u(key, topic, status, n)"
    " ORDER BY u.n RETURNING id"
)
_LOG_UPDATE = (
    sa.update(request_table)
    .where(request_table.c.id == sa.bindparam("row_id"))
    .values(status_code=sa.bindparam("new_status"))
)


class RequestLog:
    """The request log, written off the request path by one thread in batches (one transaction each).

    It is a debugging and testing aid, not part of the receiver's guarantees: the last moments before a
    crash may be missing. Arrival order is kept (row ids follow it). A status known when the row is first
    written goes in with it; a later one is an UPDATE in a later batch. The writer holds back the entries
    from the first one still unanswered and younger than :attr:`SETTLE_S` (a POST being processed) to the
    next batch, so statuses nearly always go in with their rows. :meth:`flush` writes everything pending.
    """

    #: How long the writer waits for more entries before writing a batch. A batch's transaction costs the
    #: writer (and the GIL it shares with the requests) about a millisecond of CPU however few rows it
    #: holds: at 0.05 s that was 150-250 µs per request at a few hundred requests/s.
    LINGER_S = 0.2
    #: An unanswered entry younger than this waits for the next batch (with those after it, keeping order).
    SETTLE_S = 0.25
    #: Entries kept while the database refuses the log (beyond this the oldest are dropped, with a warning).
    MAX_PENDING = 100_000

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
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
        self._wake.set()
        return entry

    def answered(self, entry: _LogEntry, status: int) -> None:
        with self._lock:
            entry.status = status
            if entry.written:
                self._updates.append(entry)
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
        t = request_table
        with translate_errors("write the receiver's request log"), self._engine.begin() as conn:
            if updates:
                conn.execute(_LOG_UPDATE, [{"row_id": e.row_id, "new_status": e.status} for e in updates])
            if new and conn.dialect.name == "postgresql":
                driver: psycopg.Connection[Any] | None = conn.connection.driver_connection
                assert driver is not None
                with driver.cursor(row_factory=psycopg.rows.tuple_row) as cursor:
                    cursor.execute(
                        _LOG_INSERT_PG,
                        ([e.key for e in new], [e.topic for e in new], [e.status for e in new]),
                    )
                    ids = sorted(row[0] for row in cursor.fetchall())
                for entry, row_id in zip(new, ids, strict=True):
                    entry.row_id = row_id
            elif new:
                rows = [{"idempotency_key": e.key, "topic": e.topic, "status_code": e.status} for e in new]
                returned = conn.execute(_LOG_INSERT.returning(t.c.id, sort_by_parameter_order=True), rows)
                for entry, row_id in zip(new, returned.scalars(), strict=True):
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


def _loggable(text: str) -> str:
    return text.replace("\x00", "\ufffd")


class RequestLogMiddleware:
    """Logs every POST on arrival (its raw key and topic) and its answer's status when sent."""

    def __init__(self, app: ASGIApp, log: RequestLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        raw_key = next(
            (_loggable(v.decode("latin-1")) for k, v in scope["headers"] if k == b"idempotency-key"), None
        )
        # As received, but with no NUL (PostgreSQL's text refuses it, and one such row would fail its batch).
        entry = self.log.received(raw_key, _loggable(scope["path"].lstrip("/")))
        status: list[int] = []

        async def logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, logged)
        finally:
            if status and not scope.get(DROPPED):
                self.log.answered(entry, status[0])


#: The effect: one row per key, written in the inbox's transaction (built once, so its SQL is cached).
_EFFECT_INSERT = effect_table.insert().values(
    idempotency_key=sa.bindparam("key", type_=sa.String()),
    topic=sa.bindparam("topic", type_=sa.String()),
    payload=sa.bindparam("payload", type_=sa.Text()),
    applied_at=db_now(),
)
_EFFECT_SQL = (
    "INSERT INTO joblease_receiver_effect (idempotency_key, topic, payload, applied_at)"
    " VALUES (%s, %s, %s, clock_timestamp())"
)


#: Characters no topic may hold: a path's %00 decodes to a NUL, which PostgreSQL's text refuses.
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _problem_response(status: int, title: str, detail: str, **headers: str) -> Response:
    body = problem_json(status, title, detail)
    return Response(body, status, headers=headers, media_type="application/problem+json")


async def _request_parts(request: Request) -> tuple[str, str, str] | Response:
    """(key, topic, payload text) of a POST, or the 400 for a topic too long."""
    topic = request.path_params["topic"]
    if len(topic) > MAX_TOPIC_LENGTH:
        return _problem_response(
            400, "Topic too long", f"the topic has more than {MAX_TOPIC_LENGTH} characters"
        )
    if _CONTROL.search(topic):
        return _problem_response(
            400, "Bad topic", "the topic has a control character (U+0000-U+001F or U+007F)"
        )
    key = wire.parse_key(request.headers[wire.IDEMPOTENCY_KEY])
    payload = (await request.body()).decode("utf-8", "replace").replace("\x00", "\ufffd")
    return key, topic, payload


def _applied_response(key: str, topic: str) -> Response:
    return JSONResponse({"applied": True, "key": key, "topic": topic})


def _async_endpoint(effect_delay_ms: int) -> Callable[[Request], Awaitable[Response]]:
    async def apply(request: Request) -> Response:
        parts = await _request_parts(request)
        if isinstance(parts, Response):
            return parts
        key, topic, payload = parts
        conn: psycopg.AsyncConnection[Any] = inbox_connection(request)
        with translate_errors("apply the receiver's effect"):
            await conn.execute(_EFFECT_SQL, (key, topic, payload))
        if effect_delay_ms:
            await anyio.sleep(effect_delay_ms / 1000)
        return _applied_response(key, topic)

    return apply


def _sync_endpoint(effect_delay_ms: int) -> Callable[[Request], Awaitable[Response]]:
    async def apply(request: Request) -> Response:
        parts = await _request_parts(request)
        if isinstance(parts, Response):
            return parts
        key, topic, payload = parts
        conn: sa.Connection = inbox_connection(request)

        def write() -> None:
            conn.execute(_EFFECT_INSERT, {"key": key, "topic": topic, "payload": payload})
            if effect_delay_ms:
                time.sleep(effect_delay_ms / 1000)

        await anyio.to_thread.run_sync(write)
        return _applied_response(key, topic)

    return apply


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _storage_error(request: Request, exc: Exception) -> Response:
    # The driver's text can name hosts, ports and users: it goes to the log, never to clients.
    logger.warning("the receiver's database failed: %s", exc)
    return _problem_response(
        503,
        "Service Unavailable",
        "the receiver cannot reach its database; retry later",
        **{"Retry-After": "1"},
    )


def build_app(
    inbox: Inbox | AsyncInbox[psycopg.AsyncConnection[Any]],
    *,
    effect_delay_ms: int = 0,
    read_timeout_s: float | None = None,
    lifespan: Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]] | None = None,
) -> Starlette:
    """The receiver as a Starlette app: ``POST /<topic>`` applies once per key, ``GET /health`` is 200.

    ``effect_delay_ms`` (a testing aid) sleeps inside the effect's transaction, keeping the key in flight;
    ``read_timeout_s`` bounds a request body's arrival (408 after it). The server module wraps it with
    the request log and the fault middleware (:func:`dagster_joblease.receiver.server.receiver_asgi`).
    """
    endpoint = (
        _sync_endpoint(effect_delay_ms) if isinstance(inbox, Inbox) else _async_endpoint(effect_delay_ms)
    )
    inbox_layer = Middleware(
        InboxMiddleware,
        inbox=inbox,
        methods=("POST",),
        max_body_bytes=core.MAX_BODY_BYTES,
        body_timeout_s=read_timeout_s,
    )
    return Starlette(
        routes=[
            Route("/health", _health, methods=["GET"]),
            Route("/{topic:path}", endpoint, methods=["POST"]),
        ],
        middleware=[inbox_layer],
        exception_handlers={errors.StorageError: _storage_error},
        lifespan=lifespan,
    )
