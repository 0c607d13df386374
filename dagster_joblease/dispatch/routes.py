"""Routes: where each topic is delivered. The destination comes from configuration, never from a payload.

Secret header values are never written in configuration: a route names the environment variable that holds
each one (``secret_headers = {"Authorization" = "BILLING_TOKEN"}``), read once when a dispatcher starts.
They are sent only to the route's own URL, and redirects are never followed.

A routes file (TOML or JSON) maps topics to routes::

    [billing]
    url = "https://billing.internal/hooks/invoice"
    headers = { "X-Source" = "joblease" }
    secret_headers = { "Authorization" = "BILLING_TOKEN" }
    timeout_s = 5.0

    [billing.limits]          # optional: the downstream's capacity, shared by every dispatcher
    limit_group = "billing"   # default: the URL's origin (scheme://host:port)
    max_in_flight = 4         # at most 4 requests at once, globally
    rate = 50                 # at most 50 requests in any 1-second window, globally
    max_pause_s = 300         # cap on a Retry-After pause of the whole group
    dedupe_window = "24h"     # the downstream remembers a key this long after its first attempt
    key_format = "sf-string"  # send Idempotency-Key as an RFC 8941 string: "v2:…"

(the options may also sit directly in the topic's table).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx

from dagster_joblease import checks, errors, tracing

__all__ = [
    "DEFAULT_MAX_PAUSE_S",
    "KEY_FORMATS",
    "RESERVED_HEADERS",
    "TRANSPORTS",
    "Route",
    "load_routes",
    "origin_of",
]

#: Headers the dispatcher sets itself (lowercase); a route may not set them. ``traceparent`` and
#: ``tracestate`` carry each row's own creation context (:mod:`dagster_joblease.tracing`): a route's would be
#: sent beside or instead of it, naming one fixed trace for every row.
RESERVED_HEADERS = frozenset(
    {
        "idempotency-key",
        "content-type",
        "content-length",
        "host",
        "transfer-encoding",
        tracing.TRACEPARENT_HEADER,
        tracing.TRACESTATE_HEADER,
    }
)
#: JetStream's control headers (``Nats-Msg-Id``, ``Nats-Expected-Stream``, ``Nats-Rollup``, ``Nats-TTL``,
#: ``Nats-Expected-Last-Sequence``, …) all start so: on a route they would apply to every message.
_NATS_CONTROL_PREFIX = "nats-"
#: The longest header name a route may set: AMQP carries headers in a field table whose keys are short
#: strings (at most 255 bytes; a name is ASCII, so 255 characters).
MAX_HEADER_NAME = 255
#: The longest header value a route may set: what HTTP servers commonly accept in one header line (8 KiB).
MAX_HEADER_VALUE = 8_192
_HEADER_NAME_RULE = (
    f"a header name is an HTTP token (letters, digits and !#$%&'*+-.^_`|~) of at most {MAX_HEADER_NAME} "
    "characters"
)
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_TIMEOUT_S = 600.0
#: Longest pause a downstream's Retry-After may impose when a route sets no max_pause_s (5 minutes).
DEFAULT_MAX_PAUSE_S = 300.0
_MAX_PAUSE_S = 7 * 86_400.0
_MAX_WINDOW_S = 366 * 86_400.0
_MAX_LIMIT = 1_000_000
_GROUP_CHARS = 255
KEY_FORMATS = ("bare", "sf-string")
#: A route URL's scheme → the transport (:mod:`dagster_joblease.dispatch.transports`) that sends its rows.
TRANSPORTS = {"http": "http", "https": "http", "nats": "jetstream", "amqp": "rabbitmq", "amqps": "rabbitmq"}
#: A scheme's port when the URL names none (a route's default limit group spells it out).
DEFAULT_PORTS = {"http": 80, "https": 443, "nats": 4222, "amqp": 5672, "amqps": 5671}
#: The options that say where in a broker a route's rows go, and the transport each belongs to.
BROKER_OPTIONS = {
    "subject": "jetstream",
    "stream": "jetstream",
    "exchange": "rabbitmq",
    "routing_key": "rabbitmq",
}
#: What ``{ordering_key}`` in a subject or routing key becomes for a row without an ordering key.
NO_ORDERING_KEY = "_"
_SUBJECT_TOKEN = re.compile(r"^[^\s.*>]+$")


def fill_ordering_key(template: str, ordering_key: str | None) -> str:
    """A subject or routing key template with ``{ordering_key}`` replaced by the row's key (``_``, or
    :data:`NO_ORDERING_KEY`, for a row without one)."""
    return template.replace("{ordering_key}", NO_ORDERING_KEY if ordering_key is None else ordering_key)


_ROUTING_KEY_TOKEN = re.compile(r"^[\x21-\x7e]*$")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,255}$")
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def duration_s(value: object, where: str, name: str) -> float:
    """Seconds from a number, a ``timedelta`` or text like ``24h``, ``30m``, ``1h30m``, ``90s``, ``7d``."""
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if match and any(match.groups()):
            d, h, m, s = (int(g or 0) for g in match.groups())
            return float(((d * 24 + h) * 60 + m) * 60 + s)
    raise errors.ConfigurationError(
        f"{where}: {name}={value!r} is not a duration; give seconds, a timedelta, or text like 24h, 30m, "
        "1h30m, 90s or 7d"
    )


def origin_of(url: str) -> str:
    """The origin of ``url`` (scheme://host:port, default ports spelled out): a route's default group."""
    parsed = httpx.URL(url)
    port = parsed.port or DEFAULT_PORTS.get(parsed.scheme, 80)
    return f"{parsed.scheme}://{parsed.host}:{port}"


def _check_header_name(name: object, where: str, transport: str) -> str:
    """A route's header name: one every transport carries (an HTTP token that fits an AMQP field-table
    key), not one the dispatcher sets itself, and on a JetStream route not a JetStream control header."""
    if not isinstance(name, str) or not _TOKEN.match(name) or len(name) > MAX_HEADER_NAME:
        raise errors.ConfigurationError(
            f"{where}: header name {name!r:.80} is not a valid HTTP header name; {_HEADER_NAME_RULE}"
        )
    if name.lower() in RESERVED_HEADERS:
        raise errors.ConfigurationError(
            f"{where}: header {name!r} is set by the dispatcher itself; remove it from the route (the "
            f"dispatcher sets {', '.join(sorted(RESERVED_HEADERS))})"
        )
    if transport == "jetstream" and name.lower().startswith(_NATS_CONTROL_PREFIX):
        raise errors.ConfigurationError(
            f"{where}: header {name!r} is a JetStream control header (Nats-…), which would apply to every "
            "message of the route; remove it (the dispatcher sets Nats-Msg-Id to the row's idempotency key "
            "and Nats-Expected-Stream to the route's stream itself)"
        )
    return name


def _check_header_value(name: str, value: object, where: str) -> str:
    """A route's header value: printable ASCII (no CR, LF or other control character), at most
    :data:`MAX_HEADER_VALUE` characters: what HTTP, NATS and AMQP headers all carry as they are."""
    if (
        not isinstance(value, str)
        or not value.isascii()
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)
        or len(value) > MAX_HEADER_VALUE
    ):
        got = f"a {type(value).__name__}" if not isinstance(value, str) else f"{len(value)} characters"
        raise errors.ConfigurationError(
            f"{where}: the value of header {name!r} must be a printable ASCII string (no CR, LF or other "
            f"control character) of at most {MAX_HEADER_VALUE} characters; got {got}"
        )
    return value


