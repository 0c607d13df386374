"""dagster-joblease: one winner per logical run, and effects delivered once *per idempotency key*.

The guarantee is at-least-once delivery with end-to-end deduplication, not exactly-once: a worker can
perform an effect, lose its lease and die before recording success, and the next owner will perform it
again under the same idempotency key. The outbox, the dispatcher's ``Idempotency-Key`` header and the
consumer's inbox make that repetition harmless.

This top-level package never imports Dagster; the integration lives in :mod:`dagster_joblease.dagster`.
"""

from __future__ import annotations

from dagster_joblease.errors import (
    ConfigurationError,
    DispatchError,
    InboxConflictError,
    InboxInProgressError,
    InvalidJobIdentityError,
    InvalidLeaseOptionsError,
    InvalidPayloadError,
    JobLeaseError,
    LostLeaseError,
    NotFoundError,
    OutboxConflictError,
    RetentionWindowError,
    SchemaNotAtHeadError,
    StorageError,
)
from dagster_joblease.exclusive import ExclusiveOutcome
from dagster_joblease.identity import JobIdentity, JobType, colon_free_id, effect_key, idempotency_key
from dagster_joblease.lease import AcquireResult, Lease, LeaseService, LeaseStatus, NotAcquiredReason
from dagster_joblease.storage import (
    DATABASE_URL_ENV,
    check_schema,
    create_engine,
    current_revision,
    migrate,
    redact_url,
)

__all__ = [
    "DATABASE_URL_ENV",
    "AcquireResult",
    "ConfigurationError",
    "DispatchError",
    "ExclusiveOutcome",
    "InboxConflictError",
    "InboxInProgressError",
    "InvalidJobIdentityError",
    "InvalidLeaseOptionsError",
    "InvalidPayloadError",
    "JobIdentity",
    "JobLeaseError",
    "JobType",
    "Lease",
    "LeaseService",
    "LeaseStatus",
    "LostLeaseError",
    "NotAcquiredReason",
    "NotFoundError",
    "OutboxConflictError",
    "RetentionWindowError",
    "SchemaNotAtHeadError",
    "StorageError",
    "check_schema",
    "colon_free_id",
    "create_engine",
    "current_revision",
    "effect_key",
    "idempotency_key",
    "migrate",
    "redact_url",
]
