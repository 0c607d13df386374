"""dagster-joblease: one winner per logical run, and effects delivered once *per idempotency key*.

The guarantee is at-least-once delivery with end-to-end deduplication, not exactly-once: a worker can
perform an effect, lose its lease and die before recording success, and the next owner will perform it
again under the same idempotency key. The outbox, the dispatcher's ``Idempotency-Key`` header and the
consumer's inbox make that repetition harmless.

This top-level package never imports Dagster; the integration lives in :mod:`dagster_joblease.dagster`.
"""

from __future__ import annotations

from dagster_joblease.admin import (
    LeaseRow,
    OutboxRow,
    OutboxStats,
    admin_fail,
    list_leases,
    list_outbox,
    outbox_stats,
    purge_leases,
    purge_sent,
    requeue,
    show_lease,
)
from dagster_joblease.batch import (
    MAX_BATCH_KEYS,
    BatchClaim,
    BatchHeartbeat,
    BatchWrite,
    KeyClaim,
    claim_many,
    complete_many,
    fail_many,
    fenced_transaction_many,
    heartbeat_many,
    release_many,
)
from dagster_joblease.dispatch import (
    Dispatcher,
    DispatchReport,
    Route,
    RowOutcome,
    load_routes,
)
from dagster_joblease.errors import (
    AdminArgumentError,
    AdminRefusedError,
    ConfigurationError,
    DispatchError,
    InboxConflictError,
    InboxInProgressError,
    InvalidFaultError,
    InvalidInboxInputError,
    InvalidJobIdentityError,
    InvalidLeaseOptionsError,
    InvalidPayloadError,
    JobLeaseError,
    LostBatchLeaseError,
    LostLeaseError,
    NotFoundError,
    OutboxConflictError,
    RetentionWindowError,
    SchemaNotAtHeadError,
    StorageError,
)
from dagster_joblease.exclusive import (
    ExclusiveOutcome,
)
from dagster_joblease.identity import (
    JobIdentity,
    JobType,
    colon_free_id,
    effect_key,
    idempotency_key,
)
from dagster_joblease.inbox import (
    Inbox,
    InboxResult,
    InboxStatus,
)
from dagster_joblease.lease import (
    AcquireResult,
    Lease,
    LeaseService,
    LeaseStatus,
    NotAcquiredReason,
)
from dagster_joblease.outbox import (
    DueSummary,
    OutboxStatus,
    canonical_json,
    due_summary,
    enqueue_once,
    payload_fingerprint,
)
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
    "MAX_BATCH_KEYS",
    "AcquireResult",
    "AdminArgumentError",
    "AdminRefusedError",
    "BatchClaim",
    "BatchHeartbeat",
    "BatchWrite",
    "ConfigurationError",
    "DispatchError",
    "DispatchReport",
    "Dispatcher",
    "DueSummary",
    "ExclusiveOutcome",
    "Inbox",
    "InboxConflictError",
    "InboxInProgressError",
    "InboxResult",
    "InboxStatus",
    "InvalidFaultError",
    "InvalidInboxInputError",
    "InvalidJobIdentityError",
    "InvalidLeaseOptionsError",
    "InvalidPayloadError",
    "JobIdentity",
    "JobLeaseError",
    "JobType",
    "KeyClaim",
    "Lease",
    "LeaseRow",
    "LeaseService",
    "LeaseStatus",
    "LostBatchLeaseError",
    "LostLeaseError",
    "NotAcquiredReason",
    "NotFoundError",
    "OutboxConflictError",
    "OutboxRow",
    "OutboxStats",
    "OutboxStatus",
    "RetentionWindowError",
    "Route",
    "RowOutcome",
    "SchemaNotAtHeadError",
    "StorageError",
    "admin_fail",
    "canonical_json",
    "check_schema",
    "claim_many",
    "colon_free_id",
    "complete_many",
    "create_engine",
    "current_revision",
    "due_summary",
    "effect_key",
    "enqueue_once",
    "fail_many",
    "fenced_transaction_many",
    "heartbeat_many",
    "idempotency_key",
    "list_leases",
    "list_outbox",
    "load_routes",
    "migrate",
    "outbox_stats",
    "payload_fingerprint",
    "purge_leases",
    "purge_sent",
    "redact_url",
    "release_many",
    "requeue",
    "show_lease",
]
