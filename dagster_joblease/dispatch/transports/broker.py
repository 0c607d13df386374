"""What the broker transports (JetStream, RabbitMQ) share: a table of what is retried, looked up one way,
and the skeleton of a transport on one event-loop thread with one connection per broker endpoint,
connected and checked at start (an unreachable endpoint is logged, its rows retried and its routes
checked at the first connection)."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar

from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.dispatch.transports.loop import LoopThread

__all__ = ["START_CONNECT_S", "BrokerTransport", "Endpoint", "Table", "Unsendable", "classify"]


class Unsendable(Exception):
    """This row cannot be published on its route, whatever is retried (e.g. its ordering key cannot be a
    JetStream subject token, or makes a RabbitMQ routing key past AMQP's 255 bytes)."""


logger = logging.getLogger(__name__)

#: How long starting waits for each endpoint before it goes on without it (its rows are then retried).
START_CONNECT_S = 2.0

#: A transport's table, most specific first: (exception type, outcome, whether the message may have
#: reached the broker, reason with ``{exc}`` and ``{name}``).
Table = tuple[tuple[type[BaseException], policy.Outcome, bool, str], ...]


def classify(table: Table, exc: BaseException) -> policy.Classification:
    """``exc`` judged by ``table``'s first matching row (anything unmatched is retried)."""
    for kind, outcome, maybe_reached, reason in table:
        if isinstance(exc, kind):
            text = reason.format(exc=exc, name=type(exc).__name__)
            return policy.Classification(outcome, None, policy.bound(text), timed_out=maybe_reached)
    return policy.Classification(policy.Outcome.RETRY, None, policy.bound(f"{type(exc).__name__}: {exc}"))


@dataclasses.dataclass
class Endpoint:
    """One broker endpoint (scheme://host:port) and the topics routed to it."""

    url: str
    credentials: str | None
    topics: list[str] = dataclasses.field(default_factory=list)
    lock: asyncio.Lock | None = None


E = TypeVar("E", bound=Endpoint)


class BrokerTransport(abc.ABC, Generic[E]):
    """A transport whose client is asyncio's: ``routes`` grouped by endpoint, each connected and its
    routes checked at start on the transport's own event-loop thread."""

    #: What an endpoint is called in the log ("NATS server").
    endpoint_name: ClassVar[str]
    #: What the routes' check reads at the first connection when it could not at start ("streams").
    checked_name: ClassVar[str]
    #: The exceptions that mean an endpoint cannot be reached now.
    unreachable: ClassVar[tuple[type[BaseException], ...]]
    #: The transport's table of what is retried.
    table: ClassVar[Table]

    def __init__(
        self, routes: Mapping[str, Route], headers: Mapping[str, dict[str, str]], thread: str
    ) -> None:
        self._routes = dict(routes)
        self._headers = {topic: dict(h) for topic, h in headers.items()}
        self._endpoints: dict[str, E] = {}
        self._endpoint_of: dict[str, E] = {}
        for topic, route in self._routes.items():
            key = self.endpoint_key(route)
            if key not in self._endpoints:
                self._endpoints[key] = self.new_endpoint(key, route.credentials())
            self._endpoints[key].topics.append(topic)
            self._endpoint_of[topic] = self._endpoints[key]
        self._loop = LoopThread(thread)
        try:
            self._loop.run(self._start(), time.monotonic() + START_CONNECT_S * len(self._endpoints) + 5.0)
        except BaseException:
            self.close()
            raise

    @staticmethod
    @abc.abstractmethod
    def endpoint_key(route: Route) -> str:
        """The endpoint a route's rows go to (routes sharing it share a connection)."""

    @abc.abstractmethod
    def new_endpoint(self, url: str, credentials: str | None) -> E:
        """An endpoint not connected yet."""

    @abc.abstractmethod
    async def connect(self, endpoint: E) -> None:
        """Connect ``endpoint`` (raising what :attr:`unreachable` lists when it cannot be reached)."""

    @abc.abstractmethod
    async def check_at_start(self, endpoint: E, topic: str) -> None:
        """Check the topic's route on a fresh connection; raise ConfigurationError naming it if it cannot
        work."""

    @abc.abstractmethod
    async def close_endpoint(self, endpoint: E) -> None:
        """Close the endpoint's connection, if open."""

    async def _start(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.lock = asyncio.Lock()
            try:
                await asyncio.wait_for(self.connect(endpoint), START_CONNECT_S)
            except self.unreachable as exc:
                logger.warning(
                    "%s %s cannot be reached at start (%s: %s); its rows are retried, and its routes' %s "
                    "are checked at the first connection",
                    self.endpoint_name,
                    endpoint.url,
                    type(exc).__name__,
                    exc,
                    self.checked_name,
                    extra={"action": "broker_unreachable"},
                )
                continue
            for topic in endpoint.topics:
                await self.check_at_start(endpoint, topic)

    def classify_exception(self, exc: BaseException) -> policy.Classification:
        """This transport's table (:attr:`table`)."""
        return classify(self.table, exc)

    def close(self) -> None:
        """Close the connections and stop the event loop thread."""
        self._loop.close(self._close_all())

    async def _close_all(self) -> None:
        for endpoint in self._endpoints.values():
            await self.close_endpoint(endpoint)
