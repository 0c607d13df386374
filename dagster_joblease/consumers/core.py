"""What the broker consumer helpers share: one message as its handler sees it, the handler's run through
the inbox, and how the message is settled afterwards (a pure table).

A message is acknowledged only once its effect has committed with the inbox's record of its key (or the
key was already done: a redelivery, replayed without running the handler). A failure rolls the effect
back and the message is redelivered; a message that can never apply (no key, or its key already used
with another payload) is rejected, for the broker's dead-letter handling. At-least-once delivery, an
effect applied once per key: not "exactly-once".
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from dagster_joblease import errors
from dagster_joblease.inbox import AsyncInbox, Inbox, InboxResult

__all__ = ["Delivery", "Handled", "Handler", "Settle", "apply", "settle_after"]


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One message as a handler sees it: its idempotency key, where it came from (subject or routing
    key), its payload and headers, and whether the broker says it was delivered before."""

    key: str
    source: str
    payload: bytes
    headers: Mapping[str, str]
    redelivered: bool


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


async def handle(inbox: Inbox | AsyncInbox[Any], delivery: Delivery | None, handler: Handler) -> Handled:
    """Apply one delivery (None: the message had no key) and say how to settle it."""
    if delivery is None:
        missing = errors.InvalidInboxInputError("idempotency key", "the message carries none")
        return Handled(Settle.REJECT, error=missing)
    try:
        result = await apply(inbox, delivery, handler)
    except Exception as exc:
        return Handled(settle_after(exc), error=exc)
    return Handled(Settle.ACK, result)