def _check_url(url: object) -> str:
    """Validate a route's URL; return the ``route '…'`` prefix its other messages start with."""
    if not isinstance(url, str):
        raise errors.ConfigurationError(f"route url must be a str, got {type(url).__name__}")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise errors.ConfigurationError(
            f"route url {url[:200]!r} is not a valid URL; use e.g. https://host/path"
        ) from None
    if parsed.scheme not in TRANSPORTS or not parsed.host:
        raise errors.ConfigurationError(
            f"route url {url[:200]!r} must be http:// or https:// (an HTTP POST), nats:// (NATS JetStream) "
            "or amqp:// or amqps:// (RabbitMQ), with a host"
        )
    if parsed.userinfo:
        raise errors.ConfigurationError(
            "a route url must not embed credentials; put them in secret_headers (header → env variable) "
            "or, for a broker, credentials_env"
        )
    return f"route {url[:200]!r}"


def _check_template(value: object, where: str, name: str, token: re.Pattern[str], allowed: str) -> str:
    """A subject or routing key, ``{ordering_key}`` allowed in it: each ``.``-separated token must match."""
    if not isinstance(value, str) or not value or len(value) > 255:
        raise errors.ConfigurationError(
            f"{where}: {name}={value!r} must be a non-empty str of at most 255 chars"
        )
    filled = value.replace("{ordering_key}", NO_ORDERING_KEY)
    if "{" in filled or "}" in filled or not all(token.match(t) for t in filled.split(".")):
        raise errors.ConfigurationError(
            f"{where}: {name}={value!r} is not valid: {allowed}; `{{ordering_key}}` may stand for a token"
        )
    return value


