"""The real brokers for the transport tests: NATS with JetStream and RabbitMQ, and a TCP proxy to put in
front of one to make it "down" (connections refused), cut (connections broken) or stalled (bytes held:
acknowledgements never come in time) without touching the shared service.

A broker is required when its URL variable is set (``.ci/run`` sets both) or when ``CI=true``: absent, its
tests fail. Otherwise an absent broker skips them, saying which.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from dagster_joblease import outbox
from dagster_joblease.dispatch import Dispatcher
from dagster_joblease.storage.schema import outbox_table
from tests.dispatch_workers import status_counts

NATS_URL_ENV = "JOBLEASE_TEST_NATS_URL"
AMQP_URL_ENV = "JOBLEASE_TEST_AMQP_URL"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_AMQP_URL = "amqp://127.0.0.1:5672/"


def broker_url(env: str, default: str, what: str) -> str:
    """The broker's URL; skip when it is not reachable (fail when it must be: its variable set, or CI)."""
    raw = os.environ.get(env, "").strip()
    url = raw or default
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), timeout=2):
            pass
    except OSError as exc:
        reason = f"{what} is not reachable at {url} ({exc}); set ${env} to where it runs"
        if raw or os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"{reason}; ${env} or CI=true requires the {what} tests", pytrace=False)
        pytest.skip(reason)
    return url


def enqueue(engine: sa.Engine, count: int, prefix: str = "v2:ev", keyed: bool = False) -> list[str]:
    """``count`` rows of topic ``events``; ``keyed``: ordering keys acct-0..2 in turn (then a key's rows
    are sent one at a time, in order)."""
    keys = [f"{prefix}-{i:04d}" for i in range(count)]
    with engine.begin() as conn:
        for i, key in enumerate(keys):
            ordering = f"acct-{i % 3}" if keyed else None
            outbox.enqueue_once(
                conn, idempotency_key=key, topic="events", payload={"n": i}, ordering_key=ordering
            )
    return keys


def rows(engine: sa.Engine) -> dict[str, Any]:
    """The outbox rows by idempotency key."""
    t = outbox_table
    with engine.connect() as conn:
        return {r.idempotency_key: r for r in conn.execute(sa.select(t))}


def drain(dispatcher: Dispatcher, engine: sa.Engine, timeout: float = 60.0) -> None:
    """Dispatch until no row is PENDING; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while status_counts(engine).get("PENDING", 0):
        assert time.monotonic() < deadline, f"rows still pending: {status_counts(engine)}"
        if dispatcher.dispatch(500).claimed == 0:
            time.sleep(0.02)


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


class TcpProxy:
    """A TCP proxy to ``target`` on a thread of its own, listening on a fixed local port.

    ``down()`` closes the listener and breaks every connection (a client then sees connection refused);
    ``up()`` listens on the same port again. ``stall()`` holds every byte the broker sends until
    ``unstall()``: requests reach the broker, their acknowledgements wait, then flow on.
    """

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", int(parts.port or 0))
        self.scheme = parts.scheme
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self.loop.call_soon_threadsafe(self._flowing.set)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.up()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def up(self) -> None:
        async def listen() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

        self._call(listen())

    def down(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

        self._call(close())

    def stall(self) -> None:
        self.loop.call_soon_threadsafe(self._flowing.clear)

    def unstall(self) -> None:
        self.loop.call_soon_threadsafe(self._flowing.set)

    def close(self) -> None:
        self.unstall()
        self.down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer, False), self._pump(up_reader, writer, True))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, replies: bool) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                if replies:
                    await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        writer.transport.abort()


@contextlib.contextmanager
def proxy_to(target: str) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()
