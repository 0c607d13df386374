"""The inbox as pure ASGI middleware: mount it on Starlette, FastAPI or any ASGI app.

For the paths and methods it is configured for, :class:`InboxMiddleware` reads the ``Idempotency-Key``
(bare or the IETF draft's sf-string) and the optional ``Fencing-Token``, reads the whole body, fingerprints
the request (method, path and body by default) and then, in one inbox transaction:

- a new key: calls the app, with the transaction's connection in the request (:func:`inbox_connection`),
  and stores its status, the headers it names and its body; answers what the app answered;
- a key already answered: replays the stored status, headers and body with ``Idempotent-Replayed: true``;
- a key in flight: 409; the key with another request: 422; a fencing token lower than one already accepted
  for the key: 409 (stale); a missing (where required) or malformed key: 400.

What is guaranteed depends on where the app writes:

- **through the inbox's transaction** (:func:`inbox_connection`): the effect and the stored answer commit
  together or not at all. A key is applied at most once, a crash at any point leaves it new, and every
  repeat gets the first answer.
- **elsewhere** (its own session, another service): concurrent repeats still get 409 while the first runs,
  and a repeat after a stored answer is replayed without calling the app. But the app's commit and the
  inbox's are two: if the process dies, or the inbox's commit fails, after the app committed, the key is
  not recorded and the next delivery runs the app again. On SQLite the inbox's transaction holds the
  database's write lock while the app runs, so the app's own writes to that same file wait and time out:
  write through the inbox's connection there.

The transaction ends when the app's answer is complete (its last body chunk): the answer is stored and
sent, and what the app does after that (FastAPI's and Starlette's background tasks) runs outside the
transaction, covered by none of the above. On SQLite the requests take turns on the event loop (one
writer at a time) before any worker thread is taken.

Answers a sender retries (5xx, 408, 409, 425, 429: :func:`dagster_joblease.wire.is_retryable_status`) are
not stored: the transaction rolls back (with anything the app wrote through it) and the answer goes out
as it is, so the retry runs the app again. Raise ``store_status`` to change that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar

from dagster_joblease import checks, errors, tracing, wire
from dagster_joblease.inbox import core
from dagster_joblease.inbox.aio import AsyncInbox, AsyncInboxTransaction
from dagster_joblease.inbox.core import Answer, InboxResult
from dagster_joblease.inbox.sync import Inbox, InboxTransaction
from dagster_joblease.storage.engine import SQLITE_BUSY_TIMEOUT_MS

__all__ = [
    "ASGIApp",
    "InboxMiddleware",
    "Message",
    "Receive",
    "RequestParts",
    "Scope",
    "Send",
    "fingerprint_request",
    "inbox_connection",
]

logger = logging.getLogger(__name__)

#: The ASGI types (as the spec defines them; Starlette's are the same shapes).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Where the request's inbox transaction sits in ``scope["state"]`` (Starlette: ``request.state``).
STATE_KEY = "dagster_joblease.inbox"
DEFAULT_METHODS = ("POST", "PATCH")
DEFAULT_STORED_HEADERS = ("content-type", "location")
#: Framing and per-connection headers: never stored (a replay gets its own).
_UNSTORABLE = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date"})
_KEY_HEADER = wire.IDEMPOTENCY_KEY.lower().encode()
_FENCE_HEADER = wire.FENCING_TOKEN.lower().encode()
#: Server features that would let an answer bypass the body the inbox must see and store.
_BYPASSING_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopy")
#: On an answer sent before the body was read: the stream is out of step, so the server closes it.
_CLOSE = (b"connection", b"close")


class RequestParts(NamedTuple):
    """What a ``fingerprint`` function sees of a request."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


def fingerprint_request(parts: RequestParts) -> str:
    """The default fingerprint: SHA-256 of the method, the path and the body (a JSON body in canonical
    form, so key order and whitespace do not matter; see :func:`request_fingerprint`)."""
    line = f"{parts.method} {parts.path}\n{core.request_fingerprint(parts.body)}"
    return hashlib.sha256(line.encode("utf-8", "surrogatepass")).hexdigest()


