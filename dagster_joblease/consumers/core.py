"""What the broker consumer helpers share: one message as its handler sees it, the handler's run through
the inbox, and how the message is settled afterwards (a pure table).

A message is acknowledged only once its effect has committed with the inbox's record of its key (or the
key was already done: a redelivery, replayed without running the handler). A failure rolls the effect
back and the message is redelivered; a message that can never apply (no key, or its key already used
with another payload) is rejected, for the broker's dead-letter handling. At-least-once delivery, an
effect applied once per key: not "exactly-once".
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from dagster_joblease import errors, tracing
from dagster_joblease.inbox import AsyncInbox, Inbox, InboxResult

__all__ = ["BrokerConsumer", "Delivery", "Handled", "Handler", "Settle", "apply", "handle", "settle_after"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One message as a handler sees it: its idempotency key, where it came from (subject or routing
    key), its payload and headers, and whether the broker says it was delivered before."""

    key: str
    source: str
    payload: bytes
    headers: Mapping[str, str]
    redelivered: bool
    #: Where the broker says the message went, as OpenTelemetry's messaging conventions name it (the
    #: process span's destination and its own attributes); None: ``source``.
    destination: tuple[str, Mapping[str, str]] | None = None


class Settle(enum.Enum):
    """What becomes of a message after its handler's run."""

    #: Acknowledge: the effect committed now, or did before (a replay).
    ACK = "ack"
    #: Redeliver it later: the effect failed and rolled back, or another consumer holds its key now.
    RETRY = "retry"
    #: Never redeliver (the broker's dead-letter handling takes it): it can never apply.
    REJECT = "reject"


@dataclasses.dataclass(frozen=True)
class Handled:
    """A message's fate: how it was settled, the inbox's answer (None when it did not apply), and the
    error that kept it from applying."""

    settled: Settle
    result: InboxResult | None = None
    error: BaseException | None = None


#: A handler: ``handler(connection, delivery)`` writes the effect on the inbox's connection; it may return
#: an answer to store, ``(status, body)``, or None (stored as ``(200, "")``). For an :class:`AsyncInbox`
#: it is a coroutine function; for an :class:`Inbox` a plain function (run in a worker thread).
Handler = Callable[[Any, Delivery], Any]


def settle_after(error: BaseException | None) -> Settle:
    """How a message is settled once its handler ran (``error`` None) or raised ``error``. Pure."""
    if error is None:
        return Settle.ACK
    if isinstance(error, errors.InboxConflictError | errors.InvalidInboxInputError):
        return Settle.REJECT  # the key was used with another payload, or the message has no usable key
    return Settle.RETRY  # the effect rolled back, or the key is in flight elsewhere: redelivery applies it


def _answer(value: object) -> object:
    return (200, "") if value is None else value


async def apply(inbox: Inbox | AsyncInbox[Any], delivery: Delivery, handler: Handler) -> InboxResult:
    """Run ``handler`` once for ``delivery.key`` through ``inbox`` (or replay the key's stored answer)."""
    if isinstance(inbox, AsyncInbox):

        async def effect(connection: Any) -> tuple[Any, ...]:
            result: Awaitable[Any] = handler(connection, delivery)
            return _answer(await result)  # type: ignore[return-value]

        return await inbox.process(delivery.key, delivery.payload, effect)

    def sync_effect(connection: Any) -> tuple[Any, ...]:
        return _answer(handler(connection, delivery))  # type: ignore[return-value]

    return await asyncio.to_thread(inbox.process, delivery.key, delivery.payload, sync_effect)


async def handle(
    inbox: Inbox | AsyncInbox[Any], delivery: Delivery | None, handler: Handler, *, system: str = "joblease"
) -> Handled:
    """Apply one delivery (None: the message had no key) and say how to settle it. ``system``: the
    ``messaging.system`` of the process span (the broker the message came from)."""
    if delivery is None:
        missing = errors.InvalidInboxInputError("idempotency key", "the message carries none")
        return Handled(Settle.REJECT, error=missing)
    try:
        # The effect continues the producer's trace (the message's traceparent/tracestate), if it has one.
        name, attributes = delivery.destination or (delivery.source, None)
        with tracing.processing(
            name, delivery.headers, idempotency_key=delivery.key, system=system, attributes=attributes
        ):
            result = await apply(inbox, delivery, handler)
    except Exception as exc:
        return Handled(settle_after(exc), error=exc)
    return Handled(Settle.ACK, result)


M = TypeVar("M")


class BrokerConsumer(abc.ABC, Generic[M]):
    """A broker's messages handled through an inbox and settled after (see :mod:`dagster_joblease.consumers`).

    Args:
        inbox: an :class:`~dagster_joblease.inbox.AsyncInbox` (``handler`` a coroutine function) or an
            :class:`~dagster_joblease.inbox.Inbox` (``handler`` a plain function, run in a worker thread).
        handler: ``handler(connection, delivery)`` writes the effect on the inbox's connection.
        retry_delay_s: how long before a message whose effect failed is delivered again.
    """

    #: The broker's name in the log.
    broker: ClassVar[str]
    #: ``messaging.system`` of the process span: the broker's OpenTelemetry value, which the dispatcher's
    #: send span of the same message names too (:data:`dagster_joblease.tracing.MESSAGING_SYSTEMS`).
    system: ClassVar[str]

    def __init__(
        self, inbox: Inbox | AsyncInbox[Any], handler: Handler, *, retry_delay_s: float = 1.0
    ) -> None:
        self.inbox = inbox
        self.handler = handler
        self.retry_delay_s = retry_delay_s

    @abc.abstractmethod
    def delivery(self, message: M) -> Delivery | None:
        """The message as a handler sees it (None: it carries no idempotency key)."""

    @abc.abstractmethod
    async def ack(self, message: M) -> None: ...

    @abc.abstractmethod
    async def retry(self, message: M) -> None:
        """Have the message delivered again after :attr:`retry_delay_s`."""

    @abc.abstractmethod
    async def reject(self, message: M) -> None:
        """Never deliver the message again."""

    async def __call__(self, message: M) -> Handled:
        delivery = self.delivery(message)
        handled = await handle(self.inbox, delivery, self.handler, system=self.system)
        what = delivery.key if delivery is not None else "without a key"
        if handled.settled is Settle.ACK:
            await self.ack(message)
        elif handled.settled is Settle.RETRY:
            logger.warning(
                "%s message %s not applied, delivered again in %g s: %r",
                self.broker,
                what,
                self.retry_delay_s,
                handled.error,
                extra={"action": "consumer_retry"},
            )
            await self.retry(message)
        else:
            logger.error(
                "%s message %s rejected (never delivered again): %s",
                self.broker,
                what,
                handled.error,
                extra={"action": "consumer_reject"},
            )
            await self.reject(message)
        return handled
