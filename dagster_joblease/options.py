"""Lease timing options, validated before any database work."""

from __future__ import annotations

import dataclasses

from dagster_joblease import checks
from dagster_joblease.checks import MAX_DURATION_MS

__all__ = [
    "DEFAULT_LEASE_MS",
    "MAX_DURATION_MS",
    "MAX_LEASE_MS",
    "LeaseTiming",
    "default_heartbeat_ms",
    "resolve_timing",
]

DEFAULT_LEASE_MS = 15 * 60_000  # 15 minutes
MAX_LEASE_MS = MAX_DURATION_MS
MAX_HEARTBEAT_MS = 60_000  # a minute: frequent enough to notice a lost lease quickly


def default_heartbeat_ms(lease_ms: int) -> int:
    return min(MAX_HEARTBEAT_MS, lease_ms // 3)


def _check_lease_ms(value: object) -> int:
    return checks.milliseconds(
        "lease_ms",
        value,
        minimum=3,
        maximum=MAX_LEASE_MS,
        error=checks.lease_option,
    )


def _check_heartbeat_ms(value: object, lease_ms: int) -> int:
    return checks.milliseconds(
        "heartbeat_ms",
        value,
        maximum=(lease_ms - 1) // 2,
        why=f"0 turns the heartbeat off; below lease_ms / 2 = {lease_ms / 2:g}, so that one missed "
        "heartbeat does not lose the lease",
        error=checks.lease_option,
    )


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
