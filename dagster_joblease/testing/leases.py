"""Make a lease lose its holder on demand, with the database clock, so tests need not wait out a lease."""

from __future__ import annotations

from dagster_joblease import errors, identity
from dagster_joblease.lease import Lease, LeaseService
from dagster_joblease.storage import driver, leases

__all__ = ["expire_now", "reclaim_now"]

#: How far into the past an expired lease is set: beyond SQLite's millisecond text resolution.
_EXPIRED_BY_MS = 1_000
#: A holder's heartbeat can renew the lease between the expiry and the claim; try this often.
_RECLAIM_ROUNDS = 20


def _check_service(service: object) -> LeaseService:
    if not isinstance(service, LeaseService):
        raise errors.ConfigurationError(
            f"service must be a LeaseService, got {type(service).__name__}; pass the service the run uses"
        )
    return service


def _expire(service: LeaseService, lock_key: str, owner_token: str | None) -> int:
    with driver.statements(service.engine, "expire a lease") as db:
        return leases.expire_running(db, lock_key, owner_token, ago_ms=_EXPIRED_BY_MS)


def expire_now(service: LeaseService, job: identity.JobIdentity) -> bool:
    """Let ``job``'s current holder's lease run out now (database clock), as if its worker had died long
    ago; the next acquire reclaims it. Returns False when no RUNNING lease exists for ``job``.

    Use it after a crash (see :func:`crash_run_exclusive`) instead of waiting for the lease to expire.
    """
    service = _check_service(service)
    if not isinstance(job, identity.JobIdentity):
        raise errors.InvalidJobIdentityError("identity", job, "must be a JobIdentity")
    return _expire(service, job.idempotency_key, None) > 0


def reclaim_now(service: LeaseService, lease: Lease) -> Lease:
    """Another holder reclaims ``lease``'s run at once, as if the lease had expired; returns its lease.

    The lease's ``expires_at`` is moved into the past on the database clock, for exactly ``lease``'s
    owner token, and the run is claimed through the normal acquire path (``attempt + 1``, a new owner
    token). From then on the original holder's heartbeat, complete, fail, release and fenced
    transactions raise :class:`LostLeaseError`, exactly as after a real expiry. The original holder is
    not told: it finds out on its next fenced write or heartbeat, as a paused worker would.

    Do not call it while the original holder has a fenced transaction open on PostgreSQL in the same
    thread: that transaction holds the lease row's lock, so the expiry would wait for itself.

    Raises:
        LostLeaseError: ``lease`` is no longer the run's live lease (finished, released or already
            reclaimed); there is nothing to reclaim.
    """
    service = _check_service(service)
    if not isinstance(lease, Lease):
        raise errors.ConfigurationError(
            f"lease must be a Lease (what acquire or run_exclusive gave), got {type(lease).__name__}"
        )
    for _ in range(_RECLAIM_ROUNDS):
        if _expire(service, lease.idempotency_key, lease.owner_token) == 0:
            raise lease._lost_error("reclaim (reclaim_now)")
        taken = service.try_acquire(lease.identity)
        if taken.lease is not None:
            return taken.lease
    raise AssertionError(
        f"reclaim_now could not claim {lease.identity} in {_RECLAIM_ROUNDS} rounds: its holder kept "
        "renewing the lease between the expiry and the claim (a heartbeat every few milliseconds?)"
    )
