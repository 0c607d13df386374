"""The RabbitMQ transport (``amqp://`` and ``amqps://`` routes, AMQP 0-9-1; the optional extra
``dagster-joblease[rabbitmq]``, aio-pika).

**Why aio-pika, not pika.** A dispatcher has several delivery threads and wants many publisher confirms
outstanding at once. pika's ``BlockingConnection`` is not thread-safe and waits for each confirm before
the next publish on its channel, so it would need a connection per delivery thread and still confirm one
message at a time on each; aio-pika (on aiormq) keeps any number of confirms outstanding on one channel,
and runs on the same one-event-loop-per-dispatcher design as the JetStream transport (nats-py is asyncio
only). The consumer helper (:mod:`dagster_joblease.consumers.rabbitmq`) uses the :class:`~dagster_joblease.
inbox.AsyncInbox` on the same loop style.

A row is published to the route's ``exchange`` with the route's ``routing_key`` (None: the row's topic;
``{ordering_key}`` standing for the row's key, ``_`` without one), as a persistent message whose
``message_id`` is the idempotency key and whose ``headers`` are the route's and the message's own, with
``mandatory`` set on a channel in confirm mode. "Sent" is the broker's confirm (``Basic.Ack``): the
message was routed to at least one queue and, for a durable queue, written. A message no queue is bound
for comes back (``Basic.Return``, ``NO_ROUTE``) and is final: ``DEAD`` with the broker's reason. So is a
publish to an exchange that does not exist (the broker closes the channel with ``NOT_FOUND``).

RabbitMQ keeps no record of message ids: a resend (a lost confirm, a dispatcher that died after
publishing) is a second copy in the queue, and the consumer drops it by ``message_id`` through its inbox.

When the dispatcher starts it connects to each broker and checks each route's exchange exists (a
passive declare): a missing one refuses the route. A broker that cannot be reached then does not stop the
dispatcher: its rows are retried, and the exchange is checked at the first connection. What is retried
and what is final is :func:`classify_exception`'s table. One connection per broker, one confirm channel
per exchange (a channel the broker closes takes only its own exchange's publishes with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping

import httpx

from dagster_joblease import errors
from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.routes import Route, fill_ordering_key
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
    import aio_pika
    import aio_pika.abc
    import aiormq.exceptions
except ImportError as exc:  # pragma: no cover - exercised by test_transports' no-extras import
    raise errors.ConfigurationError(
        "an amqp:// route needs aio-pika: pip install 'dagster-joblease[rabbitmq]'"
    ) from exc

__all__ = ["TABLE", "RabbitMQTransport", "Unsendable", "classify_exception", "routing_key_for"]

logger = logging.getLogger(__name__)


def routing_key_for(route: Route, topic: str, ordering_key: str | None) -> str:
    """The routing key a row is published with: the route's (None: the topic), ``{ordering_key}`` replaced
    by the row's key (``_`` without one). Raises :class:`Unsendable` past AMQP's 255 bytes."""
    template = topic if route.routing_key is None else route.routing_key
    key = fill_ordering_key(template, ordering_key)
    if len(key.encode("utf-8")) > 255:
        raise Unsendable(f"routing key {key[:60]!r}... is longer than AMQP's 255 bytes")
    return key


_RETRY, _DEAD = policy.Outcome.RETRY, policy.Outcome.DEAD
#: RabbitMQ's table (see :data:`~.broker.Table`).
TABLE: Table = (
    (Unsendable, _DEAD, False, "{exc}"),
    (
        aiormq.exceptions.PublishError,
        _DEAD,
        False,
        "unroutable, returned by the broker (no queue bound): {exc}",
    ),
    (aiormq.exceptions.DeliveryError, _RETRY, False, "the broker did not confirm the message (nack): {exc}"),
    (aiormq.exceptions.ChannelNotFoundEntity, _DEAD, False, "the exchange does not exist: {exc}"),
    (aiormq.exceptions.ChannelAccessRefused, _DEAD, False, "the broker refused access: {exc}"),
    (aiormq.exceptions.AuthenticationError, _RETRY, False, "the broker refused the credentials: {exc}"),
    (aiormq.exceptions.ConnectionClosed, _RETRY, False, "the connection to the broker closed: {name}: {exc}"),
    (aiormq.exceptions.AMQPConnectionError, _RETRY, False, "cannot reach the broker: {name}: {exc}"),
    (
        TimeoutError,
        _RETRY,
        True,
        "no publisher confirm before the deadline (it may be queued; resent): {exc}",
    ),
    (aiormq.exceptions.AMQPError, _RETRY, False, "AMQP: {name}: {exc}"),
    (aiormq.exceptions.ChannelInvalidStateError, _RETRY, False, "the channel closed: {exc}"),
    (OSError, _RETRY, False, "cannot reach the broker: {name}: {exc}"),
)


def classify_exception(exc: BaseException) -> policy.Classification:
    """RabbitMQ's table for a publish that raised instead of being confirmed."""
    return classify(TABLE, exc)


