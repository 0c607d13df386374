"""A small reference downstream: an HTTP receiver that applies each ``Idempotency-Key`` once, via the inbox.

It answers as the IETF ``Idempotency-Key`` draft asks: 400 without the header, 409 while the same key is
in flight, 422 for the same key with another payload, and the first response again on a replay (with
``Idempotent-Replayed: true``). Its effect is one row per key in ``joblease_receiver_effect``, written in
the inbox's transaction; every POST it receives is logged in ``joblease_receiver_request`` so tests and
the demo can count deliveries against effects.

The fault options (:class:`Faults`) are testing aids: they make the receiver fail, hang, drop connections
or reject a topic, so the dispatcher's retry and dead-letter paths can be exercised against a real server.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa

from dagster_joblease import errors, inbox
from dagster_joblease.storage.clock import db_now
from dagster_joblease.storage.engine import create_engine, translate_errors
from dagster_joblease.storage.migrate import migrate as migrate_schema

__all__ = [
    "FAULT_KINDS",
    "MAX_BODY_BYTES",
    "Faults",
    "ReceiverServer",
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


def ensure_tables(engine: sa.Engine) -> None:
    """Create the receiver's tables if missing; safe when several receivers start at once."""
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
    """How many POSTs the receiver received (faulted ones included), optionally for one key."""
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
        lock_ms: the inbox's claim lock (how long a crashed request keeps its key busy).
    """

    daemon_threads = True

    def __init__(
        self,
        engine: sa.Engine,
        address: tuple[str, int] = ("127.0.0.1", 0),
        faults: Faults | None = None,
        lock_ms: int = inbox.DEFAULT_LOCK_MS,
    ) -> None:
        self.engine = engine
        self.inbox = inbox.Inbox(engine, lock_ms=lock_ms)
        self.faults = faults or Faults()
        self._counter = 0
        self._counter_lock = threading.Lock()
        self._injected: collections.deque[_Injected] = collections.deque()
        super().__init__(address, _Handler)

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

    def flush_log(self) -> None:
        """Block until every POST received so far is in the request log (see :func:`request_count`)."""

    def log_received(self, key: str | None, topic: str) -> int:
        t = request_table
        with translate_errors("log a received request"), self.engine.begin() as conn:
            return int(
                conn.execute(
                    t.insert()
                    .values(idempotency_key=key, topic=topic, received_at=db_now())
                    .returning(t.c.id)
                ).scalar_one()
            )

    def log_status(self, request_id: int, status_code: int) -> None:
        t = request_table
        with translate_errors("log a response status"), self.engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.id == request_id).values(status_code=status_code))


def _problem(status: int, title: str, detail: str) -> bytes:
    return json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()


@dataclasses.dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    applied: bool = False


def _problem_answer(
    status: int, title: str, detail: str, headers: Mapping[str, str] | None = None
) -> _Answer:
    return _Answer(status, _problem(status, title, detail), "application/problem+json", headers or {})


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle's algorithm on, keep-alive clients wait ~40 ms
    # for a delayed ACK on every request.
    disable_nagle_algorithm = True
    server: ReceiverServer

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _send(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except ConnectionError:
            # The client gave up (a timeout) before the answer; the request log still records it.
            self.close_connection = True

    def _send_problem(self, status: int, title: str, detail: str, **headers: str) -> int:
        self._send(
            status, _problem(status, title, detail), content_type="application/problem+json", headers=headers
        )
        return status

    def do_GET(self) -> None:
        if urlsplit(self.path).path == "/health":
            self._send(200, b'{"status":"ok"}')
        else:
            self._send_problem(404, "Not Found", "GET /health is the only GET; POST to /<topic>")

    def do_POST(self) -> None:
        length_header = self.headers.get("Content-Length")
        if length_header is None or not length_header.strip().isdigit():
            self.close_connection = True
            self._send_problem(411, "Length Required", "send the body with a Content-Length header")
            return
        length = int(length_header)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send_problem(
                413, "Content Too Large", f"the body is {length} bytes; at most {MAX_BODY_BYTES}"
            )
            return
        body = self.rfile.read(length)
        topic = urlsplit(self.path).path.lstrip("/")
        raw_key = self.headers.get("Idempotency-Key")
        ordinal, injected = self.server.next_ordinal()
        try:
            request_id = self.server.log_received(raw_key, topic)
        except errors.StorageError as exc:
            self._send_problem(503, "Service Unavailable", str(exc), **{"Retry-After": "1"})
            return
        status = self._respond(ordinal, injected, topic, raw_key, body)
        if status is not None:
            try:
                self.server.log_status(request_id, status)
            except errors.StorageError:
                logger.warning("could not log the status of request %d", request_id)

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
            result = self.server.inbox.process(key, body, self._effect(key, topic, body))
        except errors.InboxConflictError as exc:
            return _problem_answer(422, "Idempotency-Key reused with another payload", str(exc))
        except errors.InboxInProgressError as exc:
            # Retry-After: when the in-flight claim ends at the latest (a crashed consumer's claim included).
            wait_s = 1 if exc.retry_after_ms is None else max(1, math.ceil(exc.retry_after_ms / 1000))
            return _problem_answer(409, "Request in progress", str(exc), {"Retry-After": str(wait_s)})
        except errors.StorageError as exc:
            return _problem_answer(503, "Service Unavailable", str(exc), {"Retry-After": "1"})
        except Exception as exc:
            logger.exception("the receiver's effect failed for key %r", key)
            return _problem_answer(500, "Internal Server Error", f"{type(exc).__name__}; retry later")
        headers = {REPLAYED_HEADER: "true"} if result.replayed else {}
        return _Answer(
            result.status_code, result.body.encode("utf-8"), headers=headers, applied=not result.replayed
        )

    def _effect(self, key: str, topic: str, body: bytes) -> inbox.Effect:
        delay_ms = self.server.faults.effect_delay_ms
        text = body.decode("utf-8", "replace").replace("\x00", "\ufffd")

        def apply(conn: sa.Connection) -> tuple[int, str]:
            if delay_ms:
                time.sleep(delay_ms / 1000)
            conn.execute(
                effect_table.insert().values(
                    idempotency_key=key, topic=topic, payload=text, applied_at=db_now()
                )
            )
            return 200, json.dumps({"applied": True, "key": key, "topic": topic})

        return apply


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
) -> None:
    """Run the receiver until ``stop`` is set (or SIGTERM/SIGINT, when called from the main thread).

    ``database`` is a URL or an engine. With ``migrate`` the package's schema (the inbox table) is
    installed or upgraded first; the receiver's own tables are always created if missing. ``on_ready``
    gets the base URL once the socket listens (port 0 picks a free port).
    """
    engine = create_engine(database) if isinstance(database, str) else database
    stop = stop or threading.Event()
    try:
        if migrate:
            migrate_schema(engine)
        ensure_tables(engine)
        server = ReceiverServer(engine, (host, port), faults or Faults(), lock_ms)
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