def check_subject(value: object, where: str) -> str:
    """A JetStream route's subject: tokens without whitespace or wildcards, ``{ordering_key}`` allowed."""
    return _check_template(
        value, where, "subject", _SUBJECT_TOKEN, "dot-separated tokens without whitespace, `*` or `>`"
    )


def _check_destination(route: Route, where: str) -> None:
    """The broker options fit the route's transport: JetStream needs ``subject`` and ``stream``, RabbitMQ
    an ``exchange``; HTTP takes none of them (and only HTTP has a ``key_format``)."""
    _check_options_of_transport(route, where)
    _check_credentials_env(route, where)
    check_own_options = _OWN_OPTIONS_CHECKS.get(route.transport)
    if check_own_options is not None:
        check_own_options(route, where)


def _check_options_of_transport(route: Route, where: str) -> None:
    """No option of another transport (a broker's on HTTP, ``key_format`` on a broker)."""
    transport = route.transport
    for name, owner in BROKER_OPTIONS.items():
        if getattr(route, name) is not None and owner != transport:
            raise errors.ConfigurationError(
                f"{where}: {name} is an option of {owner} routes, not of this {transport} route; remove it"
            )
    if transport != "http" and route.key_format != "bare":
        raise errors.ConfigurationError(f"{where}: key_format is an option of HTTP routes; remove it")


def _check_credentials_env(route: Route, where: str) -> None:
    """``credentials_env``: a broker route's, naming an environment variable."""
    if route.credentials_env is None:
        return
    if route.transport == "http":
        raise errors.ConfigurationError(
            f"{where}: credentials_env is for broker routes; an HTTP route sends secret_headers"
        )
    if not isinstance(route.credentials_env, str) or not _ENV_NAME.match(route.credentials_env):
        raise errors.ConfigurationError(
            f"{where}: credentials_env must name an environment variable (letters, digits, underscore), "
            f"got {route.credentials_env!r}"
        )


def _check_jetstream(route: Route, where: str) -> None:
    """A JetStream route: a subject, its stream, and a dedupe window."""
    check_subject(route.subject, where)
    if not isinstance(route.stream, str) or not _NAME.match(route.stream):
        raise errors.ConfigurationError(
            f"{where}: a JetStream route needs stream= the name of the stream its subject is stored in "
            f"(letters, digits, - and _), got {route.stream!r}"
        )
    if route.dedupe_window is None:
        raise errors.ConfigurationError(
            f"{where}: set dedupe_window (at most the stream's duplicate_window): JetStream forgets a "
            "Nats-Msg-Id after that window, so a resend later than it would be stored twice"
        )


def _check_rabbitmq(route: Route, where: str) -> None:
    """A RabbitMQ route: an exchange, and a printable routing key template if any."""
    if not isinstance(route.exchange, str) or len(route.exchange) > 255:
        raise errors.ConfigurationError(
            f'{where}: a RabbitMQ route needs exchange= the exchange to publish to (a str, "" for the '
            f"default exchange), got {route.exchange!r}"
        )
    if route.routing_key is not None:
        _check_template(route.routing_key, where, "routing_key", _ROUTING_KEY_TOKEN, "printable ASCII")


