"""A RabbitMQ consumer's handler run through the inbox (``rabbitmq`` extra, aio-pika, as the RabbitMQ
transport: see :mod:`dagster_joblease.dispatch.transports.rabbitmq` for why): apply once per
``message_id``, acknowledge after the effect commits, and a redelivered message (or a second copy the
dispatcher published after a lost confirm) replays.

Use an instance as the callback of ``queue.consume`` (without ``no_ack``)::

    inbox = AsyncInbox(pool.connection)

    async def handler(conn, delivery):
        await conn.execute("INSERT INTO invoices ...", (...))

    await queue.consume(RabbitMQConsumer(inbox, handler))

Settling (:func:`~dagster_joblease.consumers.core.settle_after`): ``ack`` once the effect committed or the
key was already done; ``nack`` with requeue (after ``retry_delay_s``) when the handler raised or another
consumer holds the key; ``reject`` without requeue (to the queue's dead-letter exchange, if it has one)
for a message without ``message_id`` or whose key was used with another payload.
"""

from __future__ import annotations

import asyncio

from dagster_joblease import tracing
from dagster_joblease.consumers.core import BrokerConsumer, Delivery

try:
    import aio_pika.abc
except ImportError as exc:  # pragma: no cover - the rabbitmq extra is missing
    from dagster_joblease import errors

    raise errors.ConfigurationError(
        "the RabbitMQ consumer needs aio-pika: pip install 'dagster-joblease[rabbitmq]'"
    ) from exc

__all__ = ["RabbitMQConsumer"]


class RabbitMQConsumer(BrokerConsumer[aio_pika.abc.AbstractIncomingMessage]):
    """Handles RabbitMQ deliveries through an inbox (see the module's docstring and
    :class:`~dagster_joblease.consumers.core.BrokerConsumer` for the arguments; RabbitMQ redelivers a
    requeued message at once, so a failed one waits ``retry_delay_s`` before it is requeued)."""

    broker = "RabbitMQ"
    system = tracing.MESSAGING_SYSTEMS["rabbitmq"]

    def delivery(self, message: aio_pika.abc.AbstractIncomingMessage) -> Delivery | None:
        if not message.message_id:
            return None
        headers = {str(k): str(v) for k, v in (message.headers or {}).items()}
        routing_key = message.routing_key or ""
        # RabbitMQ's conventions: the destination is the exchange ("" for the default one), the routing
        # key an attribute of its own.
        where = {"messaging.rabbitmq.destination.routing_key": routing_key} if routing_key else {}
        return Delivery(
            message.message_id,
            routing_key,
            message.body,
            headers,
            bool(message.redelivered),
            destination=(message.exchange or "", where),
        )

    async def ack(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await message.ack()

    async def retry(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await asyncio.sleep(self.retry_delay_s)
        await message.nack(requeue=True)

    async def reject(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await message.reject(requeue=False)
