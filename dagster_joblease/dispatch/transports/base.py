"""The seam between the dispatcher and the wire: one :class:`OutboxMessage` per row, built in one place
(:func:`message_of`), and one :class:`Transport` per kind of destination, which maps the message to its
native form, sends it, and returns its acknowledgement as a :class:`~dagster_joblease.dispatch.policy.
Classification`.

Everything else (claims, backoff, dead letters, limits, per-key order, the dedupe window) is the
dispatcher's and the same for every transport. What a transport decides alone:

* what "sent" means: its acknowledgement (an HTTP 2xx, a JetStream publish ack, a RabbitMQ publisher
  confirm);
* what is retryable and what is final: its own pure table (``classify_exception``, and for HTTP
  :func:`~dagster_joblease.dispatch.policy.classify_response`), table-tested beside it;
* how the message's fields travel: the idempotency key as the downstream's dedupe key
  (``Idempotency-Key``, ``Nats-Msg-Id``, AMQP ``message_id``), and :attr:`OutboxMessage.headers` as native
  headers, beside the route's own static and secret headers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from dagster_joblease import tracing
from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.claims import Claimed
from dagster_joblease.dispatch.routes import Route

__all__ = ["NO_HEADERS", "OutboxMessage", "TooLate", "Transport", "message_of"]

#: A row's headers when it carries none of its own.
NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One row as every transport sends it.

    ``headers`` are the row's own (e.g. trace context), carried as the transport's native headers; the
    route's static and secret headers are the transport's configuration and added by it.
    """

    idempotency_key: str
    topic: str
    ordering_key: str | None
    payload: bytes
    headers: Mapping[str, str]


def message_of(row: Claimed) -> OutboxMessage:
    """The message a claimed row is sent as: the one place a row becomes a message."""
    # The row's creation trace context (dagster_joblease.tracing), read from its columns; none: no headers.
    headers = tracing.message_headers(row.trace) or NO_HEADERS
    return OutboxMessage(
        row.idempotency_key, row.topic, row.ordering_key, row.payload.encode("utf-8"), headers
    )


class TooLate(Exception):
    """A rate-admitted request could not start within RATE_LATE_S of its admission."""


class Transport(Protocol):
    """Sends messages to the routes of one kind of destination, for one dispatcher (shared by its
    delivery threads). Opening one checks what it can of its routes' destinations and raises
    :class:`~dagster_joblease.errors.ConfigurationError` naming the route when one cannot work."""

    def send(
        self, message: OutboxMessage, route: Route, deadline: float, send_by: float | None
    ) -> policy.Classification:
        """Send ``message`` to ``route`` and classify the acknowledgement; nothing may outlive
        ``deadline`` (local monotonic time). Raises :class:`TooLate` when ``send_by`` (local monotonic
        time) passed before the message left, and whatever the send raised (judged by
        :meth:`classify_exception`)."""
        ...

    def classify_exception(self, exc: BaseException) -> policy.Classification:
        """Judge a send that raised instead of returning an acknowledgement (this transport's table)."""
        ...

    def close(self) -> None:
        """Release connections and threads this transport opened."""
        ...