#: A transport's own options, checked once no option of another transport is set (HTTP has none to check).
_OWN_OPTIONS_CHECKS: dict[str, Callable[[Route, str], None]] = {
    "jetstream": _check_jetstream,
    "rabbitmq": _check_rabbitmq,
}


def _check_headers(
    headers: Mapping[str, str], secret_headers: Mapping[str, str], where: str, transport: str
) -> tuple[dict[str, str], dict[str, str]]:
    """Static headers (name → value) and secret ones (name → environment variable), neither twice."""
    static = {
        _check_header_name(k, where, transport): _check_header_value(k, v, where)
        for k, v in dict(headers).items()
    }
    secrets_ = {}
    for name, env in dict(secret_headers).items():
        _check_header_name(name, where, transport)
        if not isinstance(env, str) or not _ENV_NAME.match(env):
            raise errors.ConfigurationError(
                f"{where}: secret header {name!r} must name an environment variable "
                f"(letters, digits, underscore), got {env!r}"
            )
        secrets_[name] = env
    clash = {k.lower() for k in static} & {k.lower() for k in secrets_}
    if clash:
        raise errors.ConfigurationError(f"{where}: headers {sorted(clash)} are both static and secret")
    return static, secrets_


def _check_group(limit_group: object, url: str, where: str) -> str:
    group = origin_of(url) if limit_group is None else limit_group
    if (
        not isinstance(group, str)
        or not group.strip()
        or len(group) > _GROUP_CHARS
        or any(ord(c) < 0x20 for c in group)
    ):
        raise errors.ConfigurationError(
            f"{where}: limit_group={limit_group!r} must be 1-{_GROUP_CHARS} characters without "
            "control characters"
        )
    return group