def inbox_connection(request: Any) -> Any:
    """The inbox transaction's connection for this request (a Starlette/FastAPI ``Request`` or an ASGI
    scope): write the effect on it, and it commits together with the stored answer.

    It is a SQLAlchemy ``Connection`` under a sync :class:`Inbox`, and what the :class:`AsyncInbox` was
    built on under an async one (SQLAlchemy ``AsyncConnection`` or psycopg ``AsyncConnection``).

    Raises:
        ConfigurationError: the request did not go through :class:`InboxMiddleware` as a new key.
    """
    scope = getattr(request, "scope", request)
    tx = scope.get("state", {}).get(STATE_KEY) if isinstance(scope, MutableMapping) else None
    if tx is None:
        raise errors.ConfigurationError(
            "this request has no inbox transaction: it did not pass through InboxMiddleware (check the "
            "middleware's paths and methods), or it carried no Idempotency-Key where none is required"
        )
    return tx.connection


def problem_json(status: int, title: str, detail: str, **extra: Any) -> bytes:
    """An RFC 9457 problem document (``application/problem+json``) as bytes: the one spelling of every
    problem answer the inbox, the reference receiver and the testing kit's fault injector send."""
    document = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    return json.dumps(document).encode()


def _path_rule(paths: Iterable[str] | None) -> tuple[frozenset[str] | None, tuple[str, ...]]:
    """Exact paths and prefixes (``/hooks/*``); None for every path."""
    if paths is None:
        return None, ()
    listed = [paths] if isinstance(paths, str) else list(paths)
    return frozenset(p for p in listed if not p.endswith("*")), tuple(
        p[:-1] for p in listed if p.endswith("*")
    )


def _stored_headers(names: Iterable[str]) -> frozenset[bytes]:
    stored = {name.lower() for name in names}
    bad = sorted(stored & _UNSTORABLE)
    if bad:
        raise errors.ConfigurationError(
            f"stored_headers may not name {', '.join(bad)}: a replay sets its own framing headers"
        )
    return frozenset(name.encode("latin-1") for name in stored)


def _check_max_body(value: object) -> int:
    return checks.integer("max_body_bytes", value, minimum=1, maximum=core.MAX_BODY_BYTES)


def _check_wait_in_flight(value: object) -> int:
    return checks.milliseconds("wait_in_flight_ms", value, maximum=60_000, why="0 answers 409 at once")


def _check_body_timeout(value: object) -> float:
    if value is None:
        return math.inf
    return checks.number("body_timeout_s", value, above=0, maximum=3600, none="no timeout")


class _Refusal(Exception):
    """An answer the middleware gives itself (400, 409, 413, 422, 503), without calling the app."""

    def __init__(self, status: int, title: str, detail: str, *headers: tuple[bytes, bytes], **extra: Any):
        super().__init__(detail)
        self.status = status
        self.body = problem_json(status, title, detail, **extra)
        self.headers = [(b"content-type", b"application/problem+json"), *headers]


def _too_large(limit: int) -> _Refusal:
    return _Refusal(413, "Content Too Large", f"the body may be at most {limit} bytes", _CLOSE)


def _refusal_for(exc: errors.JobLeaseError) -> _Refusal:
    if isinstance(exc, errors.InboxStaleFenceError):
        return _Refusal(
            409,
            "Stale fencing token",
            str(exc),
            fencing_token=exc.fence,
            accepted_fencing_token=exc.accepted_fence,
        )
    if isinstance(exc, errors.InboxInProgressError):
        wait_s = 1 if exc.retry_after_ms is None else max(1, math.ceil(exc.retry_after_ms / 1000))
        return _Refusal(409, "Request in progress", str(exc), (b"retry-after", str(wait_s).encode()))
    if isinstance(exc, errors.InboxConflictError):
        first = {"first_request_fingerprint": exc.first_fingerprint, "first_seen_at": exc.first_seen}
        return _Refusal(
            422,
            "Idempotency-Key reused with another request",
            str(exc),
            **{name: value for name, value in first.items() if value is not None},
        )
    if isinstance(exc, errors.StorageError):
        # The driver's text can name hosts, ports and users: it goes to the log, never to clients.
        logger.warning("the inbox's database failed: %s", exc)
        return _Refusal(
            503,
            "Service Unavailable",
            "the inbox cannot reach its database; retry later",
            (b"retry-after", b"1"),
        )
    raise exc


