"""Errors raised by dagster-joblease.

Every error derives from :class:`JobLeaseError`, so one ``except`` catches them all. Invalid input also
derives from :class:`ValueError`. Messages name the offending value, the rule, and the fix; they never
contain a database URL or a credential.

::

    JobLeaseError
    ├── InvalidJobIdentityError (ValueError)    type / code / run_key broke a rule
    ├── InvalidLeaseOptionsError (ValueError)   lease_ms / heartbeat_ms out of range
    ├── InvalidPayloadError (ValueError)        outbox payload not JSON, too large, bad topic or key
    │   ├── InvalidInboxInputError              inbox key, lock time or effect result broke a rule
    │   └── InvalidOrderingKeyError             an outbox ordering key broke its rules
    ├── AdminArgumentError (ValueError)         an admin call's argument is out of its rules
    ├── AdminRefusedError                       the row's state makes an admin change unsafe
    ├── ConfigurationError                      bad route, missing environment variable, bad URL
    │   └── InvalidFaultError (ValueError)      a receiver fault injection broke a rule
    ├── LostLeaseError                          a fenced write found another owner (or none)
    │   └── LostBatchLeaseError                 the same, for a lease of a set (names all lost keys)
    ├── OutboxConflictError                     same idempotency key, different payload
    ├── InboxConflictError                      consumer saw the same key with a different payload
    ├── InboxInProgressError                    consumer is still processing that key
    ├── InboxStaleFenceError                    a fencing token older than one the consumer accepted
    ├── DispatchError                           delivery could not be attempted
    ├── NotFoundError                           an admin command named a row that does not exist
    ├── RetentionWindowError (ValueError)       purge window shorter than the configured minimum
    └── StorageError                            database unreachable or failing (cause kept)
        └── SchemaNotAtHeadError                the database schema is behind (or ahead of) this package
"""

from __future__ import annotations

__all__ = [
    "AdminArgumentError",
    "AdminRefusedError",
    "ConfigurationError",
    "DispatchError",
    "InboxConflictError",
    "InboxInProgressError",
    "InboxStaleFenceError",
    "InvalidFaultError",
    "InvalidInboxInputError",
    "InvalidJobIdentityError",
    "InvalidLeaseOptionsError",
    "InvalidOrderingKeyError",
    "InvalidPayloadError",
    "JobLeaseError",
    "LostBatchLeaseError",
    "LostLeaseError",
    "NotFoundError",
    "OutboxBackpressureError",
    "OutboxConflictError",
    "RetentionWindowError",
    "SchemaNotAtHeadError",
    "StorageError",
]

_GUARANTEE = (
    "dagster-joblease gives at-least-once delivery with end-to-end deduplication, not exactly-once: "
    "any external effect must be deduplicated downstream by the idempotency key."
)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class JobLeaseError(Exception):
    """Base class of every dagster-joblease error."""


class InvalidJobIdentityError(JobLeaseError, ValueError):
    """A job identity field broke a rule; raised before any database work."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"invalid {field} {_short(value)}: {rule}")


class InvalidLeaseOptionsError(JobLeaseError, ValueError):
    """A lease timing option is out of range; raised before any database work."""

    def __init__(self, option: str, value: object, rule: str, *, message: str | None = None) -> None:
        self.option = option
        self.value = value
        self.rule = rule
        super().__init__(message or f"invalid {option} {_short(value)}: {rule}")


class InvalidPayloadError(JobLeaseError, ValueError):
    """An outbox row was refused before anything was written."""

    def __init__(self, field: str, rule: str, *, message: str | None = None) -> None:
        self.field = field
        self.rule = rule
        super().__init__(message or f"invalid outbox {field}: {rule}")


class InvalidInboxInputError(InvalidPayloadError):
    """An inbox argument (key, lock time, effect result) broke a rule; raised before anything is written."""

    def __init__(self, field: str, rule: str, *, message: str | None = None) -> None:
        self.field = field
        self.rule = rule
        JobLeaseError.__init__(self, message or f"invalid inbox {field}: {rule}")


class InvalidOrderingKeyError(InvalidPayloadError):
    """An ``ordering_key`` broke its rules (a non-empty str of at most 128 printable characters, no
    surrounding whitespace); raised before anything is written."""


class AdminArgumentError(JobLeaseError, ValueError):
    """An administrative call got an argument outside its rules; nothing was read or changed."""


class AdminRefusedError(JobLeaseError):
    """The row's current state makes the requested change unsafe; nothing was changed."""


