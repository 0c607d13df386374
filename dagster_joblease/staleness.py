"""When is a lease holder stale? Decided by the holder's own recorded timing, never the judge's.

A claim records the holder's lease length (``lease_ms``) and heartbeat interval (``heartbeat_ms``) on its
row. Whoever judges the holder (a run waiting for it, the reconciliation sensor, ``joblease leases``)
measures its heartbeat's age on the database clock against *that* interval: a waiter configured with a
1 s heartbeat must not declare a holder that renews every 10 s dead after 3 s. A judge's own setting
(``holder_stale_ms``) may lengthen the threshold, never shorten it.

- ``heartbeat_ms > 0``: stale once the last heartbeat is older than ``STALE_AFTER_HEARTBEATS`` intervals.
- ``heartbeat_ms == 0``: the holder never heartbeats (a manual ``acquire()`` on a service with no
  heartbeat, or ``run_exclusive(heartbeat_ms=0)``): it is never stale; only its lease's expiry frees it.
- ``heartbeat_ms is None``: a row written before migration 0002; the judge's old rule applies
  (``legacy_ms``, what the judge used before the holder's interval was recorded).

Stale is not dead: a stale holder whose lease has not expired may still be working. Callers pair it with
proof that the holder's process is gone (its Dagster run is finished) before taking the lease; otherwise
they wait for expiry, which the holder set itself (``expires_at``, from its own ``lease_ms``).
"""

from __future__ import annotations

__all__ = ["STALE_AFTER_HEARTBEATS", "is_stale", "stale_after_ms"]

#: Missed heartbeats after which a holder counts as stale: one late heartbeat is not enough.
STALE_AFTER_HEARTBEATS = 2


def stale_after_ms(
    holder_heartbeat_ms: int | None, *, legacy_ms: int, at_least_ms: int | None = None
) -> int | None:
    """Heartbeat age (ms, database clock) past which the holder is stale; ``None``: never (expiry only).

    Args:
        holder_heartbeat_ms: the interval the holder recorded on its row (``None``: a row from before
            migration 0002).
        legacy_ms: the judge's threshold for such old rows (0: never stale).
        at_least_ms: a judge's setting that may lengthen the threshold for recorded rows, never shorten it.
    """
    if holder_heartbeat_ms is None:
        return legacy_ms if legacy_ms > 0 else None
    if holder_heartbeat_ms <= 0:
        return None
    return max(STALE_AFTER_HEARTBEATS * holder_heartbeat_ms, at_least_ms or 0)


def is_stale(heartbeat_age_ms: int, threshold_ms: int | None) -> bool:
    """Is a heartbeat this old (database clock) past ``threshold_ms`` (from :func:`stale_after_ms`)?"""
    return threshold_ms is not None and heartbeat_age_ms > threshold_ms
