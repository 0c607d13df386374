"""The NATS JetStream transport (``nats://`` routes; the optional extra ``dagster-joblease[nats]``,
nats-py).

A row is published on the route's ``subject`` (``{ordering_key}`` standing for one token, ``_`` for a
row without a key) with ``Nats-Msg-Id`` = its idempotency key, so JetStream's duplicate window drops a
resend of a message it stored, and with ``Nats-Expected-Stream`` = the route's ``stream``, so a subject
stored by another stream is refused rather than stored there. The route's and the message's own headers
are NATS headers. "Sent" is the stream's publish ack (a ``duplicate`` ack too: the message was stored
before).

When the dispatcher starts it connects to each server and reads each route's stream: a stream that is
missing, does not store the route's subject, or whose ``duplicate_window`` is shorter than the route's
``dedupe_window`` refuses the route (:class:`~dagster_joblease.errors.ConfigurationError` naming it). A
server that cannot be reached then does not stop the dispatcher: its rows are retried, and the check runs
at the first connection (its failure is then the rows' retry reason). A stream that disappears while the
dispatcher runs makes its rows retry, and is checked again before the next publish.

What is retried and what is final is :func:`classify_exception`'s table. Every send runs on one event
loop thread per dispatcher (:class:`~.loop.LoopThread`), one connection per server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import httpx

from dagster_joblease import errors
from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.routes import NO_ORDERING_KEY, Route, fill_ordering_key
from dagster_joblease.dispatch.transports.base import OutboxMessage, TooLate
from dagster_joblease.dispatch.transports.broker import (
    START_CONNECT_S,
    BrokerTransport,
    Endpoint,
    Table,
    Unsendable,
    classify,
)

try:
    import nats
    import nats.errors
    import nats.js
    import nats.js.errors
    from nats.aio.client import Client as NatsClient
    from nats.js.api import PubAck
except ImportError as exc:  # pragma: no cover - exercised by test_transports' no-extras import
    raise errors.ConfigurationError(
        "a nats:// route needs nats-py: pip install 'dagster-joblease[nats]'"
    ) from exc

__all__ = [
    "JetStreamTransport",
    "RouteNotReady",
    "Unsendable",
    "classify_ack",
    "classify_exception",
    "stream_refusal",
    "subject_for",
    "subject_matches",
]

logger = logging.getLogger(__name__)

_TOKEN = re.compile(r"^[^\s.*>]+$")


class RouteNotReady(Exception):
    """A route's stream failed its check at a connection made after start: its rows are retried."""


