"""Lease timing options: validated up front, with InvalidLeaseOptionsError, before any database work."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.options import (
    DEFAULT_LEASE_MS,
    MAX_LEASE_MS,
    LeaseTiming,
    default_heartbeat_ms,
    resolve_timing,
)
from dagster_joblease.storage import create_engine

# Nothing listens on port 1: any attempt to reach the database fails with StorageError, so an
# InvalidLeaseOptionsError from this engine proves validation ran before any connection was tried.
UNREACHABLE_URL = "postgresql+psycopg://nobody@127.0.0.1:1/does_not_exist?connect_timeout=2"

BAD_LEASE_MS: list[Any] = [True, False, 0, 1, 2, -5, 2**53, 10**20, 300.0, 300.5, "300", [300]]
GOOD_LEASE_MS = [3, 4, 300, DEFAULT_LEASE_MS, MAX_LEASE_MS]


@pytest.fixture
def unreachable() -> Iterator[sa.Engine]:
    engine = create_engine(UNREACHABLE_URL)
    yield engine
    engine.dispose()


def test_the_unreachable_engine_really_is_unreachable(unreachable: sa.Engine) -> None:
    with pytest.raises(errors.StorageError):
        LeaseService(unreachable).acquire(JobIdentity.schedule("job", "k"))


def test_defaults() -> None:
    timing = resolve_timing()
    assert timing == LeaseTiming(lease_ms=15 * 60_000, heartbeat_ms=60_000)
    assert resolve_timing(300) == LeaseTiming(300, 100)
    assert resolve_timing(3) == LeaseTiming(3, 1)
    assert resolve_timing(180_000 * 3) == LeaseTiming(540_000, 60_000)
    assert default_heartbeat_ms(90_000) == 30_000
    assert default_heartbeat_ms(10**9) == 60_000


@pytest.mark.parametrize("lease_ms", GOOD_LEASE_MS)
def test_good_lease_ms(lease_ms: int) -> None:
    timing = resolve_timing(lease_ms)
    assert timing.lease_ms == lease_ms
    assert timing.heartbeat_ms == min(60_000, lease_ms // 3)
    assert timing.heartbeat_ms * 2 < lease_ms


@pytest.mark.parametrize("lease_ms", BAD_LEASE_MS, ids=repr)
def test_bad_lease_ms(lease_ms: Any) -> None:
    with pytest.raises(errors.InvalidLeaseOptionsError) as info:
        resolve_timing(lease_ms)
    assert info.value.option == "lease_ms"
    assert "lease_ms" in str(info.value)


@pytest.mark.parametrize(("lease_ms", "heartbeat_ms"), [(300, 0), (300, 1), (300, 149), (3, 1), (10, 4)])
def test_good_heartbeat_ms(lease_ms: int, heartbeat_ms: int) -> None:
    assert resolve_timing(lease_ms, heartbeat_ms) == LeaseTiming(lease_ms, heartbeat_ms)


@pytest.mark.parametrize(
    ("lease_ms", "heartbeat_ms"),
    [(300, 150), (300, 151), (300, 300), (300, -1), (300, True), (300, 10.0), (300, "100"), (4, 2)],
    ids=repr,
)
def test_bad_heartbeat_ms(lease_ms: int, heartbeat_ms: Any) -> None:
    with pytest.raises(errors.InvalidLeaseOptionsError) as info:
        resolve_timing(lease_ms, heartbeat_ms)
    assert info.value.option == "heartbeat_ms"


def test_per_call_heartbeat_is_checked_against_the_service_lease() -> None:
    defaults = resolve_timing(1_000, 0)
    assert resolve_timing(None, None, defaults=defaults) == LeaseTiming(1_000, 0)
    assert resolve_timing(None, 400, defaults=defaults) == LeaseTiming(1_000, 400)
    with pytest.raises(errors.InvalidLeaseOptionsError):
        resolve_timing(None, 500, defaults=defaults)
    # A per-call lease length gets the default heartbeat for that length.
    assert resolve_timing(300, None, defaults=defaults) == LeaseTiming(300, 100)


@pytest.mark.parametrize(("lease_ms", "heartbeat_ms"), [(True, None), (2, None), (300, 150), (300, -1)])
def test_service_constructor_validates(unreachable: sa.Engine, lease_ms: Any, heartbeat_ms: Any) -> None:
    with pytest.raises(errors.InvalidLeaseOptionsError):
        LeaseService(unreachable, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms)


@pytest.mark.parametrize(
    ("lease_ms", "heartbeat_ms"), [(True, None), (0, None), (2**53, None), (300, 150), (None, -1), (300, 1.5)]
)
def test_bad_options_fail_before_any_database_work(
    unreachable: sa.Engine, lease_ms: Any, heartbeat_ms: Any
) -> None:
    service = LeaseService(unreachable, lease_ms=3_000)
    job = JobIdentity.schedule("job", "k")
    calls: list[object] = []
    with pytest.raises(errors.InvalidLeaseOptionsError):
        service.run_exclusive(job, calls.append, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms)
    assert calls == []
    if heartbeat_ms is None:
        with pytest.raises(errors.InvalidLeaseOptionsError):
            service.acquire(job, lease_ms=lease_ms)
        with pytest.raises(errors.InvalidLeaseOptionsError):
            service.try_acquire(job, lease_ms=lease_ms)


def test_the_bound_is_about_100_years_and_the_seed_bound_is_refused() -> None:
    assert 100 * 365 * 86_400_000 <= MAX_LEASE_MS < 101 * 365 * 86_400_000
    for value in (2**53 - 1, MAX_LEASE_MS + 1):
        with pytest.raises(errors.InvalidLeaseOptionsError, match="100 years"):
            resolve_timing(value)


def test_the_largest_accepted_lease_works_on_both_backends(engine: sa.Engine) -> None:
    """What validation accepts must work: claim, heartbeat, list and show at the largest lease_ms."""
    from dagster_joblease import admin

    service = LeaseService(engine, lease_ms=MAX_LEASE_MS)
    job = JobIdentity.schedule("long", "k")
    lease = service.acquire(job)
    assert lease is not None and lease.expires_at.year >= 2120
    assert service.heartbeat(lease).year >= 2120
    (row,) = admin.list_leases(engine)
    assert row.live and row.remaining_ms is not None and row.remaining_ms > 99 * 365 * 86_400_000
    assert admin.show_lease(engine, "long", "k").id == lease.id
    assert service.acquire(job) is None
    service.complete(lease)


def test_refused_lease_ms_writes_nothing(engine: sa.Engine) -> None:
    from dagster_joblease.storage.schema import lease_table

    service = LeaseService(engine)
    with pytest.raises(errors.InvalidLeaseOptionsError):
        service.acquire(JobIdentity.schedule("long", "k"), lease_ms=2**53 - 1)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(lease_table)).scalar_one() == 0
