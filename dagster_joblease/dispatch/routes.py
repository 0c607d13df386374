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
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx

from dagster_joblease import errors

__all__ = ["RESERVED_HEADERS", "Route", "load_routes"]

#: Headers the dispatcher sets itself; a route may not override them.
RESERVED_HEADERS = frozenset(
    {"idempotency-key", "content-type", "content-length", "host", "transfer-encoding"}
)
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_TIMEOUT_S = 600.0


def _check_header_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not _TOKEN.match(name):
        raise errors.ConfigurationError(f"{where}: header name {name!r} is not a valid HTTP header name")
    if name.lower() in RESERVED_HEADERS:
        raise errors.ConfigurationError(
            f"{where}: header {name!r} is set by the dispatcher itself; remove it from the route"
        )
    return name


def _check_header_value(name: str, value: object, where: str) -> str:
    if (
        not isinstance(value, str)
        or not value.isascii()
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)
    ):
        raise errors.ConfigurationError(
            f"{where}: the value of header {name!r} must be a printable ASCII string"
        )
    return value


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one topic's rows go: an http(s) URL, static headers, secret headers and a timeout.

    Args:
        url: the destination; ``http`` or ``https`` with a host.
        headers: static, non-secret headers (e.g. ``{"X-Source": "joblease"}``).
        secret_headers: header name → *name of the environment variable* that holds its value.
        timeout_s: the whole request's deadline (seconds, > 0): connect, send, headers and body together,
            not per socket read, so a downstream that dribbles its answer cannot stretch it.
    """

    url: str
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict, kw_only=True)
    secret_headers: Mapping[str, str] = dataclasses.field(default_factory=dict, kw_only=True)
    timeout_s: float = dataclasses.field(default=10.0, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise errors.ConfigurationError(f"route url must be a str, got {type(self.url).__name__}")
        try:
            parsed = httpx.URL(self.url)
        except (httpx.InvalidURL, TypeError, ValueError):
            raise errors.ConfigurationError(
                f"route url {self.url[:200]!r} is not a valid URL; use e.g. https://host/path"
            ) from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise errors.ConfigurationError(
                f"route url {self.url[:200]!r} must be http:// or https:// with a host"
            )
        if parsed.userinfo:
            raise errors.ConfigurationError(
                "a route url must not embed credentials; put them in secret_headers (header → env variable)"
            )
        where = f"route {self.url[:200]!r}"
        headers = {
            _check_header_name(k, where): _check_header_value(k, v, where)
            for k, v in dict(self.headers).items()
        }
        secrets_ = {}
        for name, env in dict(self.secret_headers).items():
            _check_header_name(name, where)
            if not isinstance(env, str) or not _ENV_NAME.match(env):
                raise errors.ConfigurationError(
                    f"{where}: secret header {name!r} must name an environment variable "
                    f"(letters, digits, underscore), got {env!r}"
                )
            secrets_[name] = env
        clash = {k.lower() for k in headers} & {k.lower() for k in secrets_}
        if clash:
            raise errors.ConfigurationError(f"{where}: headers {sorted(clash)} are both static and secret")
        timeout = self.timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= _MAX_TIMEOUT_S
        ):
            raise errors.ConfigurationError(
                f"{where}: timeout_s {timeout!r} must be a number of seconds in (0, {_MAX_TIMEOUT_S:g}]"
            )
        object.__setattr__(self, "headers", MappingProxyType(headers))
        object.__setattr__(self, "secret_headers", MappingProxyType(secrets_))
        object.__setattr__(self, "timeout_s", float(timeout))

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
        return (
            f"Route(url={self.url!r}, headers={dict(self.headers)!r}, "
            f"secret_headers={dict(self.secret_headers)!r}, timeout_s={self.timeout_s!r})"
        )


def _route_from(topic: str, spec: object, source: str) -> Route:
    if not isinstance(spec, Mapping):
        raise errors.ConfigurationError(f"{source}: topic {topic!r} must map to a table with at least `url`")
    unknown = set(spec) - {"url", "headers", "secret_headers", "timeout_s"}
    if unknown:
        raise errors.ConfigurationError(
            f"{source}: topic {topic!r} has unknown keys {sorted(unknown)}; allowed: url, headers, "
            "secret_headers, timeout_s"
        )
    if "url" not in spec:
        raise errors.ConfigurationError(f"{source}: topic {topic!r} has no `url`")
    kwargs: dict[str, Any] = {}
    for key in ("headers", "secret_headers"):
        if key in spec:
            if not isinstance(spec[key], Mapping):
                raise errors.ConfigurationError(f"{source}: topic {topic!r}: `{key}` must be a table")
            kwargs[key] = spec[key]
    if "timeout_s" in spec:
        kwargs["timeout_s"] = spec["timeout_s"]
    return Route(spec["url"], **kwargs)


def load_routes(path: str | os.PathLike[str]) -> dict[str, Route]:
    """Read ``{topic: {url, headers, secret_headers, timeout_s}}`` from a ``.toml`` or ``.json`` file."""
    file = Path(path)
    source = f"routes file {file}"
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise errors.ConfigurationError(f"{source} cannot be read: {exc.strerror}") from None
    try:
        if file.suffix.lower() == ".json":
            data = json.loads(raw)
        elif file.suffix.lower() == ".toml":
            data = tomllib.loads(raw.decode("utf-8"))
        else:
            raise errors.ConfigurationError(f"{source}: use a .toml or .json file")
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.ConfigurationError(f"{source} is not valid {file.suffix[1:].upper()}: {exc}") from None
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
