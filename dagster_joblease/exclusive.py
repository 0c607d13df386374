"""``run_exclusive`` as a function of a :class:`LeaseService`: acquire, heartbeat in the background, run
the callback, record the outcome.

The machinery lives with the lease it holds (:meth:`dagster_joblease.lease.LeaseService.run_exclusive`,
:class:`dagster_joblease.lease.ExclusiveOutcome`); this module imports it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dagster_joblease import identity
from dagster_joblease.lease import ExclusiveOutcome, Lease, LeaseService

__all__ = ["ExclusiveOutcome", "run_exclusive"]

T = TypeVar("T")


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
    return service.run_exclusive(job, fn, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms)
