"""dagster-joblease: one winner per logical run, and effects delivered once *per idempotency key*.

The guarantee is at-least-once delivery with end-to-end deduplication, not exactly-once: a worker can
perform an effect, lose its lease and die before recording success, and the next owner will perform it
again under the same idempotency key. The outbox, the dispatcher's ``Idempotency-Key`` header and the
consumer's inbox make that repetition harmless.

This top-level package never imports Dagster; the integration lives in :mod:`dagster_joblease.dagster`.

The package root exports what a first program needs: an identity, the lease service and its lease, the
outbox's ``enqueue_once``/``enqueue_many``, the dispatcher and its route, the inbox, ``create_engine`` and
``migrate``, and the base error. Everything else is public in the module it lives in:
:mod:`dagster_joblease.errors`, :mod:`~dagster_joblease.identity`, :mod:`~dagster_joblease.lease`,
:mod:`~dagster_joblease.batch`, :mod:`~dagster_joblease.outbox`, :mod:`~dagster_joblease.dispatch`,
:mod:`~dagster_joblease.inbox`, :mod:`~dagster_joblease.admin`, :mod:`~dagster_joblease.storage`,
:mod:`~dagster_joblease.testing`.
"""

from __future__ import annotations

from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.errors import JobLeaseError
from dagster_joblease.identity import JobIdentity
from dagster_joblease.inbox import Inbox
from dagster_joblease.lease import Lease, LeaseService
from dagster_joblease.outbox import enqueue_many, enqueue_once
from dagster_joblease.storage import create_engine, migrate

__all__ = [
    "Dispatcher",
    "Inbox",
    "JobIdentity",
    "JobLeaseError",
    "Lease",
    "LeaseService",
    "Route",
    "create_engine",
    "enqueue_many",
    "enqueue_once",
    "migrate",
]
