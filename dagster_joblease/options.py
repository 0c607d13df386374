"""Lease timing options, validated before any database work."""

from __future__ import annotations

import dataclasses

from dagster_joblease import errors

__all__ = [
    "DEFAULT_LEASE_MS",
    "MAX_DURATION_MS",
    "MAX_LEASE_MS",
    "LeaseTiming",
    "default_heartbeat_ms",
    "resolve_timing",
]

DEFAULT_LEASE_MS = 15 * 60_000  # 15 minutes
#: The longest time option or window anywhere in the library: 100 years. Database now plus (or minus) this
#: stays far inside what both backends store and Python decodes (years 1-9999); the seed's 2**53-1 ms
#: did not (year 287453 on PostgreSQL, a failed insert on SQLite).
MAX_DURATION_MS = 100 * 365 * 86_400_000
MAX_LEASE_MS = MAX_DURATION_MS
MAX_HEARTBEAT_MS = 60_000  # a minute: frequent enough to notice a lost lease quickly


def default_heartbeat_ms(lease_ms: int) -> int:
    return min(MAX_HEARTBEAT_MS, lease_ms // 3)


def _check_lease_ms(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.InvalidLeaseOptionsError(
            "lease_ms", value, f"must be an int number of milliseconds, got {type(value).__name__}"
        )
    if not 2 < value <= MAX_LEASE_MS:
        raise errors.InvalidLeaseOptionsError(
            "lease_ms",
            value,
            f"must be greater than 2 and at most {MAX_LEASE_MS} (100 years, so that the expiry stays a "
            "date both backends can store)",
        )
    return value


def _check_heartbeat_ms(value: object, lease_ms: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.InvalidLeaseOptionsError(
            "heartbeat_ms", value, f"must be an int number of milliseconds, got {type(value).__name__}"
        )
    if value == 0:
        return 0
    if not (0 < value and value * 2 < lease_ms):
        raise errors.InvalidLeaseOptionsError(
            "heartbeat_ms",
            value,
            f"must be 0 (no heartbeat) or a positive int below lease_ms / 2 = {lease_ms / 2:g}, so that one "
            "missed heartbeat does not lose the lease",
        )
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseTiming:
    """A validated pair: how long a claim lasts and how often the holder renews it (0: never)."""

    lease_ms: int
    heartbeat_ms: int


def resolve_timing(
    lease_ms: object = None, heartbeat_ms: object = None, *, defaults: LeaseTiming | None = None
) -> LeaseTiming:
    """Validate per-call options, falling back to ``defaults`` (the service's), then to the library's."""
    if lease_ms is None:
        lease = defaults.lease_ms if defaults is not None else DEFAULT_LEASE_MS
    else:
        lease = _check_lease_ms(lease_ms)
    if heartbeat_ms is None:
        if defaults is not None and lease_ms is None:
            heartbeat = defaults.heartbeat_ms
        else:
            heartbeat = default_heartbeat_ms(lease)
    else:
        heartbeat = _check_heartbeat_ms(heartbeat_ms, lease)
    return LeaseTiming(lease_ms=lease, heartbeat_ms=heartbeat)
