"""A NATS JetStream consumer's handler run through the inbox (``nats`` extra): apply once per
``Nats-Msg-Id``, acknowledge after the effect commits, and a redelivered message replays.

Use an instance as the callback of a push subscription, or call it for each message a pull subscription
fetched::

    inbox = AsyncInbox(pool.connection)

    async def handler(conn, delivery):
        await conn.execute("INSERT INTO invoices ...", (...))

    consumer = JetStreamConsumer(inbox, handler)
    sub = await js.pull_subscribe("billing.>", durable="billing", stream="BILLING")
    for msg in await sub.fetch(10):
        await consumer(msg)

Settling (:func:`~dagster_joblease.consumers.core.settle_after`): ``ack`` once the effect committed or the
key was already done; ``nak`` (redelivered after ``retry_delay_s``) when the handler raised or another
consumer holds the key; ``term`` (never redelivered) for a message without ``Nats-Msg-Id`` or whose key was
used with another payload. A consumer that dies between the commit and the ack gets the message again,
and the inbox replays it without running the handler.
"""

from __future__ import annotations

import logging
from typing import Any

from dagster_joblease.consumers.core import Delivery, Handled, Handler, Settle, handle
from dagster_joblease.inbox import AsyncInbox, Inbox

try:
    import nats.errors
    from nats.aio.msg import Msg
except ImportError as exc:  # pragma: no cover - the nats extra is missing
    from dagster_joblease import errors

    raise errors.ConfigurationError(
        "the JetStream consumer needs nats-py: pip install 'dagster-joblease[nats]'"
    ) from exc

__all__ = ["JetStreamConsumer", "delivery_of"]

logger = logging.getLogger(__name__)


def delivery_of(msg: Msg) -> Delivery | None:
    """The message as a handler sees it (None: it has no ``Nats-Msg-Id``)."""
    headers = dict(msg.headers or {})
    key = headers.get("Nats-Msg-Id")
    if not key:
        return None
    try:
        redelivered = msg.metadata.num_delivered > 1
    except (ValueError, IndexError, nats.errors.Error):  # not delivered by a JetStream consumer
        redelivered = False
    return Delivery(key, msg.subject, msg.data, headers, redelivered)


class JetStreamConsumer:
    """Handles JetStream messages through an inbox (see the module's docstring).

    Args:
        inbox: an :class:`~dagster_joblease.inbox.AsyncInbox` (``handler`` a coroutine function) or an
            :class:`~dagster_joblease.inbox.Inbox` (``handler`` a plain function, run in a worker thread).
        handler: ``handler(connection, delivery)`` writes the effect on the inbox's connection.
        retry_delay_s: how long JetStream waits before redelivering a message whose effect failed.
    """

    def __init__(
        self, inbox: Inbox | AsyncInbox[Any], handler: Handler, *, retry_delay_s: float = 1.0
    ) -> None:
        self.inbox = inbox
        self.handler = handler
        self.retry_delay_s = retry_delay_s

    async def __call__(self, msg: Msg) -> Handled:
        handled = await handle(self.inbox, delivery_of(msg), self.handler)
        if handled.settled is Settle.ACK:
            await msg.ack()
        elif handled.settled is Settle.RETRY:
            logger.warning(
                "JetStream message on %s not applied, redelivered in %g s: %r",
                msg.subject,
                self.retry_delay_s,
                handled.error,
                extra={"action": "consumer_retry"},
            )
            await msg.nak(delay=self.retry_delay_s)
        else:
            logger.error(
                "JetStream message on %s rejected (never redelivered): %s",
                msg.subject,
                handled.error,
                extra={"action": "consumer_reject"},
            )
            await msg.term()
        return handled
