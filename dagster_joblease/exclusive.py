"""``run_exclusive``: acquire, heartbeat in the background, run the callback, record the outcome."""

from __future__ import annotations

import dataclasses
import logging
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from dagster_joblease import errors, identity, options

if TYPE_CHECKING:
    from dagster_joblease.lease import Lease, LeaseService, NotAcquiredReason

__all__ = ["ExclusiveOutcome", "run_exclusive"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ExclusiveOutcome(Generic[T]):
    """What :func:`run_exclusive` did: ran ``fn`` (``acquired``) and its ``result``, or why it did not."""

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

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()


def _error_text(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()


def run_exclusive(
    service: LeaseService,
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
    timing = options.resolve_timing(lease_ms, heartbeat_ms, defaults=service.timing)
    acquired = service.try_acquire(job, lease_ms=timing.lease_ms, heartbeat_ms=timing.heartbeat_ms)
    lease = acquired.lease
    if lease is None:
        return ExclusiveOutcome(acquired=False, reason=acquired.reason)

    heartbeat = _Heartbeat(service, lease, timing.heartbeat_ms) if timing.heartbeat_ms else None
    if heartbeat is not None:
        heartbeat.start()
    try:
        result = fn(lease)
    except Exception as exc:
        if heartbeat is not None:
            heartbeat.stop()
        try:
            service.fail(lease, _error_text(exc))
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
            service.release(lease, f"released: interrupted by {type(exc).__name__}")
        except errors.JobLeaseError as release_error:
            logger.warning("could not release lease %d on interrupt: %s", lease.id, release_error)
        raise
    if heartbeat is not None:
        heartbeat.stop()
    if lease.lost:
        raise lease._lost_error("complete")
    service.complete(lease)
    return ExclusiveOutcome(acquired=True, result=result, lease=lease)
