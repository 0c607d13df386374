"""Faults for a real downstream: an ASGI middleware for answers, a TCP proxy for dropped connections.

:class:`FaultMiddleware` wraps any ASGI app (the reference receiver's, or yours): static faults for the
first N POSTs (:class:`Faults`, the receiver's ``--fail-first`` and friends) and faults queued for the next
N (:meth:`FaultMiddleware.inject_next`): fail with a status, apply and answer late, apply and drop the
connection. An ASGI app cannot close its client's connection without a byte, so dropping is
:class:`DropProxy`'s job: a small TCP proxy in front of the server, on the same event loop, that closes the
client's side of a connection when the middleware asks (by the server-side address the app sees as the
request's ``client``). The sender then sees a broken connection with no answer, as after a crash.

Nothing here is imported by the library's core; it needs only the standard library and anyio.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from collections.abc import Mapping
from typing import Any

import anyio

from dagster_joblease import checks, errors
from dagster_joblease.inbox.asgi import ASGIApp, Message, Receive, Scope, Send, problem_json

__all__ = ["DROPPED", "FAULT_KINDS", "DropProxy", "FaultMiddleware", "Faults"]

logger = logging.getLogger(__name__)


#: The faults :meth:`FaultMiddleware.inject_next` knows.
FAULT_KINDS = ("fail", "drop_after_apply", "slow")
#: Set in the scope of a request whose connection was dropped (its answer never left).
DROPPED = "dagster_joblease.dropped"


@dataclasses.dataclass(frozen=True)
class Faults:
    """Static faults. The "first N" counters count POSTs in arrival order, per process.

    Combined, they apply in sequence: the first ``drop_first`` POSTs are dropped (nothing applied, no
    answer), the next ``hang_first`` hang ``hang_ms`` then get 503, the next ``fail_first`` get
    ``fail_status``; later POSTs are served normally. ``always_status`` answers every POST to a topic (the
    path without its leading ``/``) with a status, applying nothing. ``delay_after_apply_ms`` answers late
    after a committed effect.
    """

    fail_first: int = 0
    fail_status: int = 500
    hang_first: int = 0
    hang_ms: int = 30_000
    drop_first: int = 0
    always_status: Mapping[str, int] = dataclasses.field(default_factory=dict)
    delay_after_apply_ms: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_first", "hang_first", "hang_ms", "drop_first", "delay_after_apply_ms"):
            value = getattr(self, name)
            checks.integer(f"receiver fault {name}", value, minimum=0)
        for topic, status in {"": self.fail_status, **self.always_status}.items():
            checks.integer(f"receiver fault status (topic {topic!r})", status, minimum=100, maximum=599)

    def fault_for(self, ordinal: int) -> str | None:
        """Which "first N" fault applies to the ``ordinal``-th POST (1-based): drop, hang, fail or none."""
        if ordinal <= self.drop_first:
            return "drop"
        if ordinal <= self.drop_first + self.hang_first:
            return "hang"
        if ordinal <= self.drop_first + self.hang_first + self.fail_first:
            return "fail"
        return None


@dataclasses.dataclass
class _Injected:
    """One queued :meth:`FaultMiddleware.inject_next` call: ``remaining`` POSTs still to take ``kind``."""

    kind: str
    remaining: int
    status: int
    seconds: float


def _check_injection(n: object, fault: object, status: object, seconds: object) -> _Injected:
    count = checks.integer("inject_next n", n, minimum=1, why="how many POSTs to fault", error=checks.fault)
    if not isinstance(fault, str) or fault not in FAULT_KINDS:
        raise errors.InvalidFaultError(
            f"inject_next fault={fault!r} is not a known fault; use one of {', '.join(FAULT_KINDS)}"
        )
    code = checks.integer("inject_next status", status, minimum=100, maximum=599, error=checks.fault)
    delay = checks.number("inject_next seconds", seconds, minimum=0, error=checks.fault)
    return _Injected(kind=fault, remaining=count, status=code, seconds=delay)


async def _send_problem(send: Send, status: int, title: str, detail: str) -> None:
    body = problem_json(status, title, detail)
    headers = [(b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _was_applied(start: Message) -> bool:
    """An answer's start says its effect was applied just now: a 2xx that is not a replay."""
    replayed = any(bytes(name).lower() == b"idempotent-replayed" for name, _ in start.get("headers", []))
    return 200 <= int(start["status"]) < 300 and not replayed