class _Captured:
    """The app's answer, held back until the inbox has committed (or decided not to store it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.too_large = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif kind == "http.response.body" and not self.complete:
            body = bytes(message.get("body", b""))
            self.size += len(body)
            if self.size > self.limit:
                self.too_large = True
            else:
                self.chunks.append(body)
            self.complete = not message.get("more_body", False)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class InboxMiddleware:
    """Apply each ``Idempotency-Key`` once, in the app's own request path (see the module docstring).

    Args:
        app: the ASGI app to wrap.
        inbox: an :class:`Inbox` (PostgreSQL or SQLite; run in worker threads) or an :class:`AsyncInbox`
            (PostgreSQL).
        paths: the paths it applies to, each exact (``"/orders"``) or a prefix ending in ``*``
            (``"/hooks/*"``); default every path.
        methods: the methods it applies to (default POST and PATCH, the non-idempotent ones).
        require_key: answer 400 to a request without the key (default); False lets it through untouched.
        fingerprint: how a request is told from another under one key (default
            :func:`fingerprint_request`: method, path, body).
        stored_headers: the answer's headers kept and replayed (default Content-Type and Location).
        max_body_bytes: the largest request body read (a larger one gets 413 unread) and the largest
            answer body stored (a larger answer rolls back and gets 500).
        store_status: which answers are stored (default: all but the ones a sender retries).
        body_timeout_s: the longest a request's body may take to arrive (408 and closed after it);
            default none. The body is read before any database work, so a slow client holds no
            connection meanwhile.
        key_scope: whose key it is: a function of the request's ASGI scope returning the caller's
            identity (an authenticated principal, a tenant, a client certificate's subject) or None.
            The same key from two callers is then two records: neither can replay, block (409) or probe
            (422) the other's. An API that several callers share must set it. Default: one namespace.
        wait_in_flight_ms: a request whose key is in flight waits up to this long for the first one to
            finish and gets its answer replayed (or applies the key, if the first rolled back), instead
            of 409 at once; 409 with Retry-After when the key is still in flight then. Default 0 (no
            wait); at most 60,000. Each waiting request holds its HTTP connection, not a database one.
    """

    def __init__(
        self,
        app: ASGIApp,
        inbox: Inbox | AsyncInbox[Any],
        *,
        paths: Iterable[str] | None = None,
        methods: Iterable[str] = DEFAULT_METHODS,
        require_key: bool = True,
        fingerprint: Callable[[RequestParts], str] = fingerprint_request,
        stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
        max_body_bytes: int = core.MAX_BODY_BYTES,
        store_status: Callable[[int], bool] | None = None,
        body_timeout_s: float | None = None,
        key_scope: Callable[[Scope], str | None] | None = None,
        wait_in_flight_ms: int = 0,
    ) -> None:
        if not isinstance(inbox, Inbox | AsyncInbox):
            raise errors.ConfigurationError(
                f"InboxMiddleware needs an Inbox or an AsyncInbox, got {type(inbox).__name__}"
            )
        self.app = app
        self.inbox = inbox
        self.methods = frozenset(m.upper() for m in methods)
        self._exact, self._prefixes = _path_rule(paths)
        self.require_key = require_key
        self.fingerprint = fingerprint
        self.stored_headers = _stored_headers(stored_headers)
        self.max_body_bytes = _check_max_body(max_body_bytes)
        self.body_timeout_s = _check_body_timeout(body_timeout_s)
        self.store_status = store_status or (lambda status: not wire.is_retryable_status(status))
        if key_scope is not None and not callable(key_scope):
            raise errors.ConfigurationError(
                f"key_scope={key_scope!r:.80} must be a function of the request scope"
            )
        self.key_scope = key_scope
        self.wait_in_flight_s = _check_wait_in_flight(wait_in_flight_ms) / 1000

    def _applies(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            return False
        if self._exact is None:
            return True
        path = scope["path"]
        return path in self._exact or path.startswith(self._prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._applies(scope):
            await self.app(scope, receive, send)
            return
        try:
            key, fence = self._read_headers(scope)
            if key is None:
                await self.app(scope, receive, send)
                return
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client went away before the whole body came: nothing applied
            parts = RequestParts(
                scope["method"], scope["path"], scope.get("query_string", b""), scope["headers"], body
            )
            tx = self.inbox.transaction(key, self.fingerprint(parts), fence, scope=self._scope_of(scope))
            turn = await _Turn.take(self.inbox)
            try:
                replay = await self._begin(tx)
            except BaseException:
                turn.release()
                raise
        except _Refusal as refusal:
            await _send(send, refusal.status, refusal.headers, refusal.body)
            return
        if replay is not None:
            turn.release()
            await _send_result(send, replay)
            return
        # The effect continues the producer's trace (the request's traceparent/tracestate), if it has one.
        with tracing.processing(scope["path"], scope["headers"], idempotency_key=key):
            await self._apply(tx, turn, scope, body, receive, send)

    def _scope_of(self, scope: Scope) -> str | None:
        if self.key_scope is None:
            return None
        try:
            return core.check_scope(self.key_scope(scope))
        except errors.InvalidInboxInputError as exc:
            # The app's own function is wrong: nothing the client can fix.
            raise errors.ConfigurationError(f"InboxMiddleware's key_scope: {exc}") from None

    def _read_headers(self, scope: Scope) -> tuple[str | None, int | None]:
        keys = [value for name, value in scope["headers"] if name == _KEY_HEADER]
        fences = [value for name, value in scope["headers"] if name == _FENCE_HEADER]
        if not keys:
            if self.require_key:
                raise _Refusal(
                    400, "Missing Idempotency-Key", "this endpoint requires an Idempotency-Key header"
                )
            return None, None
        if len(keys) > 1 or len(fences) > 1:
            raise _Refusal(
                400, "Invalid Idempotency-Key", "send one Idempotency-Key (and at most one Fencing-Token)"
            )
        try:
            key = core.validate_idempotency_key(wire.parse_key(keys[0].decode("latin-1")))
            fence = wire.parse_fence(fences[0].decode("latin-1")) if fences else None
        except errors.InvalidInboxInputError as exc:
            title = "Invalid Fencing-Token" if exc.field == "fencing token" else "Invalid Idempotency-Key"
            raise _Refusal(400, title, str(exc)) from None
        return key, fence

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, read before any database work (a slow client holds no connection), or None
        when the client went away first. Too large: 413; slower than ``body_timeout_s``: 408."""
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name != b"content-length":
                continue
            # Compare the digits before converting: a 5,000-digit value is a 413, not a ValueError.
            digits = value.strip().lstrip(b"0")
            if digits.isdigit() and (len(digits) > 18 or int(digits) > limit):
                raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.body_timeout_s) as deadline:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        assert deadline.cancelled_caught
        raise _Refusal(
            408, "Request Timeout", f"the body did not arrive within {self.body_timeout_s:g} s", _CLOSE
        )

    async def _begin(self, tx: InboxTransaction | AsyncInboxTransaction[Any]) -> InboxResult | None:
        """Begin the key's transaction; while the key is in flight, look again (backing off from 10 ms to
        200 ms) until ``wait_in_flight_ms`` has passed, then refuse with 409."""
        deadline = anyio.current_time() + self.wait_in_flight_s
        delay = 0.01
        while True:
            try:
                if isinstance(tx, InboxTransaction):
                    return await anyio.to_thread.run_sync(tx.begin)
                return await tx.begin()
            except errors.InboxInProgressError as exc:
                if anyio.current_time() + delay > deadline:
                    raise _refusal_for(exc) from None
            except errors.JobLeaseError as exc:
                raise _refusal_for(exc) from None
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _end(
        self, tx: InboxTransaction | AsyncInboxTransaction[Any], answer: Answer | None, turn: _Turn
    ) -> InboxResult | None:
        """Commit ``answer`` (its result) or, for None, roll back; never cancelled half-way. The
        database's turn (SQLite) passes on either way."""
        result: InboxResult | None = None
        with anyio.CancelScope(shield=True):
            try:
                if isinstance(tx, InboxTransaction):
                    if answer is None:
                        await anyio.to_thread.run_sync(tx.rollback)
                    else:
                        result = await anyio.to_thread.run_sync(tx.commit, answer)
                elif answer is None:
                    await tx.rollback()
                else:
                    result = await tx.commit(answer)
            finally:
                turn.release()
        return result

    async def _apply(
        self,
        tx: InboxTransaction | AsyncInboxTransaction[Any],
        turn: _Turn,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
    ) -> None:
        """Call the app on the request's own scope (what it sets in ``request.state``, and the router's
        ``route`` and ``path_params``, reach the middlewares around this one) with the transaction in its
        state. The answer is held back until its last body chunk; then the transaction ends and the answer
        goes out, before the app's background work (which runs after, outside the key's transaction)."""
        answering = _Answering(self, tx, turn, send)
        state = scope.setdefault("state", {})
        state[STATE_KEY] = tx
        extensions = scope.get("extensions")
        if extensions:
            scope["extensions"] = {k: v for k, v in extensions.items() if k not in _BYPASSING_EXTENSIONS}
        delivered = False

        async def replay_body() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay_body, answering.send)
        except BaseException:
            if not answering.ended:
                await self._end(tx, None, turn)
            raise
        finally:
            state.pop(STATE_KEY, None)
            if extensions:
                scope["extensions"] = extensions
        if not answering.ended:
            await self._end(tx, None, turn)
            raise RuntimeError(
                "the app returned without a complete answer; the inbox rolled back its transaction"
            )

    async def _answer(
        self,
        tx: InboxTransaction | AsyncInboxTransaction[Any],
        turn: _Turn,
        captured: _Captured,
        send: Send,
    ) -> None:
        """End the transaction for the app's complete answer (store and commit it, or roll back) and send
        the client what the inbox decided."""
        assert captured.status is not None
        if captured.too_large:
            await self._end(tx, None, turn)
            logger.error(
                "the answer for key %r is over %d bytes: not stored, rolled back", tx.key, self.max_body_bytes
            )
            detail = (
                f"the answer was larger than the inbox stores ({self.max_body_bytes} bytes); "
                "nothing was applied"
            )
            await _send(
                send,
                500,
                [(b"content-type", b"application/problem+json")],
                problem_json(500, "Answer too large", detail),
            )
            return
        if not self.store_status(captured.status):
            await self._end(tx, None, turn)
            await _send(send, captured.status, captured.headers, captured.body)
            return
        stored = tuple(
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in captured.headers
            if name.lower() in self.stored_headers
        )
        try:
            result = await self._end(tx, Answer(captured.status, captured.body, stored), turn)
        except errors.JobLeaseError as exc:
            refusal = _refusal_for(exc)
            await _send(send, refusal.status, refusal.headers, refusal.body)
            return
        assert result is not None
        if result.replayed:  # another transaction recorded the key first: this one rolled back
            await _send_result(send, result)
        else:
            await _send(send, captured.status, captured.headers, captured.body)


