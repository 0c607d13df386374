"""The HTTP transport: a row is a POST of its payload with its ``Idempotency-Key``, "sent" is a 2xx, and
:func:`~dagster_joblease.dispatch.policy.classify_response` / :func:`~dagster_joblease.dispatch.policy.
classify_exception` are its table of what is retried. A total deadline per request, through public
httpx and httpcore APIs only.

httpx's timeouts apply per phase and per socket operation: a downstream answering one byte every 0.1 s
never trips a 1 s read timeout. The dispatcher's own client therefore runs on a network backend whose
every connect, read and write is bounded by the time left until the current request's deadline (kept
per thread, since each delivery runs on one thread). :class:`HttpTransport` sends through that client,
or through a caller's ``httpx.Client``. The message's own headers travel as HTTP headers after the
route's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import httpcore
import httpx

from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.dispatch.transports.base import OutboxMessage, TooLate

__all__ = ["MAX_BODY_READ", "HttpTransport"]

#: Response bytes read for the stored error snippet; the rest of a huge body is not downloaded.
MAX_BODY_READ = 8 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """A route's request, prepared once for the dispatcher's own client."""

    url: httpx.URL
    headers: list[tuple[bytes, bytes]]
    extensions: dict[str, Any]


_deadline = threading.local()


def _bounded(timeout: float | None, timeout_error: type[Exception]) -> float | None:
    deadline: float | None = getattr(_deadline, "at", None)
    if deadline is None:
        return timeout
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise timeout_error("the request's total deadline passed (route timeout_s, bounded by the claim)")
    return remaining if timeout is None else min(timeout, remaining)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, bounded))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_tcp(host, port, bounded, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, bounded, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


#: httpcore's exceptions as httpx's (most specific first): the policy judges httpx's.
_HTTPX_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextlib.contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core, mapped in _HTTPX_ERRORS:
            if isinstance(exc, core):
                raise mapped(str(exc)) from exc
        raise


class _ResponseStream(httpx.SyncByteStream):
    def __init__(self, inner: Iterable[bytes]) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx_errors():
            yield from self._inner

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()


class _DeadlineTransport(httpx.BaseTransport):
    """An httpx transport over httpcore's connection pool (TLS, pooling, keep-alive) on the
    deadline-bounded network backend, through public httpx and httpcore APIs only."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._connections = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_DeadlineBackend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _as_httpx_errors():
            response = self._connections.handle_request(core_request)
        assert isinstance(response.stream, Iterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._connections.close()


def _cap_at_deadline(request: httpx.Request, deadline: float) -> None:
    """Cap each phase's timeout of a request sent through a caller's client at the time left until
    ``deadline`` (local monotonic time): before it is sent, and again once its headers are in, for the
    body's reads (httpcore reads the request's ``timeout`` extension when the body is first read). Each
    read is then bounded by the deadline, so a downstream slow to its headers and again to its body
    cannot keep the request open past it; one that dribbles bytes within a phase is still bounded only
    by the caller's client (the body is checked against the deadline between chunks)."""
    left = max(deadline - time.monotonic(), 0.001)
    timeouts = request.extensions.get("timeout", {})
    request.extensions["timeout"] = {
        phase: left if value is None else min(value, left) for phase, value in timeouts.items()
    }


class HttpTransport:
    """Sends rows' POSTs for one dispatcher: through its own client (``client`` None: the deadline-bounded
    transport, each route's request prepared once) or through a caller's ``httpx.Client`` (its auth,
    hooks and cookies apply). ``headers``: topic → the route's headers, resolved (a JSON
    ``Content-Type`` is added)."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        headers: Mapping[str, dict[str, str]],
        concurrency: int,
        client: httpx.Client | None,
    ) -> None:
        self._headers = {topic: {**h, "Content-Type": "application/json"} for topic, h in headers.items()}
        self._timeouts = {topic: route.timeout for topic, route in routes.items()}
        self.owns_client = client is None
        http_limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.transport: _DeadlineTransport | None = None
        if client is None:
            self.transport = _DeadlineTransport(http_limits)
            client = httpx.Client(
                follow_redirects=False,
                limits=http_limits,
                timeout=httpx.Timeout(10.0),
                transport=self.transport,
            )
        self.client = client
        # The own client's requests go straight to its transport (see post): each route's URL, headers
        # (the client's defaults, then the route's) and timeout are prepared here once.
        self._targets: dict[str, _Target] = {}
        for topic, route in routes.items():
            merged = httpx.Headers(client.headers)
            merged.update(self._headers[topic])
            self._targets[topic] = _Target(
                httpx.URL(route.url), merged.raw, {"timeout": route.timeout.as_dict()}
            )

    def send(
        self, message: OutboxMessage, route: Route, deadline: float, send_by: float | None
    ) -> policy.Classification:
        """POST ``message`` to ``route`` and classify the answer; every connect, read and write of the
        dispatcher's own client is bounded by ``deadline`` (local monotonic time), and the body is read
        only until then. Raises :class:`TooLate` when a rate-admitted row could not start by ``send_by``,
        and whatever the request raised (judged by :meth:`classify_exception`)."""
        _deadline.at = deadline
        try:
            return self._post(message, route, deadline, send_by)
        finally:
            _deadline.at = None

    @staticmethod
    def classify_exception(exc: BaseException) -> policy.Classification:
        """HTTP's table for a request that got no answer: :func:`policy.classify_exception`."""
        return policy.classify_exception(exc)

    def _post(
        self, message: OutboxMessage, route: Route, deadline: float, send_by: float | None
    ) -> policy.Classification:
        key = route.key_header(message.idempotency_key)
        hooks = self.client.event_hooks
        if self.transport is None or hooks["request"] or hooks["response"]:
            request, response = self._through_client(message, route, key, deadline, send_by)
        else:
            request, response = self._direct(message, key, send_by)
        body = _read_body(request, response, deadline)
        return policy.classify_response(response, body[:MAX_BODY_READ].decode("utf-8", "replace"))

    def _through_client(
        self, message: OutboxMessage, route: Route, key: str, deadline: float, send_by: float | None
    ) -> tuple[httpx.Request, httpx.Response]:
        """A client of the caller's (its own auth, hooks and cookies apply), or event hooks added to the
        dispatcher's own client: the full httpx.Client path."""
        headers = {**self._headers[message.topic], **message.headers, "Idempotency-Key": key}
        request = self.client.build_request(
            "POST",
            route.url,
            content=message.payload,
            headers=headers,
            timeout=self._timeouts[message.topic],
        )
        _cap_at_deadline(request, deadline)
        if send_by is not None and time.monotonic() > send_by:
            raise TooLate
        response = self.client.send(request, stream=True, follow_redirects=False)
        _cap_at_deadline(request, deadline)  # the body's reads get only what is left
        return request, response

    def _direct(
        self, message: OutboxMessage, key: str, send_by: float | None
    ) -> tuple[httpx.Request, httpx.Response]:
        """The dispatcher's own client has no auth and never follows a redirect, so (without event hooks)
        the request goes straight to its transport (the deadline-bounded pool): httpx.Client's per-request
        URL and header merging, auth and redirect flows and cookie jar cost about a third of a delivery's
        client CPU. Headers on the wire are the ones the client would send (its defaults, then the
        route's, then the message's own), minus cookies: a Set-Cookie from one row's answer is never
        carried into another row's request."""
        assert self.transport is not None
        target = self._targets[message.topic]
        raw = target.headers
        if message.headers:
            raw = raw + [(k.encode("ascii"), v.encode("ascii")) for k, v in message.headers.items()]
        request = httpx.Request(
            "POST",
            target.url,
            content=message.payload,
            headers=[*raw, (b"Idempotency-Key", key.encode("ascii"))],
            extensions=target.extensions,
        )
        if send_by is not None and time.monotonic() > send_by:
            raise TooLate
        response = self.transport.handle_request(request)
        response.request = request
        return request, response

    def close(self) -> None:
        """Close the client if it is the dispatcher's own."""
        if self.owns_client:
            self.client.close()


def _read_body(request: httpx.Request, response: httpx.Response, deadline: float) -> bytearray:
    """The answer's body, up to MAX_BODY_READ bytes, read only until ``deadline``; the response closed."""
    try:
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) >= MAX_BODY_READ:
                break
            if time.monotonic() >= deadline:
                raise httpx.ReadTimeout("the request's total deadline passed", request=request)
    finally:
        response.close()
    return body