def subject_for(template: str, ordering_key: str | None) -> str:
    """The subject a row is published on: ``{ordering_key}`` in ``template`` replaced by the row's key
    (``_`` without one). Raises :class:`Unsendable` when the key cannot be a subject token."""
    if "{ordering_key}" not in template:
        return template
    if not _TOKEN.match(NO_ORDERING_KEY if ordering_key is None else ordering_key):
        raise Unsendable(
            f"ordering key {ordering_key!r} cannot be a NATS subject token (no whitespace, '.', '*' or '>'), "
            f"so it cannot fill the route's subject {template!r}; use a subject without {{ordering_key}} "
            "or keys without those characters"
        )
    return fill_ordering_key(template, ordering_key)


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` is one of the subjects a stream's ``pattern`` stores (``*``: one token,
    ``>``: one or more trailing tokens)."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for i, part in enumerate(wanted):
        if part == ">":
            return len(tokens) > i
        if i >= len(tokens) or (part != "*" and part != tokens[i]):
            return False
    return len(wanted) == len(tokens)


def stream_refusal(
    route: Route, topic: str, stream_subjects: list[str] | None, duplicate_window_s: float | None
) -> str | None:
    """Why the route cannot publish into its stream as the server describes it (None: it can). Pure.
    ``stream_subjects`` None: the stream does not exist."""
    where = f"topic {topic!r} (route {route.url[:200]!r}, subject {route.subject!r}, stream {route.stream!r})"
    if stream_subjects is None:
        return f"{where}: the stream {route.stream!r} does not exist on the server; create it or fix `stream`"
    assert route.subject is not None
    probe = fill_ordering_key(route.subject, None)
    if not any(subject_matches(p, probe) for p in stream_subjects):
        return (
            f"{where}: the stream stores {stream_subjects}, not the route's subject; add the subject to the "
            "stream or fix `subject`"
        )
    window = route.dedupe_window_s
    assert window is not None  # a JetStream route must set it (Route checks)
    if duplicate_window_s is None or duplicate_window_s < window:
        return (
            f"{where}: the stream's duplicate_window ({duplicate_window_s or 0:g} s) is shorter than the "
            f"route's dedupe_window ({window:g} s), so a resend could be stored twice; raise the stream's "
            "duplicate_window to at least the dedupe_window, or lower the route's dedupe_window"
        )
    return None


def classify_ack(ack: PubAck) -> policy.Classification:
    """A publish ack is "sent": stored now, or (``duplicate``) stored by an earlier attempt."""
    stored = "duplicate of a message stored before" if ack.duplicate else "stored"
    return policy.Classification(policy.Outcome.SENT, None, f"JetStream {ack.stream} seq {ack.seq}: {stored}")


_RETRY, _DEAD = policy.Outcome.RETRY, policy.Outcome.DEAD
_NO_ACK = "no publish ack before the deadline (the message may be stored: resent with the same Nats-Msg-Id)"
#: JetStream's table (see :data:`~.broker.Table`).
TABLE: Table = (
    (RouteNotReady, _RETRY, False, "{exc}"),
    (Unsendable, _DEAD, False, "{exc}"),
    (
        nats.js.errors.NoStreamResponseError,
        _RETRY,
        False,
        "no stream stores the subject now (deleted?): {exc}",
    ),
    (nats.js.errors.ServiceUnavailableError, _RETRY, False, "JetStream unavailable: {exc}"),
    (nats.js.errors.ServerError, _RETRY, False, "JetStream server error: {exc}"),
    (nats.js.errors.APIError, _DEAD, False, "JetStream refused the message: {exc}"),
    (nats.errors.MaxPayloadError, _DEAD, False, "the payload is larger than the server's max_payload: {exc}"),
    (nats.errors.BadSubjectError, _DEAD, False, "the subject is not valid: {exc}"),
    (TimeoutError, _RETRY, True, _NO_ACK),
    (nats.errors.Error, _RETRY, False, "NATS: {name}: {exc}"),
    (OSError, _RETRY, False, "cannot reach the NATS server: {name}: {exc}"),
)


def classify_exception(exc: BaseException) -> policy.Classification:
    """JetStream's table for a publish that raised instead of being acknowledged."""
    return classify(TABLE, exc)


@dataclasses.dataclass
class _Server(Endpoint):
    """One NATS server's connection and which of its routes' streams passed the check on it."""

    client: NatsClient | None = None
    checked: set[str] = dataclasses.field(default_factory=set)


class JetStreamTransport(BrokerTransport[_Server]):
    """Publishes rows into JetStream for one dispatcher (see the module's docstring)."""

    endpoint_name = "NATS server"
    checked_name = "streams"
    unreachable = (OSError, TimeoutError, nats.errors.Error)
    table = TABLE

    def __init__(
        self, routes: Mapping[str, Route], headers: Mapping[str, dict[str, str]], concurrency: int
    ) -> None:
        super().__init__(routes, headers, "joblease-jetstream")

    @staticmethod
    def endpoint_key(route: Route) -> str:
        url = httpx.URL(route.url)
        return f"nats://{url.host}:{url.port or 4222}"

    def new_endpoint(self, url: str, credentials: str | None) -> _Server:
        return _Server(url, credentials)

    async def connect(self, endpoint: _Server) -> None:
        await self._connect(endpoint)

    async def check_at_start(self, endpoint: _Server, topic: str) -> None:
        refusal = await self._check(endpoint, topic)
        if refusal is not None:
            raise errors.ConfigurationError(refusal)

    async def close_endpoint(self, endpoint: _Server) -> None:
        if endpoint.client is not None and not endpoint.client.is_closed:
            await endpoint.client.close()

    async def _connect(self, server: _Server) -> NatsClient:
        """Connect to the server; its first failure is raised at once (nats-py would retry an initial
        connection for ever), while a connection made reconnects by itself later."""
        options: dict[str, Any] = {}
        if server.credentials is not None:
            user, colon, password = server.credentials.partition(":")
            options = {"user": user, "password": password} if colon else {"token": server.credentials}
        failed: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def on_error(exc: Exception) -> None:
            if not failed.done():
                failed.set_result(exc)
            logger.info(
                "NATS %s: %s: %s", server.url, type(exc).__name__, exc, extra={"action": "broker_error"}
            )

        connecting = asyncio.ensure_future(
            nats.connect(
                servers=[server.url],
                name="dagster-joblease dispatcher",
                connect_timeout=START_CONNECT_S,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=on_error,
                **options,
            )
        )
        try:
            waiters: set[asyncio.Future[Any]] = {connecting, failed}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(BaseException):
                    await connecting
        if connecting.cancelled() or connecting.exception() is not None:
            raise failed.result() if failed.done() else ConnectionError("the NATS connection was not made")
        server.client = connecting.result()
        server.checked.clear()
        return server.client

    async def _check(self, server: _Server, topic: str) -> str | None:
        """Read the route's stream; the reason it cannot be published into, or None (then remembered)."""
        assert server.client is not None
        route = self._routes[topic]
        assert route.stream is not None
        try:
            info = await server.client.jetstream().stream_info(route.stream)
        except nats.js.errors.NotFoundError:
            return stream_refusal(route, topic, None, None)
        refusal = stream_refusal(route, topic, list(info.config.subjects or []), info.config.duplicate_window)
        if refusal is None:
            server.checked.add(topic)
        return refusal

    # -- send --------------------------------------------------------------------------------------

    def send(
        self, message: OutboxMessage, route: Route, deadline: float, send_by: float | None
    ) -> policy.Classification:
        """Publish ``message`` and wait for its ack until ``deadline``; see the module's docstring."""
        assert route.subject is not None
        subject = subject_for(route.subject, message.ordering_key)
        headers = {**self._headers[message.topic], **message.headers, "Nats-Msg-Id": message.idempotency_key}
        if send_by is not None and time.monotonic() > send_by:
            raise TooLate
        ack = self._loop.run(self._publish(message, route, subject, headers, deadline), deadline)
        return classify_ack(ack)

    async def _publish(
        self, message: OutboxMessage, route: Route, subject: str, headers: dict[str, str], deadline: float
    ) -> PubAck:
        server = self._endpoint_of[message.topic]
        client = await self._ready(server, message.topic)
        try:
            return await client.jetstream().publish(
                subject,
                message.payload,
                timeout=max(0.001, deadline - time.monotonic()),
                stream=route.stream,
                headers=headers,
            )
        except nats.js.errors.NoStreamResponseError:
            server.checked.discard(message.topic)  # read the stream again before the next publish
            raise

    async def _ready(self, server: _Server, topic: str) -> NatsClient:
        """The server's connection, made now if there is none, with the topic's stream checked on it."""
        if server.client is not None and topic in server.checked and not server.client.is_closed:
            return server.client
        assert server.lock is not None
        async with server.lock:
            if server.client is None or server.client.is_closed:
                await self._connect(server)
            assert server.client is not None
            if topic not in server.checked:
                refusal = await self._check(server, topic)
                if refusal is not None:
                    raise RouteNotReady(refusal)
            return server.client