@dataclasses.dataclass
class _Broker(Endpoint):
    """One broker's connection and its confirm channels, one per exchange."""

    connection: aio_pika.abc.AbstractConnection | None = None
    #: exchange name → its confirm channel and the exchange on it.
    exchanges: dict[str, tuple[aio_pika.abc.AbstractChannel, aio_pika.abc.AbstractExchange]] = (
        dataclasses.field(default_factory=dict)
    )


def _open(connection: aio_pika.abc.AbstractConnection | None) -> bool:
    """Whether ``connection`` can still carry a publish (a broken one is forgotten by its close
    callback: aio-pika marks ``is_closed`` only on a close of ours)."""
    return connection is not None and not connection.is_closed


class RabbitMQTransport(BrokerTransport[_Broker]):
    """Publishes rows to RabbitMQ exchanges for one dispatcher (see the module's docstring)."""

    endpoint_name = "RabbitMQ broker"
    checked_name = "exchanges"
    unreachable = (OSError, TimeoutError, aiormq.exceptions.AMQPConnectionError)
    table = TABLE

    def __init__(
        self, routes: Mapping[str, Route], headers: Mapping[str, dict[str, str]], concurrency: int
    ) -> None:
        super().__init__(routes, headers, "joblease-rabbitmq")

    @staticmethod
    def endpoint_key(route: Route) -> str:
        url = httpx.URL(route.url)
        port = url.port or (5671 if url.scheme == "amqps" else 5672)
        return str(url.copy_with(port=port, query=None, fragment=None))

    def new_endpoint(self, url: str, credentials: str | None) -> _Broker:
        return _Broker(url, credentials)

    async def connect(self, endpoint: _Broker) -> None:
        await self._connect(endpoint)

    async def check_at_start(self, endpoint: _Broker, topic: str) -> None:
        try:
            await self._exchange(endpoint, topic)
        except aiormq.exceptions.ChannelNotFoundEntity:
            route = self._routes[topic]
            raise errors.ConfigurationError(
                f"topic {topic!r} (route {route.url[:200]!r}, exchange {route.exchange!r}): the "
                "exchange does not exist on the broker; declare it (with the bindings its consumers "
                "need) or fix `exchange`"
            ) from None

    async def close_endpoint(self, endpoint: _Broker) -> None:
        if endpoint.connection is not None and not endpoint.connection.is_closed:
            await endpoint.connection.close()

    async def _connect(self, broker: _Broker) -> aio_pika.abc.AbstractConnection:
        login, password = "guest", "guest"
        if broker.credentials is not None:
            login, _, password = broker.credentials.partition(":")
        broker.exchanges.clear()
        connection = await aio_pika.connect(
            broker.url,
            login=login,
            password=password,
            timeout=START_CONNECT_S,
            client_properties={"connection_name": "dagster-joblease dispatcher"},
        )

        def forget(sender: object, *_: object) -> None:
            # The connection broke (or closed): the next publish connects again.
            if broker.connection is sender:
                broker.connection = None
                broker.exchanges.clear()

        connection.close_callbacks.add(forget)
        broker.connection = connection
        return connection

    async def _exchange(self, broker: _Broker, topic: str) -> aio_pika.abc.AbstractExchange:
        """The route's exchange on its own confirm channel (opened, and the exchange checked, once)."""
        name = self._routes[topic].exchange
        assert name is not None
        opened = broker.exchanges.get(name)
        if opened is not None and not opened[0].is_closed:
            return opened[1]
        assert broker.connection is not None
        channel = await broker.connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = channel.default_exchange if name == "" else await channel.get_exchange(name, ensure=True)
        broker.exchanges[name] = (channel, exchange)
        return exchange

    # -- send --------------------------------------------------------------------------------------

    def send(
        self, message: OutboxMessage, route: Route, deadline: float, send_by: float | None
    ) -> policy.Classification:
        """Publish ``message`` and wait for the broker's confirm until ``deadline``."""
        amqp = aio_pika.Message(
            message.payload,
            message_id=message.idempotency_key,
            headers={**self._headers[message.topic], **message.headers},
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        key = routing_key_for(route, message.topic, message.ordering_key)
        if send_by is not None and time.monotonic() > send_by:
            raise TooLate
        self._loop.run(self._publish(message.topic, amqp, key, deadline), deadline)
        return policy.Classification(
            policy.Outcome.SENT, None, f"RabbitMQ confirmed ({route.exchange or '(default)'} → {key})"
        )

    async def _publish(self, topic: str, amqp: aio_pika.Message, key: str, deadline: float) -> None:
        broker = self._endpoint_of[topic]
        exchange = await self._ready(broker, topic)
        await exchange.publish(amqp, key, mandatory=True, timeout=max(0.001, deadline - time.monotonic()))

    async def _ready(self, broker: _Broker, topic: str) -> aio_pika.abc.AbstractExchange:
        """The route's exchange on an open connection, connecting (or reopening its channel) first."""
        name = self._routes[topic].exchange
        assert name is not None and broker.lock is not None
        opened = broker.exchanges.get(name)
        if opened is not None and _open(broker.connection) and not opened[0].is_closed:
            return opened[1]
        async with broker.lock:
            if not _open(broker.connection):
                if broker.connection is not None:
                    with contextlib.suppress(Exception):
                        await broker.connection.close()
                await self._connect(broker)
            return await self._exchange(broker, topic)
