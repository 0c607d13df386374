"""The CDC hand-over: events written for change-data capture (Debezium's Outbox Event Router) instead of the
dispatcher.

:func:`enqueue_event` writes one row of ``joblease_outbox_event`` per idempotency key, insert-only, in the
caller's transaction, with the router's columns:

=====================  ========================================================================
column                 value
=====================  ========================================================================
``id``                 the idempotency key (the router's event id: the Kafka header ``id``)
``aggregatetype``      the topic (``route.by.field``: Kafka topic ``outbox.event.<topic>``)
``aggregateid``        the ordering key, else the idempotency key (the Kafka key: per-key order)
``type``               the topic (an additional field, e.g. the header ``eventType``)
``payload``            the payload, canonical JSON (jsonb on PostgreSQL)
``tracingspancontext`` the W3C trace context of the enqueuing span, as ``java.util.Properties`` text
=====================  ========================================================================

The connector reads each committed INSERT from the WAL in commit order, so a key's events reach its Kafka
partition in the order their transactions committed; a rolled-back transaction leaves nothing in the WAL
to read. The row is never updated (the router treats an UPDATE as invalid) and the dispatcher never reads
the table: a topic is either routed to the dispatcher (``enqueue_once``) or handed over here, never both.
Retention (:func:`dagster_joblease.admin.purge_events`) deletes old rows (the router ignores DELETEs);
a row stays long enough that a repeat of its key is recognised and writes nothing. docs/cdc.md has the
connector's configuration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa

from dagster_joblease import errors, tracing
from dagster_joblease.outbox import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    check_max_bytes,
    check_ordering_key,
    prepare_row,
)
from dagster_joblease.storage import driver
from dagster_joblease.storage import outbox_events as store
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import outbox_event_table
from dagster_joblease.storage.transaction import callers_transaction

if TYPE_CHECKING:
    from sqlalchemy import orm

__all__ = ["enqueue_event", "span_context_properties"]


def span_context_properties(traced: tracing.TraceContext) -> str | None:
    """A trace context as the text of a ``java.util.Properties`` (``Properties.store``'s escapes for
    ``\\``, ``=``, ``:``, ``#`` and ``!``), the form the router's ``tracing.span.context.field`` is read
    in; None for a row without one."""
    headers = tracing.message_headers(traced)
    if not headers:
        return None
    return "".join(f"{name}={_escaped(value)}\n" for name, value in headers.items())


def _escaped(value: str) -> str:
    for char in "\\=:#!":
        value = value.replace(char, "\\" + char)
    return value


def enqueue_event(
    connection: sa.Connection | psycopg.Connection[Any] | orm.Session,
    *,
    idempotency_key: str,
    topic: str,
    payload: Any,
    ordering_key: str | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> bool:
    """Write an event for the CDC connector inside the caller's transaction; True if inserted, False if
    the key already has the same event.

    The connection styles, the refusal of a connection that would commit on its own, and the validation
    of key, topic, payload and ordering key are :func:`~dagster_joblease.outbox.enqueue_once`'s. A repeat
    with the same key, topic, payload and ordering key is a no-op and writes nothing (no second INSERT
    reaches the WAL); the same key with anything else raises :class:`OutboxConflictError`. The ordering
    key becomes the Kafka key (``aggregateid``): a key's events keep their commit order. When an
    OpenTelemetry span is active, a ``create {topic}`` span is recorded and its context written in the
    same INSERT (``tracingspancontext``).

    Example::

        with engine.begin() as conn:
            conn.execute(invoices.insert().values(...))
            enqueue_event(conn, idempotency_key=effect_key(lease.idempotency_key, "invoice"),
                          topic="invoices", payload={"v": 1, "invoice": 42}, ordering_key="customer-42")
    """
    target = callers_transaction(connection, clause=outbox_event_table)
    key, _topic, text, fingerprint = prepare_row(
        idempotency_key, topic, payload, check_max_bytes(max_payload_bytes)
    )
    aggregateid = check_ordering_key(ordering_key) or key
    db = driver.in_transaction(target)
    with (
        translate_errors("enqueue a CDC outbox event"),
        tracing.creating(topic, idempotency_key=key) as traced,
    ):
        params = {"key": key, "topic": topic, "aggregateid": aggregateid, "payload_text": text}
        if store.insert(db, **params, sha256=fingerprint, tracingspancontext=span_context_properties(traced)):
            return True
        found = store.existing(db, key)
    # The table is insert-only and purged by age alone: a row that conflicted is there to read (a purge
    # deleting it in between would have to pass the whole retention window during this statement).
    if found is None:
        raise errors.StorageError(f"CDC event {key!r} conflicted but could not be read back; retry")
    if found == (fingerprint, topic, aggregateid):
        return False
    raise errors.OutboxConflictError(
        idempotency_key=key,
        existing_sha256=found[0],
        new_sha256=fingerprint,
        existing_topic=found[1],
        new_topic=topic,
        existing_ordering_key=found[2],
        new_ordering_key=aggregateid,
    )
