"""Serving the reference receiver with uvicorn: from the command line (:func:`serve`) or in-process
(:class:`ReceiverServer`, what ``RecordingDownstream`` runs).

What a hostile client meets is uvicorn's and h11's: requests are parsed by h11 (a malformed head or
``Content-Length`` is answered 400 and the connection closed), ``limit_concurrency`` answers 503 beyond
``max_connections`` connections or requests at once, ``timeout_keep_alive`` closes idle keep-alive
connections. The inbox middleware adds the rest: the body is read in full before any database work (a
client that closes mid-body never reaches the effect), within ``read_timeout_s`` (408 and closed after it),
and at most 1 MiB of it (413, unread). uvicorn has no timeout for a request *head* that trickles in: such
a client holds one of the ``max_connections`` slots until it finishes or leaves (put a reverse proxy with
header timeouts in front of a receiver that faces the internet).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import sqlalchemy as sa
import uvicorn
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette

from dagster_joblease import checks, errors
from dagster_joblease.inbox.aio import AsyncInbox
from dagster_joblease.inbox.core import DEFAULT_LOCK_MS
from dagster_joblease.inbox.sync import Inbox
from dagster_joblease.receiver.app import RequestLog, RequestLogMiddleware, build_app, ensure_tables
from dagster_joblease.storage.engine import create_engine, translate_errors
from dagster_joblease.storage.migrate import migrate as migrate_schema
from dagster_joblease.testing.faults import DropProxy, FaultMiddleware, Faults

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_READ_TIMEOUT_S",
    "HTTP_IMPLEMENTATIONS",
    "ReceiverOptions",
    "ReceiverServer",
    "listening_socket",
    "serve",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_IDLE_TIMEOUT_S = 15.0
DEFAULT_READ_TIMEOUT_S = 10.0
#: uvicorn's HTTP/1.1 implementations the receiver may run on (h11 by default: the one its tests cover).
HTTP_IMPLEMENTATIONS = ("h11", "httptools")
#: How long a request waits for a database connection from the receiver's pool before 503.
POOL_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class ReceiverOptions:
    """How a receiver serves (the ``joblease receiver`` flags)."""

    lock_ms: int = DEFAULT_LOCK_MS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    #: Purge answered keys older than this (seconds) every minute or so; None keeps them forever.
    retention_s: float | None = None
    http: str = "h11"
    faults: Faults = dataclasses.field(default_factory=Faults)
    #: [testing] Sleep inside the effect's transaction (keeps the key in flight).
    effect_delay_ms: int = 0

    def __post_init__(self) -> None:
        checks.integer("receiver max_connections", self.max_connections, minimum=1)
        for name in ("idle_timeout_s", "read_timeout_s"):
            checks.number(f"receiver {name}", getattr(self, name), above=0, maximum=3600)
        if self.retention_s is not None:
            checks.number("receiver retention_s", self.retention_s, above=0, none="no purge")
        if self.http not in HTTP_IMPLEMENTATIONS:
            raise errors.ConfigurationError(
                f"receiver http={self.http!r} is not one of {', '.join(HTTP_IMPLEMENTATIONS)}"
            )
        checks.milliseconds("effect_delay_ms", self.effect_delay_ms)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``(host, port)`` (port 0: a free one) for uvicorn's ``sockets=``.

    It is made with ``IPPROTO_TCP`` as its protocol, as asyncio's own ``create_server`` makes one:
    asyncio sets ``TCP_NODELAY`` on an accepted connection only when its socket says so, and
    ``socket.create_server`` says 0. Without ``TCP_NODELAY``, uvicorn's two writes of an answer (head, then
    body) meet Nagle's rule on a kept-alive connection: the body waits for the ACK of the head, which the
    client delays (~40 ms on Linux), so each request took ~45 ms on a connection that stays open.
    """
    family, kind, proto, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def _conninfo(engine: sa.Engine) -> tuple[str, dict[str, Any]]:
    """libpq connection string and psycopg options for ``engine``'s database (what its pool uses).

    The engine's own connection says whether statements may be prepared (``?prepare_threshold=none``
    in the URL, behind PgBouncer in transaction mode): the pool's connections follow it. A database out
    of reach at start-up leaves that unknown: then nothing is prepared (right behind any pooler), and the
    receiver starts anyway, answering 503 until the database is back.
    """
    _args, params = engine.dialect.create_connect_args(engine.url)
    params.pop("context", None)  # SQLAlchemy's adapters for its own connections, not a libpq option
    params.setdefault("connect_timeout", 10)
    threshold: int | None = None
    try:
        with translate_errors("connect to the receiver's database"), engine.connect() as conn:
            threshold = getattr(conn.connection.driver_connection, "prepare_threshold", None)
    except errors.StorageError as exc:
        logger.warning("the receiver starts without its database (statements will not be prepared): %s", exc)
    return psycopg.conninfo.make_conninfo("", **params), {"prepare_threshold": threshold}