def _check_window(
    dedupe_window: float | dt.timedelta | str | None, timeout_s: float, where: str
) -> float | None:
    if dedupe_window is None:
        return None
    window = duration_s(dedupe_window, where, "dedupe_window")
    if not 0 < window <= _MAX_WINDOW_S:
        raise errors.ConfigurationError(
            f"{where}: dedupe_window={dedupe_window!r} must be more than 0 and at most 366 days"
        )
    if window <= timeout_s:
        raise errors.ConfigurationError(
            f"{where}: dedupe_window ({window:g} s) must exceed timeout_s ({timeout_s:g} s): a "
            "row is not sent once less than one timeout of its window remains"
        )
    return window


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one topic's rows go: an http(s) URL, static headers, secret headers and a timeout.

    Args:
        url: the destination; ``http`` or ``https`` with a host.
        headers: static, non-secret headers (e.g. ``{"X-Source": "joblease"}``).
        secret_headers: header name → *name of the environment variable* that holds its value.
        timeout_s: the whole request's deadline (seconds, > 0): connect, send, headers and body together,
            not per socket read, so a downstream that dribbles its answer cannot stretch it.
        limit_group: the name the downstream's capacity is shared under; default the URL's origin
            (``https://host:443``), since two topics often share one downstream. Limits and pauses are kept
            per group in the database, so they hold across every dispatcher sharing it.
        max_in_flight: at most this many requests of the group in flight at any moment, globally (None: no
            limit). Slots of a dispatcher that died free themselves when its claims expire.
        rate: at most this many requests of the group started in any 1-second window, globally (None: no
            limit); requests are spaced evenly, never sent in a burst.
        max_pause_s: a ``429``/``503`` with ``Retry-After`` pauses the whole group for every dispatcher until
            then, capped at this many seconds (default 300); 0 turns group pauses off (the row alone waits).
        pause_after_failures: after this many consecutive connection failures (no HTTP answer) to the group,
            pause it for ``failure_pause_s`` (None: never).
        failure_pause_s: how long such a pause lasts (default 30 s).
        dedupe_window: how long the downstream remembers a key, from the row's first delivery attempt
            (seconds, a timedelta or text like ``"24h"``; None: forever). A row past it is not sent again
            but dead-lettered for a person to reconcile, since a resend could be a second effect.
        key_format: ``"bare"`` (default: ``Idempotency-Key: v2:…``, what Stripe-style APIs expect) or
            ``"sf-string"`` (the IETF draft's RFC 8941 string: ``Idempotency-Key: "v2:…"``).
        timeout_grace_s: how long a request that timed out stays in flight after the timeout (None:
            ``timeout_s``), on every route, since the downstream may still be working on it: it keeps
            its ``max_in_flight`` slot, and neither its retry nor its ordering key's next row starts
            before then. The downstream then sees at most ``max_in_flight`` requests (and one request
            of a key at a time) unless it keeps one longer than ``timeout_s + timeout_grace_s``.
        subject: JetStream (``nats://`` URL): the subject a row is published on; ``{ordering_key}`` may stand
            for one token (a row without a key: ``_``), for subject-based partitioning.
        stream: JetStream: the stream that stores the subject. Its ``duplicate_window`` is read when the
            dispatcher starts and must be at least the route's ``dedupe_window`` (which a JetStream route
            must set: the stream forgets a ``Nats-Msg-Id`` after its window).
        exchange: RabbitMQ (``amqp://``/``amqps://`` URL): the exchange published to (``""``: the default
            exchange, which routes by queue name).
        routing_key: RabbitMQ: the routing key (None: the row's topic); ``{ordering_key}`` may stand for a
            part of it.
        credentials_env: a broker route: the environment variable holding ``user:password`` (RabbitMQ;
            default guest's) or a NATS ``user:password`` or token, read when the dispatcher starts.

    When dispatchers configure different limits for one group, the smallest applies (and is logged).
    """

    url: str
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict, kw_only=True)
    secret_headers: Mapping[str, str] = dataclasses.field(default_factory=dict, kw_only=True)
    timeout_s: float = dataclasses.field(default=10.0, kw_only=True)
    limit_group: str | None = dataclasses.field(default=None, kw_only=True)
    max_in_flight: int | None = dataclasses.field(default=None, kw_only=True)
    rate: int | None = dataclasses.field(default=None, kw_only=True)
    max_pause_s: float = dataclasses.field(default=DEFAULT_MAX_PAUSE_S, kw_only=True)
    pause_after_failures: int | None = dataclasses.field(default=None, kw_only=True)
    failure_pause_s: float = dataclasses.field(default=30.0, kw_only=True)
    dedupe_window: float | dt.timedelta | str | None = dataclasses.field(default=None, kw_only=True)
    key_format: str = dataclasses.field(default="bare", kw_only=True)
    timeout_grace_s: float | None = dataclasses.field(default=None, kw_only=True)
    subject: str | None = dataclasses.field(default=None, kw_only=True)
    stream: str | None = dataclasses.field(default=None, kw_only=True)
    exchange: str | None = dataclasses.field(default=None, kw_only=True)
    routing_key: str | None = dataclasses.field(default=None, kw_only=True)
    credentials_env: str | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        where = _check_url(self.url)
        _check_destination(self, where)
        headers, secrets_ = _check_headers(self.headers, self.secret_headers, where, self.transport)
        timeout = checks.number(f"{where}: timeout_s", self.timeout_s, above=0, maximum=_MAX_TIMEOUT_S)
        checked: dict[str, object] = {
            "headers": MappingProxyType(headers),
            "secret_headers": MappingProxyType(secrets_),
            "timeout_s": timeout,
            "limit_group": _check_group(self.limit_group, self.url, where),
            **{
                name: None
                if (value := getattr(self, name)) is None
                else checks.integer(f"{where}: {name}", value, minimum=1, maximum=_MAX_LIMIT, none="no limit")
                for name in ("max_in_flight", "rate", "pause_after_failures")
            },
            "max_pause_s": checks.number(
                f"{where}: max_pause_s", self.max_pause_s, minimum=0, maximum=_MAX_PAUSE_S
            ),
            "failure_pause_s": checks.number(
                f"{where}: failure_pause_s", self.failure_pause_s, minimum=0, maximum=_MAX_PAUSE_S
            ),
            "dedupe_window": _check_window(self.dedupe_window, timeout, where),
            "timeout_grace_s": None
            if self.timeout_grace_s is None
            else checks.number(
                f"{where}: timeout_grace_s",
                self.timeout_grace_s,
                minimum=0,
                maximum=_MAX_TIMEOUT_S,
                none="the route's timeout_s",
            ),
        }
        if self.key_format not in KEY_FORMATS:
            raise errors.ConfigurationError(
                f"{where}: key_format={self.key_format!r} must be one of {', '.join(KEY_FORMATS)}"
            )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def transport(self) -> str:
        """The transport that sends this route's rows, from its URL's scheme: ``http`` (http, https),
        ``jetstream`` (nats) or ``rabbitmq`` (amqp, amqps)."""
        return TRANSPORTS[self.url.split(":", 1)[0].lower()]

    def span_destination(self, topic: str, ordering_key: str | None) -> tuple[str, dict[str, str]]:
        """Where a row of ``topic`` goes, as OpenTelemetry's messaging conventions name it: the send span's
        destination (its name is ``send <destination>``) and the attributes beside it. HTTP: the topic.
        JetStream: the subject (a templated one names the span by its template, low in cardinality, and
        the filled subject is ``messaging.destination.name``). RabbitMQ: the exchange (``""`` for the
        default exchange), and the routing key as ``messaging.rabbitmq.destination.routing_key``."""
        if self.transport == "jetstream" and self.subject is not None:
            if "{ordering_key}" not in self.subject:
                return self.subject, {}
            filled = fill_ordering_key(self.subject, ordering_key)
            return self.subject, {
                "messaging.destination.template": self.subject,
                "messaging.destination.name": filled,
            }
        if self.transport == "rabbitmq" and self.exchange is not None:
            key = fill_ordering_key(topic if self.routing_key is None else self.routing_key, ordering_key)
            return self.exchange, {"messaging.rabbitmq.destination.routing_key": key} if key else {}
        return topic, {}

    def credentials(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The broker credentials from ``credentials_env`` (None: not set); a missing variable is named."""
        if self.credentials_env is None:
            return None
        value = (os.environ if environ is None else environ).get(self.credentials_env)
        if not value:
            raise errors.ConfigurationError(
                f"environment variable {self.credentials_env} (credentials of route {self.url[:200]!r}) is "
                "not set; export it before starting the dispatcher"
            )
        return value

    @property
    def limited(self) -> bool:
        """Whether this route configures a global limit (max_in_flight or rate)."""
        return self.max_in_flight is not None or self.rate is not None

    @property
    def slot_grace_s(self) -> float:
        """How long a timed-out request keeps its ``max_in_flight`` slot (``timeout_grace_s``, default
        ``timeout_s``)."""
        return self.timeout_s if self.timeout_grace_s is None else self.timeout_grace_s

    @property
    def dedupe_window_s(self) -> float | None:
        """The retention window in seconds (None: the downstream keeps keys forever)."""
        return None if self.dedupe_window is None else float(self.dedupe_window)  # type: ignore[arg-type]

    def key_header(self, key: str) -> str:
        """The ``Idempotency-Key`` header value for ``key`` in this route's ``key_format``."""
        if self.key_format == "sf-string":
            return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return key

    @property
    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout_s)

    def resolve_headers(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """Static headers plus secret ones read from the environment; a missing variable is named."""
        env = os.environ if environ is None else environ
        resolved = dict(self.headers)
        for name, variable in self.secret_headers.items():
            value = env.get(variable)
            if value is None or value == "":
                raise errors.ConfigurationError(
                    f"environment variable {variable} (for header {name!r} of route {self.url[:200]!r}) is "
                    "not set; export it before starting the dispatcher"
                )
            resolved[name] = _check_header_value(name, value, f"environment variable {variable}")
        return resolved

    def __repr__(self) -> str:
        extra = "".join(
            f", {f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in ("url", "headers", "secret_headers", "timeout_s", "limit_group")
            and getattr(self, f.name) != f.default
        )
        return (
            f"Route(url={self.url!r}, headers={dict(self.headers)!r}, "
            f"secret_headers={dict(self.secret_headers)!r}, timeout_s={self.timeout_s!r}, "
            f"limit_group={self.limit_group!r}{extra})"
        )


_LIMIT_KEYS = (
    "limit_group",
    "max_in_flight",
    "rate",
    "max_pause_s",
    "pause_after_failures",
    "failure_pause_s",
    "dedupe_window",
    "key_format",
    "timeout_grace_s",
)
_BROKER_KEYS = (*BROKER_OPTIONS, "credentials_env")
_ROUTE_KEYS = ("url", "headers", "secret_headers", "timeout_s", *_LIMIT_KEYS, *_BROKER_KEYS)


def _route_from(topic: str, spec: object, source: str) -> Route:
    flat = _flat_spec(topic, spec, source)
    kwargs: dict[str, Any] = {}
    for key in ("headers", "secret_headers"):
        if key in flat:
            if not isinstance(flat[key], Mapping):
                raise errors.ConfigurationError(f"{source}: topic {topic!r}: `{key}` must be a table")
            kwargs[key] = flat[key]
    kwargs.update({key: flat[key] for key in ("timeout_s", *_LIMIT_KEYS, *_BROKER_KEYS) if key in flat})
    try:
        return Route(flat["url"], **kwargs)
    except errors.ConfigurationError as exc:
        raise errors.ConfigurationError(f"{source}: topic {topic!r}: {exc}") from None


def _flat_spec(topic: str, spec: object, source: str) -> dict[str, Any]:
    """A topic's table with its ``limits`` table merged in: only known keys, and a ``url``."""
    if not isinstance(spec, Mapping):
        raise errors.ConfigurationError(f"{source}: topic {topic!r} must map to a table with at least `url`")
    flat = dict(spec)
    limits = flat.pop("limits", None)
    if limits is not None:
        if not isinstance(limits, Mapping):
            raise errors.ConfigurationError(f"{source}: topic {topic!r}: `limits` must be a table")
        clash = set(limits) & set(flat)
        if clash:
            raise errors.ConfigurationError(
                f"{source}: topic {topic!r} sets {sorted(clash)} both in `limits` and beside it; keep one"
            )
        flat.update(limits)
    unknown = set(flat) - set(_ROUTE_KEYS)
    if unknown:
        raise errors.ConfigurationError(
            f"{source}: topic {topic!r} has unknown keys {sorted(unknown)}; allowed: {', '.join(_ROUTE_KEYS)}"
            " (and a `limits` table)"
        )
    if "url" not in flat:
        raise errors.ConfigurationError(f"{source}: topic {topic!r} has no `url`")
    return flat


def load_routes(path: str | os.PathLike[str]) -> dict[str, Route]:
    """Read ``{topic: {url, headers, secret_headers, timeout_s}}`` from a ``.toml`` or ``.json`` file."""
    file = Path(path)
    source = f"routes file {file}"
    data = _read_routes_file(file, source)
    if not isinstance(data, dict) or not data:
        raise errors.ConfigurationError(f"{source} must map at least one topic to a route")
    routes: dict[str, Route] = {}
    for topic, spec in data.items():
        if not topic.strip() or len(topic) > 128 or any(ord(c) < 0x20 for c in topic):
            raise errors.ConfigurationError(
                f"{source}: topic {topic[:40]!r} must be 1-128 characters without control characters"
            )
        routes[topic] = _route_from(topic, spec, source)
    return routes


def _read_routes_file(file: Path, source: str) -> object:
    """A routes file's content, parsed as its suffix says (.toml or .json)."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise errors.ConfigurationError(f"{source} cannot be read: {exc.strerror}") from None
    try:
        if file.suffix.lower() == ".json":
            return json.loads(raw)
        if file.suffix.lower() == ".toml":
            return tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.ConfigurationError(f"{source} is not valid {file.suffix[1:].upper()}: {exc}") from None
    raise errors.ConfigurationError(f"{source}: use a .toml or .json file")
