"""The consumer side: run an effect at most once per idempotency key and replay its recorded response.

A row of ``joblease_inbox`` moves ``(absent) → IN_PROGRESS → DONE``. The claim (``IN_PROGRESS`` with a
random ``lock_token`` and ``locked_until`` on the *database* clock) is committed on its own, so a second
caller sees the key as in flight (HTTP 409) instead of waiting. The effect and the ``DONE`` record then
commit in **one transaction**, fenced by the lock token: if the claim expired and another consumer took it
over, this transaction rolls back, effect included. A claim whose holder crashed is taken over once its
``locked_until`` has passed on the database clock.

This follows the IETF ``Idempotency-Key`` draft (400 missing key, 409 in flight, 422 same key with another
payload, replay of the first response) and Brandur Leach's Stripe-like design, with the lock checked on
the database clock rather than the application's.

On SQLite, writers are serialized (``BEGIN IMMEDIATE``), so a second caller for a key that is being
processed in this same database waits for the effect to commit and then gets the replay instead of 409.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from dagster_joblease import errors, outbox
from dagster_joblease.options import MAX_DURATION_MS
from dagster_joblease.storage.clock import db_now, db_now_plus_ms, ms_until
from dagster_joblease.storage.engine import translate_errors
from dagster_joblease.storage.schema import inbox_table

__all__ = [
    "DEFAULT_LOCK_MS",
    "MAX_KEY_LENGTH",
    "Effect",
    "Inbox",
    "InboxResult",
    "InboxStatus",
    "InvalidInboxInputError",
    "request_fingerprint",
    "validate_idempotency_key",
]

logger = logging.getLogger(__name__)

DEFAULT_LOCK_MS = 30_000
MIN_LOCK_MS = 1
MAX_LOCK_MS = 24 * 3600 * 1000
MAX_KEY_LENGTH = outbox.MAX_KEY_LENGTH
MAX_BODY_CHARS = 1_000_000

#: An effect runs inside the inbox's transaction and returns the response to record: (HTTP status, body).
Effect = Callable[[sa.Connection], tuple[int, str]]


class InboxStatus(enum.StrEnum):
    IN_PROGRESS = "IN_PROGRESS"  #: claimed by a consumer until locked_until (database clock)
    DONE = "DONE"  #: the effect committed; the stored response is replayed


InvalidInboxInputError = errors.InvalidInboxInputError


@dataclasses.dataclass(frozen=True)
class InboxResult:
    """The response for a key: freshly produced by the effect, or ``replayed`` from the first time."""

    status_code: int
    body: str
    replayed: bool


def validate_idempotency_key(key: object) -> str:
    """Return ``key`` if it is a usable idempotency key, else raise :class:`InvalidInboxInputError`."""
    if not isinstance(key, str):
        raise InvalidInboxInputError("idempotency_key", f"must be a str, got {type(key).__name__}")
    if not key.strip():
        raise InvalidInboxInputError("idempotency_key", f"{key!r} is blank; send a non-empty key")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInboxInputError(
            "idempotency_key", f"is {len(key)} characters; at most {MAX_KEY_LENGTH} are allowed, shorten it"
        )
    for ch in key:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0:
            raise InvalidInboxInputError(
                "idempotency_key", f"{key[:40]!r} contains the control character U+{ord(ch):04X}; remove it"
            )
    return key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def request_fingerprint(payload: Any) -> str:
    """SHA-256 hex of the payload, insensitive to JSON formatting.

    Python values are hashed as :func:`outbox.canonical_json`. ``bytes``/``str`` are taken as a request
    body: if they parse as JSON, the canonical form of the parsed value is hashed (so key order and
    whitespace do not matter); otherwise the raw bytes (UTF-8 for ``str``) are hashed.
    """
    if isinstance(payload, bytes | bytearray | str):
        raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else bytes(payload)
        try:
            parsed = json.loads(raw, parse_constant=_reject_constant)
            return outbox.payload_fingerprint(parsed)
        except (ValueError, RecursionError, errors.InvalidPayloadError):
            return hashlib.sha256(raw).hexdigest()
    return outbox.payload_fingerprint(payload)


def _check_lock_ms(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_LOCK_MS <= value <= MAX_LOCK_MS:
        raise InvalidInboxInputError(
            "lock_ms",
            f"{value!r} must be an int between {MIN_LOCK_MS} and {MAX_LOCK_MS} (milliseconds); make it "
            "longer than the slowest effect, since a claim older than that is taken over",
        )
    return value


def _check_response(key: str, value: object) -> tuple[int, str]:
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and 100 <= value[0] <= 599
        and isinstance(value[1], str)
        and len(value[1]) <= MAX_BODY_CHARS
    ):
        return value[0], value[1]
    raise InvalidInboxInputError(
        "effect result",
        f"the effect for key {key!r} returned {value!r:.80}; it must return (status_code, body) with an int "
        f"HTTP status 100-599 and a str body of at most {MAX_BODY_CHARS} characters",
    )


def _insert(dialect_name: str) -> Any:
    return (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(inbox_table)


class Inbox:
    """Deduplicate incoming requests by idempotency key on a migrated engine (PostgreSQL or SQLite).

    Args:
        engine: an engine over a database migrated with :func:`dagster_joblease.migrate`.
        lock_ms: how long a claim stays exclusive. A consumer that crashes mid-effect blocks its key
            (409) for this long; an effect that runs longer than this may be taken over and then rolled
            back. Make it comfortably longer than the slowest effect.

    Example::

        inbox = Inbox(engine)

        def apply(conn: sa.Connection) -> tuple[int, str]:
            conn.execute(orders.insert().values(...))
            return 201, '{"created": true}'

        result = inbox.process(request.headers["Idempotency-Key"], request.body, apply)
    """

    def __init__(self, engine: sa.Engine, *, lock_ms: int = DEFAULT_LOCK_MS) -> None:
        self.engine = engine
        self.lock_ms = _check_lock_ms(lock_ms)

    def process(self, idempotency_key: str, payload: Any, effect: Effect) -> InboxResult:
        """Run ``effect`` once for ``idempotency_key``, or return the response recorded the first time.

        ``effect(connection)`` runs inside the transaction that records the key as done and returns
        ``(status_code, body)``; write the effect's rows on that connection so they commit (or roll back)
        together with the record.

        Raises:
            InvalidInboxInputError: a bad key (before any SQL) or a malformed effect result.
            InboxConflictError: the key was already used with a different payload (HTTP 422).
            InboxInProgressError: another consumer holds a live claim on the key (HTTP 409); retry later.

        If ``effect`` raises, its transaction rolls back, the claim is released and the exception
        propagates: the key can be retried. Unlike Stripe (and as the IETF draft permits), failures are
        not stored as the key's response, because a failed effect did not happen; only completed results
        are replayed. An effect that wants a rejection to be final returns a 4xx instead of raising.
        """
        key = validate_idempotency_key(idempotency_key)
        if not callable(effect):
            raise InvalidInboxInputError("effect", f"{effect!r:.80} is not callable; pass a function")
        fingerprint = request_fingerprint(payload)
        token = secrets.token_hex(16)
        replay = self._claim(key, fingerprint, token)
        if replay is not None:
            return replay
        try:
            with translate_errors("record an inbox result"), self.engine.begin() as conn:
                status_code, body = _check_response(key, effect(conn))
                t = inbox_table
                done = conn.execute(
                    sa.update(t)
                    .where(
                        t.c.idempotency_key == key,
                        t.c.lock_token == token,
                        t.c.status == InboxStatus.IN_PROGRESS.value,
                    )
                    .values(
                        status=InboxStatus.DONE.value,
                        lock_token=None,
                        locked_until=None,
                        response_status=status_code,
                        response_body=body,
                        completed_at=db_now(),
                    )
                    .returning(t.c.idempotency_key)
                ).first()
                if done is None:
                    # Our claim expired and another consumer took it over: roll the effect back.
                    raise errors.InboxInProgressError(idempotency_key=key)
        except errors.InboxInProgressError:
            logger.warning("inbox claim on %r was taken over before the effect committed; rolled back", key)
            raise
        except BaseException:
            self._release(key, token)
            raise
        logger.info("inbox key %r processed (status %d)", key, status_code, extra={"action": "inbox_done"})
        return InboxResult(status_code=status_code, body=body, replayed=False)

    def _claim(self, key: str, fingerprint: str, token: str) -> InboxResult | None:
        """Claim ``key`` (insert, or take over an expired claim); else return the replay or raise."""
        t = inbox_table
        until = db_now_plus_ms(sa.literal(self.lock_ms, sa.BigInteger()))
        with translate_errors("claim an inbox key"), self.engine.begin() as conn:
            stmt = _insert(conn.dialect.name).values(
                idempotency_key=key,
                payload_sha256=fingerprint,
                status=InboxStatus.IN_PROGRESS.value,
                lock_token=token,
                locked_until=until,
                created_at=db_now(),
            )
            # A claim whose holder stopped before committing left no effect behind, so a takeover may
            # record the new payload's fingerprint, exactly as after a released (failed) claim.
            stmt = stmt.on_conflict_do_update(
                index_elements=[t.c.idempotency_key],
                set_={
                    "payload_sha256": stmt.excluded.payload_sha256,
                    "lock_token": stmt.excluded.lock_token,
                    "locked_until": until,
                },
                where=sa.and_(t.c.status == InboxStatus.IN_PROGRESS.value, t.c.locked_until < db_now()),
            ).returning(t.c.created_at)
            # Two rounds: the conflicting row can vanish between the INSERT and the read (a released
            # claim or a purge); the second INSERT then simply succeeds.
            for _ in range(2):
                if conn.execute(stmt).first() is not None:
                    return None
                row = conn.execute(
                    sa.select(
                        t.c.status,
                        t.c.payload_sha256,
                        t.c.response_status,
                        t.c.response_body,
                        ms_until(t.c.locked_until).label("lock_left_ms"),
                    ).where(t.c.idempotency_key == key)
                ).first()
                if row is None:
                    continue
                if row.payload_sha256 != fingerprint:
                    raise errors.InboxConflictError(idempotency_key=key)
                if row.status == InboxStatus.DONE.value:
                    return InboxResult(
                        status_code=int(row.response_status), body=row.response_body or "", replayed=True
                    )
                left = row.lock_left_ms
                raise errors.InboxInProgressError(
                    idempotency_key=key, retry_after_ms=None if left is None else max(0, int(left))
                )
        raise errors.InboxInProgressError(idempotency_key=key)

    def _release(self, key: str, token: str) -> None:
        """Give back a claim after a failed effect, so the key can be retried at once."""
        t = inbox_table
        try:
            with translate_errors("release an inbox claim"), self.engine.begin() as conn:
                conn.execute(
                    sa.delete(t).where(
                        t.c.idempotency_key == key,
                        t.c.lock_token == token,
                        t.c.status == InboxStatus.IN_PROGRESS.value,
                    )
                )
        except errors.StorageError:
            logger.warning("could not release the inbox claim on %r; it frees itself when it expires", key)

    def purge(self, older_than_ms: int) -> int:
        """Delete completed keys finished more than ``older_than_ms`` ago (database clock); return how many.

        A purged key is new again: a replay after purging runs the effect a second time. Keep
        ``older_than_ms`` longer than the longest time a producer may retry (its outbox retention).
        """
        if (
            isinstance(older_than_ms, bool)
            or not isinstance(older_than_ms, int)
            or not 0 <= older_than_ms <= MAX_DURATION_MS
        ):
            raise InvalidInboxInputError(
                "older_than_ms",
                f"{older_than_ms!r} must be an int from 0 to {MAX_DURATION_MS} (100 years; milliseconds "
                "since completion)",
            )
        t = inbox_table
        cutoff = db_now_plus_ms(sa.literal(-older_than_ms, sa.BigInteger()))
        with translate_errors("purge inbox keys"), self.engine.begin() as conn:
            result = conn.execute(
                sa.delete(t).where(t.c.status == InboxStatus.DONE.value, t.c.completed_at < cutoff)
            )
        return int(result.rowcount)
