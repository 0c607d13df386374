"""A PostgreSQL (or SQLite) lease with one live winner per logical run, fenced by a rotating owner token.

State machine of a row: ``RUNNING → SUCCESS | FAIL``; ``FAIL → RUNNING`` (reclaim); a ``RUNNING`` row
whose ``expires_at`` has passed on the *database* clock ``→ RUNNING`` (reclaim by another worker).
``SUCCESS`` is never reclaimed. Every claim rotates ``owner_token`` and increments ``attempt`` (a fencing
number); heartbeat, complete, fail and release only touch the row while the caller's token is current.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import logging
import os
import secrets
import socket
import threading
import unicodedata
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Generic, TypeVar

import sqlalchemy as sa

from dagster_joblease import checks, errors, identity, options, wire
from dagster_joblease.storage import driver, leases
from dagster_joblease.storage.engine import fork_safe, translate_errors

__all__ = [
    "AcquireResult",
    "ExclusiveOutcome",
    "Lease",
    "LeaseService",
    "LeaseStatus",
    "NotAcquiredReason",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ERROR_CHARS = 4_000
RELEASED_ERROR = "released by its holder before finishing"


class LeaseStatus(enum.StrEnum):
    RUNNING = "RUNNING"  #: held; reclaimable once expires_at passes on the database clock
    SUCCESS = "SUCCESS"  #: done for good; never reclaimed
    FAIL = "FAIL"  #: failed or released; the next acquire reclaims it


class NotAcquiredReason(enum.StrEnum):
    """Why an acquire did not win."""

    HELD = "held by a live lease"
    SUCCEEDED = "already succeeded"
    CONTENDED = "lost a race for the same run"


def bound_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Error text as stored: at most ``limit`` characters, so one huge traceback cannot bloat the row."""
    if len(text) <= limit:
        return text
    # The marker's length depends on the number it reports; size it for the largest possible count.
    marker_len = len(f"… [{len(text)} chars cut]")
    kept = max(limit - marker_len, 0)
    return (text[:kept] + f"… [{len(text) - kept} chars cut]")[:limit]


MAX_HOLDER_CHARS = 255  #: the lease table's ``holder`` column


def _holder() -> str:
    return _holder_of(os.getpid())


@functools.cache
def _holder_of(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}"[:MAX_HOLDER_CHARS]


def default_holder() -> str:
    """The holder label of a claim made without one: ``host:pid`` of the claiming process."""
    return _holder()


def claim_terms(
    timing: options.LeaseTiming,
    holder: str | None,
    *,
    lease_ms: int | None,
    heartbeat_ms: int | None,
    holder_override: str | None,
) -> tuple[options.LeaseTiming, str]:
    """The timing and holder label a claim records: the call's options where given, else the service's
    (``timing``, ``holder``), else the defaults (the length's heartbeat interval, ``host:pid``)."""
    if lease_ms is not None or heartbeat_ms is not None:
        timing = options.resolve_timing(lease_ms, heartbeat_ms, defaults=timing)
    if holder_override is not None:
        return timing, validate_holder(holder_override)
    return timing, holder or _holder()


