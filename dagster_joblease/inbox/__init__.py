"""The consumer side: apply each idempotency key once and replay its stored answer.

- :class:`Inbox`: on a SQLAlchemy engine (PostgreSQL or SQLite), for WSGI apps, workers and plain code;
- :class:`AsyncInbox`: on PostgreSQL through SQLAlchemy's async engine or a psycopg async pool;
- :class:`InboxMiddleware`: either of them as pure ASGI middleware (Starlette, FastAPI, any ASGI app),
  with :func:`inbox_connection` giving the app the transaction its effect must be written in.

All three share one semantics (:mod:`dagster_joblease.inbox.core`) and one statement module
(:mod:`dagster_joblease.storage.inbox`).
"""

from __future__ import annotations

from dagster_joblease.errors import InvalidInboxInputError
from dagster_joblease.inbox.aio import AsyncInbox, AsyncInboxTransaction
from dagster_joblease.inbox.asgi import InboxMiddleware, RequestParts, fingerprint_request, inbox_connection
from dagster_joblease.inbox.core import (
    DEFAULT_LOCK_MS,
    MAX_LOCK_MS,
    MIN_LOCK_MS,
    Answer,
    InboxResult,
    request_fingerprint,
    validate_idempotency_key,
)
from dagster_joblease.inbox.sync import Effect, Inbox, InboxTransaction
from dagster_joblease.outbox import MAX_KEY_LENGTH
from dagster_joblease.storage.inbox import ADVISORY_LOCK_CLASS, InboxStatus

__all__ = [
    "ADVISORY_LOCK_CLASS",
    "DEFAULT_LOCK_MS",
    "MAX_KEY_LENGTH",
    "MAX_LOCK_MS",
    "MIN_LOCK_MS",
    "Answer",
    "AsyncInbox",
    "AsyncInboxTransaction",
    "Effect",
    "Inbox",
    "InboxMiddleware",
    "InboxResult",
    "InboxStatus",
    "InboxTransaction",
    "InvalidInboxInputError",
    "RequestParts",
    "fingerprint_request",
    "inbox_connection",
    "request_fingerprint",
    "validate_idempotency_key",
]
