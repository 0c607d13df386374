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

from dagster_joblease import tracing
from dagster_joblease.consumers.core import BrokerConsumer, Delivery

try:
    import nats.errors
    from nats.aio.msg import Msg
except ImportError as exc:  # pragma: no cover - the nats extra is missing
    from dagster_joblease import errors

    raise errors.ConfigurationError(
        "the JetStream consumer needs nats-py: pip install 'dagster-joblease[nats]'"
    ) from exc

__all__ = ["JetStreamConsumer"]


class JetStreamConsumer(BrokerConsumer[Msg]):
    """Handles JetStream messages through an inbox (see the module's docstring and
    :class:`~dagster_joblease.consumers.core.BrokerConsumer` for the arguments)."""

    broker = "JetStream"
    system = tracing.MESSAGING_SYSTEMS["jetstream"]

    def delivery(self, message: Msg) -> Delivery | None:
        headers = dict(message.headers or {})
        key = headers.get("Nats-Msg-Id")
        if not key:
            return None
        try:
            redelivered = message.metadata.num_delivered > 1
        except (ValueError, IndexError, nats.errors.Error):  # not delivered by a JetStream consumer
            redelivered = False
        return Delivery(key, message.subject, message.data, headers, redelivered)

    async def ack(self, message: Msg) -> None:
        await message.ack()

    async def retry(self, message: Msg) -> None:
        await message.nak(delay=self.retry_delay_s)

    async def reject(self, message: Msg) -> None:
        await message.term()