class ConfigurationError(JobLeaseError):
    """Configuration is missing or wrong (a route, an environment variable, a database URL)."""


class InvalidFaultError(ConfigurationError, ValueError):
    """A reference-receiver fault injection (``ReceiverServer.inject_next``) got a bad argument."""


class LostLeaseError(JobLeaseError):
    """A fenced write matched no row: the lease expired and was reclaimed, or was already finished.

    The worker must stop. Effects it already performed may still happen again under the next owner; only
    downstream deduplication by the idempotency key makes that harmless.
    """

    def __init__(self, *, lease_id: int, attempt: int, idempotency_key: str, action: str) -> None:
        self.lease_id = lease_id
        self.attempt = attempt
        self.idempotency_key = idempotency_key
        self.action = action
        super().__init__(
            f"cannot {action} lease {lease_id} (attempt {attempt}, key {idempotency_key}): this worker no "
            "longer owns it (it expired and was reclaimed by another worker, or was already completed, "
            f"failed or released). Stop work now. {_GUARANTEE}"
        )


class LostBatchLeaseError(LostLeaseError):
    """A lease of a set was lost: ``idempotency_key`` (and ``lease_id``, ``attempt``) name the first lost
    key in key order, ``lost_keys`` all of them, ``keys`` every key of the set.

    Raised by a fenced transaction over a set (nothing of it committed; every lease of the set is then
    failed for a retry and marked lost) and by ``BatchWrite.raise_if_lost``.
    """

    def __init__(
        self,
        *,
        lease_id: int,
        attempt: int,
        idempotency_key: str,
        action: str,
        lost_keys: tuple[str, ...],
        keys: tuple[str, ...],
    ) -> None:
        self.lost_keys = lost_keys
        self.keys = keys
        super().__init__(lease_id=lease_id, attempt=attempt, idempotency_key=idempotency_key, action=action)
        others = len(lost_keys) - 1
        if others > 0:
            self.args = (f"{self.args[0]} ({others} more of the set's {len(keys)} leases lost too)",)


class OutboxConflictError(JobLeaseError):
    """The same idempotency key was enqueued with a different payload or for a different topic."""

    def __init__(
        self,
        *,
        idempotency_key: str,
        existing_sha256: str,
        new_sha256: str,
        existing_topic: str | None = None,
        new_topic: str | None = None,
        existing_ordering_key: str | None = None,
        new_ordering_key: str | None = None,
    ) -> None:
        self.idempotency_key = idempotency_key
        self.existing_sha256 = existing_sha256
        self.new_sha256 = new_sha256
        self.existing_topic = existing_topic
        self.new_topic = new_topic
        self.existing_ordering_key = existing_ordering_key
        self.new_ordering_key = new_ordering_key
        if existing_topic is not None and new_topic is not None and existing_topic != new_topic:
            what = f"an effect for topic {existing_topic!r}, not {new_topic!r}"
        elif existing_ordering_key != new_ordering_key and existing_sha256 == new_sha256:
            what = f"an effect with ordering key {existing_ordering_key!r}, not {new_ordering_key!r}"
        else:
            what = f"a different payload (sha256 {existing_sha256[:12]}… vs {new_sha256[:12]}…)"
        super().__init__(
            f"outbox key {idempotency_key!r} already holds {what}: one identity must mean one effect. "
            "Derive a distinct key per effect with effect_key(run_key, name), or keep the payload "
            "deterministic."
        )