class DropProxy:
    """A TCP proxy to ``(host, port)`` that closes a client's connection on request (see the module).

    Start it on the server's event loop (:meth:`start`); :meth:`drop` takes the address the server sees
    as the request's ``client`` (the proxy's own outgoing socket) and closes the matching client
    connection at once, so nothing the server answers on it reaches the client.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._server: asyncio.Server | None = None
        #: The proxy's outgoing socket address -> the client's writer.
        self._clients: dict[tuple[str, int], asyncio.StreamWriter] = {}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen; the address clients should use."""
        self._server = await asyncio.start_server(self._serve, host, port)
        address = self._server.sockets[0].getsockname()
        return str(address[0]), int(address[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._clients.values()):
                writer.close()
            await self._server.wait_closed()

    def drop(self, client: tuple[str, int] | list[Any] | None) -> bool:
        """Close the client connection behind the server-side address ``client``; whether one was open."""
        writer = self._clients.pop((str(client[0]), int(client[1])), None) if client else None
        if writer is None:
            return False
        transport = writer.transport
        transport.abort()  # no FIN-after-data: the client sees the connection broken
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        sockname = up_writer.get_extra_info("sockname")
        local = (str(sockname[0]), int(sockname[1]))
        self._clients[local] = writer
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._pump, reader, up_writer, group.cancel_scope)
                group.start_soon(self._pump_back, local, up_reader, writer, group.cancel_scope)
        finally:
            self._clients.pop(local, None)
            for w in (up_writer, writer):
                w.close()

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, scope: anyio.CancelScope
    ) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            scope.cancel()

    async def _pump_back(
        self,
        local: tuple[str, int],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        scope: anyio.CancelScope,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if local not in self._clients:  # dropped: the answer goes nowhere
                    break
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        scope.cancel()


class FaultMiddleware:
    """Inject faults into an ASGI app's POSTs (see the module docstring).

    Args:
        app: the app to wrap (faults apply outside it: a failed POST never reaches it).
        faults: the static faults (default none).
        proxy: the :class:`DropProxy` in front of the server, needed for drops.
    """

    def __init__(self, app: ASGIApp, faults: Faults | None = None, proxy: DropProxy | None = None) -> None:
        self.app = app
        self.faults = faults or Faults()
        self.proxy = proxy
        if self.faults.drop_first and proxy is None:
            raise errors.ConfigurationError("drop_first needs a DropProxy in front of the server")
        self._counter = 0
        self._lock = threading.Lock()
        self._injected: collections.deque[_Injected] = collections.deque()

    def inject_next(self, n: int, fault: str, *, status: int = 500, seconds: float = 0.0) -> None:
        """Make the next ``n`` POSTs received after this call take ``fault`` (thread-safe).

        Several calls queue in order (first in, first out). Faults:

        - ``"fail"``: answer ``status`` with a problem document; nothing is applied.
        - ``"drop_after_apply"``: process the request normally (its effect commits), then drop the
          connection before the answer reaches the client (needs the :class:`DropProxy`).
        - ``"slow"``: process the request normally, then wait ``seconds`` before answering.

        An injected fault takes precedence over the static :class:`Faults`.

        Raises:
            InvalidFaultError: ``n`` is not an int >= 1, ``fault`` is unknown, ``status`` is not an
                HTTP status 100-599 or ``seconds`` is not a finite number >= 0.
        """
        injected = _check_injection(n, fault, status, seconds)
        if injected.kind == "drop_after_apply" and self.proxy is None:
            raise errors.InvalidFaultError("drop_after_apply needs a DropProxy in front of the server")
        with self._lock:
            self._injected.append(injected)

    def _next(self) -> tuple[int, _Injected | None]:
        """Number this POST (1-based arrival order) and take the injected fault it gets, if any."""
        with self._lock:
            self._counter += 1
            taken: _Injected | None = None
            if self._injected:
                taken = self._injected[0]
                taken.remaining -= 1
                if taken.remaining == 0:
                    self._injected.popleft()
            return self._counter, taken

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        ordinal, injected = self._next()
        faults = self.faults
        topic = scope["path"].lstrip("/")
        if injected is not None and injected.kind == "fail":
            await _send_problem(
                send, injected.status, "Simulated failure", f"POST #{ordinal} failed on purpose (inject_next)"
            )
            return
        fault = None if injected is not None else faults.fault_for(ordinal)
        if fault == "drop":
            self._drop(scope)
            await _send_problem(send, 503, "Dropped", "never seen by the client")
            return
        if fault == "hang":
            await anyio.sleep(faults.hang_ms / 1000)
            await _send_problem(
                send,
                503,
                "Service Unavailable",
                f"POST #{ordinal} hung for {faults.hang_ms} ms (--hang-first)",
            )
            return
        if fault == "fail":
            await _send_problem(
                send,
                faults.fail_status,
                "Simulated failure",
                f"POST #{ordinal} failed on purpose (--fail-first)",
            )
            return
        if topic in faults.always_status:
            status = faults.always_status[topic]
            detail = f"topic {topic!r} always answers {status} (--always-status-for-topic)"
            await _send_problem(send, status, "Rejected by configuration", detail)
            return
        if injected is None and not faults.delay_after_apply_ms:
            await self.app(scope, receive, send)  # nothing to do at the answer: no wrapper per message
            return
        await self.app(scope, receive, self._late_send(scope, send, injected))

    def _drop(self, scope: Scope) -> None:
        assert self.proxy is not None
        if not self.proxy.drop(scope.get("client")):
            logger.warning("could not drop the connection of %r: not through the proxy", scope.get("client"))
        scope[DROPPED] = True

    def _late_send(self, scope: Scope, send: Send, injected: _Injected | None) -> Send:
        """``send``, delayed or dropped at the answer's start as ``injected`` (or the static delay) asks."""
        delay_s = self.faults.delay_after_apply_ms / 1000
        if injected is not None:
            delay_s = injected.seconds if injected.kind == "slow" else 0.0

        async def late(message: Message) -> None:
            if message["type"] == "http.response.start":
                if injected is not None and injected.kind == "drop_after_apply":
                    self._drop(scope)
                elif delay_s and (injected is not None or _was_applied(message)):
                    await anyio.sleep(delay_s)
            await send(message)

        return late