class _Runtime:
    """One running receiver: its inbox, log, faults, proxy and uvicorn server, on one event loop."""

    def __init__(self, engine: sa.Engine, options: ReceiverOptions, *, proxy: bool) -> None:
        self.engine = engine
        self.options = options
        self.log = RequestLog(engine)
        self.pool: AsyncConnectionPool[Any] | None = None
        inbox: Inbox | AsyncInbox[Any]
        if engine.dialect.name == "postgresql":
            conninfo, kwargs = _conninfo(engine)
            self.pool = AsyncConnectionPool(
                conninfo,
                # autocommit: the inbox's transaction is its own BEGIN ... COMMIT, and it need not switch
                # each connection's mode for every request and back.
                kwargs={**kwargs, "autocommit": True},
                min_size=1,
                max_size=options.max_connections,
                timeout=POOL_TIMEOUT_S,
                open=False,
                name="joblease-receiver",
            )
            inbox = AsyncInbox(self.pool.connection, lock_ms=options.lock_ms)
        else:
            inbox = Inbox(engine, lock_ms=options.lock_ms)
        self.inbox = inbox
        self.proxy = DropProxy(("127.0.0.1", 0)) if proxy else None
        app = build_app(
            inbox,
            effect_delay_ms=options.effect_delay_ms,
            read_timeout_s=options.read_timeout_s,
            lifespan=self._lifespan,
        )
        self.faults = FaultMiddleware(app, options.faults, self.proxy)
        self.asgi = RequestLogMiddleware(self.faults, self.log)
        self.server: uvicorn.Server | None = None

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.pool is not None:
            await self.pool.open()
        async with anyio.create_task_group() as group:
            if self.options.retention_s is not None:
                group.start_soon(self._purge_forever, self.options.retention_s)
            try:
                yield
            finally:
                group.cancel_scope.cancel()
        if self.pool is not None:
            await self.pool.close()

    async def _purge_forever(self, retention_s: float) -> None:
        every_s = min(60.0, retention_s / 10)
        while True:
            try:
                if isinstance(self.inbox, Inbox):
                    purged = await anyio.to_thread.run_sync(self.inbox.purge, int(retention_s * 1000))
                else:
                    purged = await self.inbox.purge(int(retention_s * 1000))
                if purged:
                    logger.info("purged %d inbox keys answered more than %g s ago", purged, retention_s)
            except errors.StorageError as exc:
                logger.warning("could not purge old inbox keys (will retry): %s", exc)
            await anyio.sleep(every_s)

    async def run(self, host: str, port: int, on_ready: Callable[[str], None]) -> None:
        """Serve until :meth:`stop` (or, in the main thread, SIGTERM/SIGINT); ``on_ready`` gets the URL."""
        options = self.options
        inner_address = ("127.0.0.1", 0) if self.proxy is not None else (host, port)
        sock = listening_socket(*inner_address)
        config = uvicorn.Config(
            self.asgi,
            http=options.http,
            lifespan="on",
            log_config=None,
            access_log=False,
            limit_concurrency=options.max_connections,
            timeout_keep_alive=options.idle_timeout_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=2,
        )
        server = self.server = uvicorn.Server(config)
        try:
            serving = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started and not serving.done():
                await asyncio.sleep(0.01)
            if serving.done():
                await serving
                raise errors.ConfigurationError("the receiver stopped while starting (see its log)")
            url_host, url_port = sock.getsockname()[:2]
            if self.proxy is not None:
                self.proxy.target = (str(url_host), int(url_port))
                url_host, url_port = await self.proxy.start(host, port)
            on_ready(f"http://{url_host}:{url_port}")
            await serving
        finally:
            if self.proxy is not None:
                await self.proxy.close()
            sock.close()
            await anyio.to_thread.run_sync(self.log.close)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class ReceiverServer:
    """The reference receiver in this process, served by uvicorn from a thread of its own.

    ::

        migrate(engine)
        ensure_tables(engine)
        with ReceiverServer(engine) as server:
            ...  # POST to server.url + "/topic"

    Args:
        engine: a migrated engine (:func:`dagster_joblease.migrate`) holding the receiver's tables
            (:func:`ensure_tables`).
        address: ``(host, port)`` to listen on; port 0 picks a free port (see :attr:`url`).
        options: timeouts, bounds and static faults (:class:`ReceiverOptions`).
        proxy: serve behind a :class:`~dagster_joblease.testing.faults.DropProxy`, so
            :meth:`inject_next` can drop connections (``drop_after_apply``).
    """

    def __init__(
        self,
        engine: sa.Engine,
        address: tuple[str, int] = ("127.0.0.1", 0),
        options: ReceiverOptions | None = None,
        *,
        proxy: bool = False,
    ) -> None:
        self.engine = engine
        self.address = address
        self._runtime = _Runtime(
            engine,
            options or ReceiverOptions(),
            proxy=proxy or bool((options or ReceiverOptions()).faults.drop_first),
        )
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self._failure: BaseException | None = None

    def start(self) -> ReceiverServer:
        """Start serving; returns once the socket listens (raises what stopped it from starting)."""
        ready = threading.Event()

        def on_ready(url: str) -> None:
            self._url = url
            ready.set()

        def main() -> None:
            try:
                asyncio.run(self._runtime.run(*self.address, on_ready))
            except BaseException as exc:
                self._failure = exc
            finally:
                ready.set()

        self._thread = threading.Thread(target=main, name="joblease-receiver", daemon=True)
        self._thread.start()
        ready.wait()
        if self._url is None:
            self.close()
            raise errors.ConfigurationError(
                f"the receiver did not start: {self._failure!r}"
            ) from self._failure
        return self

    def close(self) -> None:
        """Stop serving (requests in flight get 2 s), flush the request log and close the pool."""
        self._runtime.stop()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def __enter__(self) -> ReceiverServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        if self._url is None:
            raise errors.ConfigurationError("the receiver is not running: call start()")
        return self._url

    def inject_next(self, n: int, fault: str, *, status: int = 500, seconds: float = 0.0) -> None:
        """Make the next ``n`` POSTs take ``fault`` (see :meth:`FaultMiddleware.inject_next`)."""
        self._runtime.faults.inject_next(n, fault, status=status, seconds=seconds)

    def flush_log(self) -> None:
        """Block until every POST received so far is in the request log (see :func:`request_count`)."""
        self._runtime.log.flush()


def serve(
    database: str | sa.Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: ReceiverOptions | None = None,
    migrate: bool = True,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Run the receiver in this thread until SIGTERM/SIGINT (the ``joblease receiver`` command).

    ``database`` is a URL or an engine. With ``migrate`` the package's schema (the inbox table) is
    installed or upgraded first; the receiver's own tables are created when missing either way.
    ``on_ready`` gets the base URL once the socket listens (port 0 picks a free port).
    """
    engine = create_engine(database) if isinstance(database, str) else database
    options = options or ReceiverOptions()
    try:
        if migrate:
            migrate_schema(engine)
        ensure_tables(engine)
        runtime = _Runtime(engine, options, proxy=bool(options.faults.drop_first))
        # uvicorn re-raises the signal that stopped it once it has shut down, after putting back the
        # handlers it found: make those no-ops, so a SIGTERM ends the command with exit code 0.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            with translate_errors("serve the receiver"):
                asyncio.run(runtime.run(host, port, on_ready or (lambda url: None)))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if isinstance(database, str):
            engine.dispose()