class OutboxBackpressureError(JobLeaseError):
    """``enqueue_once(..., max_pending=N)`` found N rows of the topic already pending; nothing was written.

    Retryable: the producer (a leased op) should fail and try again later, once the downstream caught up,
    rather than pile more work onto it. Roll back the transaction (its domain change too) and retry.
    """

    retryable = True

    def __init__(self, *, topic: str, pending: int, max_pending: int) -> None:
        self.topic = topic
        self.pending = pending
        self.max_pending = max_pending
        super().__init__(
            f"outbox topic {topic!r} already has {pending} pending row(s), the most "
            f"max_pending={max_pending} "
            "allows; nothing was written. Retry later (the downstream is behind: see `joblease outbox "
            "status`), or raise max_pending"
        )


class InboxConflictError(JobLeaseError):
    """The consumer already saw this key with a different payload (HTTP 422)."""

    def __init__(
        self, *, idempotency_key: str, first_fingerprint: str | None = None, first_seen: str | None = None
    ) -> None:
        self.idempotency_key = idempotency_key
        #: The fingerprint of the request the key was first used with (never its body), when known.
        self.first_fingerprint = first_fingerprint
        #: When the key was first seen (ISO 8601, UTC, the database clock), when known.
        self.first_seen = first_seen
        first = ""
        if first_fingerprint is not None:
            first = f" (fingerprint {first_fingerprint}" + (
                f", first seen {first_seen})" if first_seen else ")"
            )
        super().__init__(
            f"idempotency key {idempotency_key!r} was already used with a different payload{first}; "
            "a key must not be reused for another request"
        )


class InboxInProgressError(JobLeaseError):
    """Another consumer is processing this key right now (HTTP 409); retry later."""

    def __init__(self, *, idempotency_key: str, retry_after_ms: int | None = None) -> None:
        self.idempotency_key = idempotency_key
        #: How long the current claim lasts at most (database clock), when known: a fair Retry-After.
        self.retry_after_ms = retry_after_ms
        super().__init__(f"idempotency key {idempotency_key!r} is being processed; retry later")


class InboxStaleFenceError(JobLeaseError):
    """A request's fencing number is lower than one already accepted for its key (HTTP 409).

    The sender holds a lease that was reclaimed (its ``attempt`` is older than the newest holder's): it
    must stop, not retry.
    """

    def __init__(self, *, idempotency_key: str, fence: int, accepted_fence: int) -> None:
        self.idempotency_key = idempotency_key
        self.fence = fence
        self.accepted_fence = accepted_fence
        super().__init__(
            f"idempotency key {idempotency_key!r} came with fencing token {fence}, but token "
            f"{accepted_fence} was already accepted for it: the sender's lease was taken over by a newer "
            "holder; stop this attempt (do not retry it)"
        )


class DispatchError(JobLeaseError):
    """Delivery could not be attempted (for example the dispatcher is misconfigured)."""


class NotFoundError(JobLeaseError):
    """An administrative command named a row that does not exist."""


class RetentionWindowError(JobLeaseError, ValueError):
    """A purge window is shorter than the configured minimum retention."""


class StorageError(JobLeaseError):
    """The database could not be reached or failed; the driver error is kept as ``__cause__``."""


class SchemaNotAtHeadError(StorageError):
    """The database schema does not match this version of dagster-joblease."""

    def __init__(
        self,
        *,
        db_revision: str | None,
        head_revision: str,
        database: str | None = None,
        advice: str | None = None,
    ) -> None:
        """``database``: which database, as ``storage.engine.describe_database`` names it; ``advice``:
        the command that fixes that database (``storage.engine.upgrade_advice``)."""
        self.db_revision = db_revision
        self.head_revision = head_revision
        self.database = database
        of = f" of {database}" if database else ""
        super().__init__(
            f"the joblease schema{of} is at revision {db_revision or 'none (not installed)'} but this "
            f"package needs {head_revision}; "
            + (advice or "run `joblease db upgrade` (or dagster_joblease.migrate(engine))")
        )
