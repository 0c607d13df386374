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
import logging
from typing import Any

from dagster_joblease.consumers.core import Delivery, Handled, Handler, Settle, handle
from dagster_joblease.inbox import AsyncInbox, Inbox

try:
    import aio_pika.abc
except ImportError as exc:  # pragma: no cover - the rabbitmq extra is missing
    from dagster_joblease import errors

    raise errors.ConfigurationError(
        "the RabbitMQ consumer needs aio-pika: pip install 'dagster-joblease[rabbitmq]'"
    ) from exc

__all__ = ["RabbitMQConsumer", "delivery_of"]

logger = logging.getLogger(__name__)


def delivery_of(message: aio_pika.abc.AbstractIncomingMessage) -> Delivery | None:
    """The message as a handler sees it (None: it has no ``message_id``)."""
    if not message.message_id:
        return None
    headers = {str(k): str(v) for k, v in (message.headers or {}).items()}
    return Delivery(
        message.message_id, message.routing_key or "", message.body, headers, bool(message.redelivered)
    )


class RabbitMQConsumer:
    """Handles RabbitMQ deliveries through an inbox (see the module's docstring).

    Args:
        inbox: an :class:`~dagster_joblease.inbox.AsyncInbox` (``handler`` a coroutine function) or an
            :class:`~dagster_joblease.inbox.Inbox` (``handler`` a plain function, run in a worker thread).
        handler: ``handler(connection, delivery)`` writes the effect on the inbox's connection.
        retry_delay_s: how long a message whose effect failed waits before it is requeued (RabbitMQ
            redelivers a requeued message at once).
    """

    def __init__(
        self, inbox: Inbox | AsyncInbox[Any], handler: Handler, *, retry_delay_s: float = 1.0
    ) -> None:
        self.inbox = inbox
        self.handler = handler
        self.retry_delay_s = retry_delay_s

    async def __call__(self, message: aio_pika.abc.AbstractIncomingMessage) -> Handled:
        handled = await handle(self.inbox, delivery_of(message), self.handler)
        if handled.settled is Settle.ACK:
            await message.ack()
        elif handled.settled is Settle.RETRY:
            logger.warning(
                "RabbitMQ message %s not applied, requeued in %g s: %r",
                message.message_id,
                self.retry_delay_s,
                handled.error,
                extra={"action": "consumer_retry"},
            )
            await asyncio.sleep(self.retry_delay_s)
            await message.nack(requeue=True)
        else:
            logger.error(
                "RabbitMQ message %s rejected (not requeued): %s",
                message.message_id,
                handled.error,
                extra={"action": "consumer_reject"},
            )
            await message.reject(requeue=False)
        return handled