def validate_holder(value: object) -> str:
    """A holder label as stored: 1-255 characters, no control characters (it shows in CLI tables)."""
    if not isinstance(value, str):
        raise errors.InvalidLeaseOptionsError("holder", value, f"must be a str, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_HOLDER_CHARS or value != value.strip():
        raise errors.InvalidLeaseOptionsError(
            "holder",
            value,
            f"must be 1-{MAX_HOLDER_CHARS} characters without surrounding whitespace; shorten it",
        )
    if any(unicodedata.category(ch) == "Cc" for ch in value):
        raise errors.InvalidLeaseOptionsError(
            "holder", value, "must not contain control characters; use a printable label such as host:pid"
        )
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Lease:
    """A claim on a logical run. ``owner_token`` fences; ``attempt`` is the fencing number.

    ``lost`` becomes true as soon as this process learns (by a heartbeat or a fenced write) that another
    worker owns the run now.
    """

    id: int
    identity: identity.JobIdentity
    # A fencing capability: whoever has it can renew, complete or fail this claim. Never in a repr (a
    # log line or a traceback's locals would hand it out).
    owner_token: str = dataclasses.field(repr=False)
    attempt: int
    lease_ms: int
    expires_at: datetime
    previous_error: str | None = None
    # A one-way flag the heartbeat thread raises (a list, so the frozen lease can carry it; cheaper to
    # make than a threading.Event on every claim).
    _lost: list[bool] = dataclasses.field(default_factory=list, repr=False)

    @property
    def idempotency_key(self) -> str:
        return self.identity.idempotency_key

    @property
    def reclaimed(self) -> bool:
        """True when an earlier attempt held this run (it failed, was released, or expired)."""
        return self.attempt > 1

    @property
    def lost(self) -> bool:
        return bool(self._lost)

    def headers(self, *, key_format: str = "bare") -> dict[str, str]:
        """The headers for a request this holder sends a downstream itself (not through the outbox).

        ``Idempotency-Key`` (bare, or ``key_format="sf-string"`` for the IETF draft's form) and
        ``Fencing-Token`` with :attr:`attempt`, which grows with every reclaim: a downstream that keeps
        the highest token it accepted per key (the inbox does) refuses a holder whose lease was taken
        over (409) instead of handing it the newer holder's answer. An outbox row needs no fencing
        header: it is written in the holder's fenced transaction.
        """
        return {
            wire.IDEMPOTENCY_KEY: wire.format_key(self.idempotency_key, key_format),
            wire.FENCING_TOKEN: str(self.attempt),
        }

    def ensure_held(self) -> None:
        """Raise :class:`LostLeaseError` if the lease is known to be lost; call it before an effect."""
        if self.lost:
            raise self._lost_error("continue under")

    def _lost_error(self, action: str) -> errors.LostLeaseError:
        return errors.LostLeaseError(
            lease_id=self.id, attempt=self.attempt, idempotency_key=self.idempotency_key, action=action
        )


def _claimed_lease(
    id: int,
    job: identity.JobIdentity,
    owner_token: str,
    attempt: int,
    lease_ms: int,
    expires_at: datetime,
    previous_error: str | None,
) -> Lease:
    """The lease of a claim just won, its fields as the database returned them, set without the frozen
    dataclass's per-field ``__init__`` (a fifth of the Python around a claim)."""
    lease = object.__new__(Lease)
    lease.__dict__.update(
        id=id,
        identity=job,
        owner_token=owner_token,
        attempt=attempt,
        lease_ms=lease_ms,
        expires_at=expires_at,
        previous_error=previous_error,
        _lost=[],
    )
    return lease


@dataclasses.dataclass(frozen=True)
class AcquireResult:
    """The outcome of an acquire: a lease, or the reason there is none."""

    lease: Lease | None
    reason: NotAcquiredReason | None = None

    @property
    def acquired(self) -> bool:
        return self.lease is not None

    @classmethod
    def _won(cls, lease: Lease) -> AcquireResult:
        result = object.__new__(cls)
        result.__dict__.update(lease=lease, reason=None)
        return result


#: The result of a refusal, one per reason (immutable, so every refusal for a reason can share it).
_REFUSED = {reason: AcquireResult(lease=None, reason=reason) for reason in NotAcquiredReason}


_REASONS = {
    LeaseStatus.SUCCESS.value: NotAcquiredReason.SUCCEEDED,
    LeaseStatus.RUNNING.value: NotAcquiredReason.HELD,
}

#: How many lock keys a service remembers having met an existing row for (then it forgets them all and
#: starts again): its next claim of such a key sends the reclaim-or-status statement first, so a repeated
#: refusal, or the reclaim of a run that failed, is one round trip instead of two (and burns no id of the
#: sequence). Only keys whose claim met a row go in: new keys, the common case, never evict them.
KNOWN_KEYS = 4096


# -- run_exclusive: the outcome and the heartbeat thread ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExclusiveOutcome(Generic[T]):
    """What :meth:`LeaseService.run_exclusive` did: ran ``fn`` (``acquired``) and its ``result``, or why
    it did not."""

    acquired: bool
    result: T | None = None
    reason: NotAcquiredReason | None = None
    lease: Lease | None = None

    @property
    def outcome(self) -> str:
        """``won``, ``reclaimed`` or ``skipped: <reason>``: the label shown in logs and the Dagster UI."""
        if self.lease is not None:
            return "reclaimed" if self.lease.reclaimed else "won"
        return f"skipped: {self.reason.value if self.reason else 'not acquired'}"


class _Heartbeat(threading.Thread):
    """Renews the lease every ``interval_ms`` until stopped or until the lease turns out to be lost."""

    def __init__(self, service: LeaseService, lease: Lease, interval_ms: int) -> None:
        super().__init__(name=f"joblease-heartbeat-{lease.id}", daemon=True)
        self._service = service
        self._lease = lease
        self._interval_s = interval_ms / 1000
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            try:
                self._service.heartbeat(self._lease)
            except errors.LostLeaseError:
                return  # heartbeat() has already marked the lease lost; the callback sees it at once
            except errors.StorageError as exc:
                # A transient database failure: keep trying; the lease only dies if renewals stay
                # impossible for the rest of its length, and then the next fenced write says so.
                logger.warning("heartbeat for lease %d failed: %s", self._lease.id, exc)
            except Exception:
                # Anything else (a bug, a misconfigured engine): a thread that died here would let the
                # lease expire silently while the work goes on. Say so loudly and keep renewing; if
                # renewals never succeed, the lease expires and the next fenced write raises.
                logger.exception("heartbeat for lease %d failed unexpectedly; still renewing", self._lease.id)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()


def error_text(error: str | BaseException) -> str:
    """A failure as stored and reported: a str as given, an exception as ``TypeName: message``."""
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"


class LeaseService:
    """Acquire, renew and finish leases on a SQLAlchemy engine (PostgreSQL or SQLite).

    Args:
        engine: an engine over a database migrated with :func:`dagster_joblease.migrate`.
        lease_ms: default lease length (15 minutes).
        heartbeat_ms: default renewal interval for :meth:`run_exclusive` (``min(60 s, lease_ms // 3)``).
        holder: the label recorded as the holder of leases this service takes (default ``host:pid`` of
            the claiming process); the Dagster layer records its run here.

    Example::

        service = LeaseService(create_engine("postgresql+psycopg://app@db/app"))
        outcome = service.run_exclusive(JobIdentity.schedule("daily-billing", "2026-11-29"), bill)
        if not outcome.acquired:
            print("skipped:", outcome.reason)
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        holder: str | None = None,
    ) -> None:
        self.engine = fork_safe(engine)  # a forked child never uses a connection of its parent
        self.timing = options.resolve_timing(lease_ms, heartbeat_ms)
        self.holder = None if holder is None else validate_holder(holder)
        #: Lock keys whose row this service has met (see :data:`KNOWN_KEYS`).
        self._known: set[str] = set()

    # -- acquire -----------------------------------------------------------------------------------

    def try_acquire(
        self,
        job: identity.JobIdentity,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        holder: str | None = None,
    ) -> AcquireResult:
        """Claim or reclaim ``job``; on a loss, say why.

        ``holder`` overrides the service's holder label for this claim. The claim records the holder's
        lease length and heartbeat interval on the row (default: the service's; with only ``lease_ms``
        given, that length's default interval): others judge this holder stale by them. A caller that
        will not heartbeat records ``heartbeat_ms=0`` (judged by expiry only).
        """
        if not isinstance(job, identity.JobIdentity):
            raise errors.InvalidJobIdentityError("identity", job, "must be a JobIdentity")
        timing, label = claim_terms(
            self.timing, self.holder, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, holder_override=holder
        )
        length = timing.lease_ms
        token = secrets.token_hex(16)
        key = job._key
        params = {
            "p_lock_key": key,
            "p_job_type": job.type.value,
            "p_code": job.code,
            "p_run_key": job.run_key,
            "p_owner_token": token,
            "p_lease_ms": length,
            "p_heartbeat_ms": timing.heartbeat_ms,
            "p_holder": label,
        }
        known = self._known
        hinted = key in known
        with driver.statements(self.engine, "acquire a lease") as db:
            row, current, met = leases.claim(db, params, hinted=hinted)
        if met != hinted:
            if hinted:
                known.discard(key)  # the row had gone
            else:
                if len(known) >= KNOWN_KEYS:
                    known.clear()
                known.add(key)  # the next claim of this key will likely meet this row again
        if row is None:
            reason = _REASONS.get(current or "", NotAcquiredReason.CONTENDED)
            if logger.isEnabledFor(logging.INFO):
                logger.info(
                    "lease not acquired for %s: %s", job, reason.value, extra={"action": "lease_skipped"}
                )
            return _REFUSED[reason]
        lease_id, attempt, expires_at, last_error = row
        lease = _claimed_lease(
            lease_id, job, token, attempt, length, expires_at, last_error if attempt > 1 else None
        )
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "lease %s for %s (attempt %d)",
                "reclaimed" if attempt > 1 else "acquired",
                job,
                attempt,
                extra={"action": "lease_reclaimed" if attempt > 1 else "lease_acquired"},
            )
        return AcquireResult._won(lease)

    def acquire(
        self,
        job: identity.JobIdentity,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        holder: str | None = None,
    ) -> Lease | None:
        """Claim or reclaim ``job``; ``None`` when another worker holds it or it already succeeded.

        The row records the service's heartbeat setting (or ``heartbeat_ms``): heartbeat at least that
        often, or pass ``heartbeat_ms=0`` to be judged by the lease's expiry only.
        """
        return self.try_acquire(job, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, holder=holder).lease

    def fail_dead_holder(
        self,
        job: identity.JobIdentity,
        *,
        attempt: int,
        owner_token: str | None = None,
        stale_ms: int,
        reason: str,
    ) -> bool:
        """Take a dead holder's ``RUNNING`` lease away at once (``FAIL``), so the next acquire reclaims it.

        One statement, fenced on what the caller observed: the row must still be ``RUNNING`` at
        ``attempt`` (and ``owner_token``, when given) with a heartbeat older than ``stale_ms`` on the
        database clock. A holder that heartbeated in between, or a claim that moved on, keeps its lease;
        a surviving holder that stopped heartbeating is fenced out (its writes raise
        :class:`LostLeaseError`). The caller decides that the holder is dead (e.g. its Dagster run is
        finished); returns True when this call failed the lease.
        """
        if not isinstance(job, identity.JobIdentity):
            raise errors.InvalidJobIdentityError("identity", job, "must be a JobIdentity")
        checks.integer(
            "attempt", attempt, minimum=1, why="the attempt read from the row", error=checks.lease_option
        )
        checks.milliseconds("stale_ms", stale_ms, minimum=1, error=checks.lease_option)
        with driver.statements(self.engine, "fail a dead holder's lease") as db:
            failed = leases.fail_dead_holder(
                db,
                job.idempotency_key,
                attempt=attempt,
                owner_token=owner_token,
                stale_ms=stale_ms,
                error=bound_error(reason),
            )
        if failed is not None:
            logger.warning(
                "lease %d for %s (attempt %d) taken from a dead holder: %s",
                failed,
                job,
                attempt,
                reason,
                extra={"action": "lease_dead_holder"},
            )
        return failed is not None

    # -- fenced writes -----------------------------------------------------------------------------

    def _lost(self, lease: Lease, action: str) -> errors.LostLeaseError:
        lease._lost.append(True)
        logger.warning("lease %d lost on %s", lease.id, action, extra={"action": "lease_lost"})
        return lease._lost_error(action)

    def assert_held(self, connection: sa.Connection, lease: Lease) -> None:
        """Inside ``connection``'s transaction, make sure ``lease`` is still this worker's live lease.

        This fences the caller's own writes (domain rows, the outbox row), not just ours: on PostgreSQL the
        lease row stays locked (``FOR UPDATE``) until the transaction ends, so no reclaim can slip in
        between this check and the commit; SQLite's ``BEGIN IMMEDIATE`` already holds the write lock. A
        lease that was reclaimed, finished or expired raises :class:`LostLeaseError`, and the caller's
        transaction rolls back with it.
        """
        with translate_errors("check a lease"):
            held = leases.is_held(driver.sqlalchemy_statements(connection), lease.id, lease.owner_token)
        if not held:
            lease._lost.append(True)
            raise lease._lost_error("commit a fenced transaction under")

    @contextlib.contextmanager
    def fenced_transaction(self, lease: Lease) -> Iterator[sa.Connection]:
        """One transaction that commits only while ``lease`` is still ours (see :meth:`assert_held`).

        Write the domain change and its outbox row here: either both commit under a live lease, or
        neither does.
        """
        lease.ensure_held()
        with self.engine.begin() as connection:
            self.assert_held(connection, lease)
            yield connection

    def heartbeat(self, lease: Lease) -> datetime:
        """Extend the lease by its own length from the database's now; returns the new expiry."""
        with driver.statements(self.engine, "heartbeat a lease") as db:
            expires_at: datetime | None = leases.renew(db, lease.id, lease.owner_token)
        if expires_at is None:
            raise self._lost(lease, "heartbeat")
        return expires_at

    def complete(self, lease: Lease, data: Any = None) -> None:
        """Mark the run ``SUCCESS`` (never reclaimed again); ``data`` is stored as JSON."""
        if data is not None:
            try:
                json.dumps(data, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise errors.InvalidPayloadError(
                    "result data", f"must be JSON-serializable ({exc})"
                ) from None
        with driver.statements(self.engine, "complete a lease") as db:
            done = leases.complete(db, lease.id, lease.owner_token, data)
        if not done:
            raise self._lost(lease, "complete")

    def _finish_failed(self, lease: Lease, action: str, text: str) -> None:
        with driver.statements(self.engine, f"{action} a lease") as db:
            done = leases.fail(db, lease.id, lease.owner_token, bound_error(text))
        if not done:
            raise self._lost(lease, action)

    def fail(self, lease: Lease, error: str | BaseException) -> None:
        """Mark the run ``FAIL`` with bounded error text; the next acquire retries it with the same key."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._finish_failed(lease, "fail", text)

    def release(self, lease: Lease, reason: str = RELEASED_ERROR) -> None:
        """Give the run back unfinished (``FAIL``, reason: released) so a later acquire may retry it."""
        self._finish_failed(lease, "release", reason)

    def remaining_ms(self, lease: Lease) -> int | None:
        """Milliseconds left on the database clock, or ``None`` if this lease is no longer current."""
        with driver.statements(self.engine, "read a lease") as db:
            return leases.ms_left(db, lease.id, lease.owner_token)

    # -- run_exclusive -----------------------------------------------------------------------------

    def run_exclusive(
        self,
        job: identity.JobIdentity,
        fn: Callable[[Lease], T],
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
    ) -> ExclusiveOutcome[T]:
        """Run ``fn(lease)`` only if this worker wins the lease for ``job``.

        A loser returns ``acquired=False`` with the reason and never calls ``fn``. The winner heartbeats from
        a background thread, so ``lease.lost`` turns true as soon as the lease is gone; then records
        ``SUCCESS`` (or ``FAIL`` with the error text, re-raising ``fn``'s exception). ``KeyboardInterrupt``,
        ``SystemExit`` and other interrupts (Dagster's run termination) release the lease instead of leaving
        it to expire. If the lease was lost, finalization raises :class:`LostLeaseError`: the effect may run
        again under the next owner, which the idempotency key lets the downstream deduplicate.
        """
        timing = options.resolve_timing(lease_ms, heartbeat_ms, defaults=self.timing)
        acquired = self.try_acquire(job, lease_ms=timing.lease_ms, heartbeat_ms=timing.heartbeat_ms)
        lease = acquired.lease
        if lease is None:
            return ExclusiveOutcome(acquired=False, reason=acquired.reason)

        heartbeat = _Heartbeat(self, lease, timing.heartbeat_ms) if timing.heartbeat_ms else None
        if heartbeat is not None:
            heartbeat.start()
        try:
            result = fn(lease)
        except Exception as exc:
            if heartbeat is not None:
                heartbeat.stop()
            try:
                self.fail(lease, error_text(exc))
            except errors.LostLeaseError as lost:
                raise lost from exc
            except errors.StorageError as storage:
                # fn's own exception is the one the caller must see; the lease simply expires later.
                logger.warning("could not record the failure of lease %d: %s", lease.id, storage)
            raise
        except BaseException as exc:
            if heartbeat is not None:
                heartbeat.stop()
            try:
                self.release(lease, f"released: interrupted by {type(exc).__name__}")
            except errors.JobLeaseError as release_error:
                logger.warning("could not release lease %d on interrupt: %s", lease.id, release_error)
            raise
        if heartbeat is not None:
            heartbeat.stop()
        if lease.lost:
            raise lease._lost_error("complete")
        self.complete(lease)
        return ExclusiveOutcome(acquired=True, result=result, lease=lease)