class _Answering:
    """The ``send`` the app gets: holds its answer back and, at its last body chunk, has the middleware
    end the transaction and answer the client. What the app does after that (Starlette's and FastAPI's
    background tasks) runs outside the transaction, with the answer already sent."""

    def __init__(
        self,
        middleware: InboxMiddleware,
        tx: InboxTransaction | AsyncInboxTransaction[Any],
        turn: _Turn,
        send: Send,
    ) -> None:
        self.middleware = middleware
        self.tx = tx
        self.turn = turn
        self.client_send = send
        self.captured = _Captured(middleware.max_body_bytes)
        self.ended = False

    async def send(self, message: Message) -> None:
        if self.ended:
            raise RuntimeError(f"the app sent {message.get('type')!r} after its complete answer")
        await self.captured.send(message)
        if self.captured.complete and self.captured.status is not None:
            self.ended = True
            await self.middleware._answer(self.tx, self.turn, self.captured, self.client_send)


#: SQLite: per event loop, one turn per database file (see :class:`_Turn`).
_SQLITE_TURNS: RunVar[dict[str, anyio.Semaphore]] = RunVar("dagster_joblease.inbox.sqlite_turns")


class _Turn:
    """A request's turn to hold a SQLite database's write lock, taken on the event loop before a worker
    thread is; a no-op for PostgreSQL.

    SQLite has one writer at a time (the inbox's transactions begin ``IMMEDIATE``). Waiting for that lock
    inside worker threads let a burst larger than the thread pool take every thread, while the request
    holding the lock needed one more thread for its endpoint and its commit: all waited out SQLite's busy
    timeout. Taking turns here first costs no concurrency SQLite would have allowed, holds no thread while
    waiting, and is bounded by the same busy timeout (then 503 with Retry-After, as for a busy database).
    """

    def __init__(self, semaphore: anyio.Semaphore | None) -> None:
        self._semaphore = semaphore

    @classmethod
    async def take(cls, inbox: Inbox | AsyncInbox[Any]) -> _Turn:
        if not isinstance(inbox, Inbox) or inbox.dialect_name != "sqlite":
            return cls(None)
        try:
            turns = _SQLITE_TURNS.get()
        except LookupError:
            turns = {}
            _SQLITE_TURNS.set(turns)
        semaphore = turns.setdefault(str(inbox.engine.url), anyio.Semaphore(1))
        with anyio.move_on_after(SQLITE_BUSY_TIMEOUT_MS / 1000):
            await semaphore.acquire()
            return cls(semaphore)
        raise _Refusal(
            503,
            "Service Unavailable",
            "the inbox's SQLite database stayed busy with other requests; retry later",
            (b"retry-after", b"1"),
        )

    def release(self) -> None:
        """Pass the turn on (once; later calls do nothing)."""
        semaphore, self._semaphore = self._semaphore, None
        if semaphore is not None:
            semaphore.release()


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    framed = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
    framed.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": framed})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_result(send: Send, result: InboxResult) -> None:
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in result.headers]
    headers.append((wire.IDEMPOTENT_REPLAYED.lower().encode(), b"true"))
    await _send(send, result.status_code, headers, result.content)
