"""The consumer side of the broker transports: run a handler for each message through the inbox, so each
idempotency key's effect is applied once however often the broker delivers it, and settle the message
(ack) only after the effect has committed.

- :mod:`.jetstream`: :class:`~.jetstream.JetStreamConsumer` for NATS JetStream messages (the key is the
  ``Nats-Msg-Id`` header; ``nats`` extra);
- :mod:`.rabbitmq`: :class:`~.rabbitmq.RabbitMQConsumer` for RabbitMQ deliveries (the key is the message's
  ``message_id``; ``rabbitmq`` extra).

Both share :mod:`.core`: the :class:`~.core.Delivery` a handler gets, how it runs through an
:class:`~dagster_joblease.inbox.Inbox` or :class:`~dagster_joblease.inbox.AsyncInbox`, and the pure table of
how a message is settled (:func:`~.core.settle_after`).
"""

from __future__ import annotations

from dagster_joblease.consumers.core import Delivery, Handled, Settle, settle_after

__all__ = ["Delivery", "Handled", "Settle", "settle_after"]
