"""Is a lease holder alive? One rule, from the lease row and the holder's own recorded timing.

A claim records the holder's lease length (``lease_ms``) and heartbeat interval (``heartbeat_ms``) on its
row. Whoever judges the holder (a run waiting for it, the reconciliation sensor, ``joblease leases``)
measures its heartbeat's age on the database clock against *that* interval: a waiter configured with a
1 s heartbeat must not declare a holder that renews every 10 s dead after 3 s. A judge's own setting
(``holder_stale_ms``) may lengthen a threshold, never shorten it.

**The liveness rule** (:func:`holder_death`, the one function every judge applies). A ``RUNNING``
lease's holder is dead when

1. its lease expired (by its own length, on the database clock); or
2. its heartbeat has been missing for :data:`FAILOVER_HEARTBEATS` (4) of its own intervals: the failover a
   holder is promised to survive (docs/operations.md), whatever its scheduler says of it (a SIGKILLed
   Dagster run worker stays STARTED under Dagster's defaults: this is what frees its keys); or
3. the run named on its lease is finished (its scheduler says so: for Dagster, SUCCESS, FAILURE or
   CANCELED) while the lease is still ``RUNNING``, and its heartbeat stopped too: older than
   :data:`STALE_AFTER_HEARTBEATS` (2) of its intervals (a forced termination marks a run CANCELED while its
   step process may live on and heartbeat).

Anything short of that is alive to every judge. When a failover outlasts the tolerance, the fenced
transaction and the fencing headers stay the safety net: the holder's writes are refused.

- ``heartbeat_ms == 0``: the holder never heartbeats (a manual ``acquire()`` on a service with no
  heartbeat, or ``run_exclusive(heartbeat_ms=0)``): only its lease's expiry frees it.
- ``heartbeat_ms is None``: a row written before migration 0002; the judge's old threshold (``legacy_ms``)
  stands for two intervals.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "FAILOVER_HEARTBEATS",
    "STALE_AFTER_HEARTBEATS",
    "Death",
    "dead_after_ms",
    "holder_death",
    "is_stale",
    "stale_after_ms",
]

#: Missed heartbeats after which a holder whose run is finished counts as dead (one late beat is not).
STALE_AFTER_HEARTBEATS = 2
#: Missed heartbeats after which a holder is dead without other proof: the database failover a holder is
#: promised to survive (docs/operations.md). At least 4.
FAILOVER_HEARTBEATS = 4


def _threshold(
    holder_heartbeat_ms: int | None, beats: int, *, legacy_ms: int, at_least_ms: int | None
) -> int | None:
    if holder_heartbeat_ms is None:
        return legacy_ms * beats // STALE_AFTER_HEARTBEATS if legacy_ms > 0 else None
    if holder_heartbeat_ms <= 0:
        return None
    return max(beats * holder_heartbeat_ms, at_least_ms or 0)


def stale_after_ms(
    holder_heartbeat_ms: int | None, *, legacy_ms: int, at_least_ms: int | None = None
) -> int | None:
    """Heartbeat age (ms, database clock) past which the holder is stale (two of its intervals missed);
    ``None``: never (expiry only). Stale is not dead: see :func:`holder_death`.

    Args:
        holder_heartbeat_ms: the interval the holder recorded on its row (``None``: a row from before
            migration 0002).
        legacy_ms: the judge's threshold for such old rows (0: never stale).
        at_least_ms: a judge's setting that may lengthen the threshold for recorded rows, never shorten it.
    """
    return _threshold(
        holder_heartbeat_ms, STALE_AFTER_HEARTBEATS, legacy_ms=legacy_ms, at_least_ms=at_least_ms
    )


def dead_after_ms(
    holder_heartbeat_ms: int | None, *, legacy_ms: int, at_least_ms: int | None = None
) -> int | None:
    """Heartbeat age (ms, database clock) past which the holder is dead with no other proof:
    :data:`FAILOVER_HEARTBEATS` of its own intervals; ``None``: never (expiry only). Arguments as
    :func:`stale_after_ms`."""
    return _threshold(holder_heartbeat_ms, FAILOVER_HEARTBEATS, legacy_ms=legacy_ms, at_least_ms=at_least_ms)


def is_stale(heartbeat_age_ms: int, threshold_ms: int | None) -> bool:
    """Is a heartbeat this old (database clock) past ``threshold_ms`` (from :func:`stale_after_ms`)?"""
    return threshold_ms is not None and heartbeat_age_ms > threshold_ms


@dataclasses.dataclass(frozen=True)
class Death:
    """Why a holder is dead, and the heartbeat age a takeover is fenced on (the ``stale_ms`` of
    ``LeaseService.fail_dead_holder``; ``None`` when its lease expired: any claim reclaims it)."""

    why: str
    fence_ms: int | None


def holder_death(
    *,
    status: str,
    overdue_ms: int,
    heartbeat_age_ms: int,
    heartbeat_ms: int | None,
    run_finished: str | None,
    legacy_ms: int,
    at_least_ms: int | None = None,
) -> Death | None:
    """The liveness rule (module docstring): why the holder of a lease row is dead, or ``None``: alive.

    Args:
        status: the row's status (only a ``RUNNING`` row has a holder to judge).
        overdue_ms: > 0: the lease expired that long ago (database clock).
        heartbeat_age_ms: the last heartbeat's age (database clock).
        heartbeat_ms: the holder's recorded interval (``None``: a row from before 0002; 0: no heartbeat).
        run_finished: ``None``, or what proves the run named on the lease finished (e.g. "its Dagster run
            is CANCELED"); a judge that never asked passes ``None``.
        legacy_ms / at_least_ms: as :func:`stale_after_ms`.
    """
    if status != "RUNNING":
        return None
    if overdue_ms > 0:
        return Death(f"its lease expired {overdue_ms // 1000} s ago", None)
    age = f"{heartbeat_age_ms} ms"
    every = "every ? (pre-0002 row)" if heartbeat_ms is None else f"every {heartbeat_ms} ms"
    dead_ms = dead_after_ms(heartbeat_ms, legacy_ms=legacy_ms, at_least_ms=at_least_ms)
    if is_stale(heartbeat_age_ms, dead_ms):
        return Death(
            f"its heartbeat ({every}) is {age} old: {FAILOVER_HEARTBEATS} of its own intervals missed",
            dead_ms,
        )
    stale_ms = stale_after_ms(heartbeat_ms, legacy_ms=legacy_ms, at_least_ms=at_least_ms)
    if run_finished is not None and is_stale(heartbeat_age_ms, stale_ms):
        return Death(f"{run_finished} and its heartbeat ({every}) is {age} old", stale_ms)
    return None
