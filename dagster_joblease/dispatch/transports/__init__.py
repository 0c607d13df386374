"""How a row leaves: the :class:`Transport` interface (:mod:`.base`) and its implementations, one module
each. A route's ``transport`` (from its URL's scheme) says which one sends its rows; a transport whose
library is an optional extra is imported only when a route needs it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import httpx

from dagster_joblease.dispatch.routes import Route
from dagster_joblease.dispatch.transports.base import (
    NO_HEADERS,
    OutboxMessage,
    TooLate,
    Transport,
    message_of,
)

__all__ = ["NO_HEADERS", "OutboxMessage", "TooLate", "Transport", "message_of", "open_transports"]

_Opener = Callable[[Mapping[str, Route], Mapping[str, dict[str, str]], int, "httpx.Client | None"], Transport]


def _http(
    routes: Mapping[str, Route],
    headers: Mapping[str, dict[str, str]],
    concurrency: int,
    client: httpx.Client | None,
) -> Transport:
    from dagster_joblease.dispatch.transports.http import HttpTransport

    return HttpTransport(routes, headers, concurrency, client)


def _jetstream(
    routes: Mapping[str, Route],
    headers: Mapping[str, dict[str, str]],
    concurrency: int,
    client: httpx.Client | None,
) -> Transport:
    from dagster_joblease.dispatch.transports.jetstream import JetStreamTransport

    return JetStreamTransport(routes, headers, concurrency)


def _rabbitmq(
    routes: Mapping[str, Route],
    headers: Mapping[str, dict[str, str]],
    concurrency: int,
    client: httpx.Client | None,
) -> Transport:
    from dagster_joblease.dispatch.transports.rabbitmq import RabbitMQTransport

    return RabbitMQTransport(routes, headers, concurrency)


#: transport name → how to open it for its routes.
_OPENERS: dict[str, _Opener] = {"http": _http, "jetstream": _jetstream, "rabbitmq": _rabbitmq}


def open_transports(
    routes: Mapping[str, Route],
    headers: Mapping[str, dict[str, str]],
    concurrency: int,
    client: httpx.Client | None,
) -> dict[str, Transport]:
    """topic → the transport that sends its rows: one per kind of route, shared by that kind's topics.
    ``headers``: topic → the route's headers, resolved; ``client``: the HTTP transport's client (None: its
    own). If one fails to open, those already open are closed and the error raised."""
    kinds: dict[str, dict[str, Route]] = {}
    for topic, route in routes.items():
        kinds.setdefault(route.transport, {})[topic] = route
    opened: dict[str, Transport] = {}
    try:
        for kind, its_routes in kinds.items():
            opened[kind] = _OPENERS[kind](
                its_routes, {t: headers[t] for t in its_routes}, concurrency, client
            )
    except BaseException:
        for transport in opened.values():
            transport.close()
        raise
    return {topic: opened[route.transport] for topic, route in routes.items()}
