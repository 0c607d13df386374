"""The holder's own timing is on its row, and staleness is judged by it (PostgreSQL and SQLite)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dagster_joblease import admin, errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import Lease, LeaseService, claim_terms, default_holder
from dagster_joblease.options import LeaseTiming
from dagster_joblease.staleness import is_stale, stale_after_ms
from dagster_joblease.storage import create_engine, current_revision, head_revision, lease_table, migrate
from dagster_joblease.storage.clock import db_now_plus_ms
from tests.conftest import _admin_execute, admin_url
from tests.test_lease import force_expire

JOB = JobIdentity.schedule("holder-timing", "2026-11-29")


def recorded(engine: sa.Engine, job: JobIdentity = JOB) -> tuple[int, int | None]:
    t = lease_table
    with engine.connect() as conn:
        lease_ms, heartbeat_ms = conn.execute(
            sa.select(t.c.lease_ms, t.c.heartbeat_ms).where(t.c.lock_key == job.idempotency_key)
        ).one()
    return int(lease_ms), None if heartbeat_ms is None else int(heartbeat_ms)


SERVICE = LeaseTiming(lease_ms=60_000, heartbeat_ms=7_000)


@pytest.mark.parametrize(
    ("service_holder", "lease_ms", "heartbeat_ms", "holder", "expected"),
    [
        (None, None, None, None, (60_000, 7_000, "<host:pid>")),  # all the service's, the default label
        ("svc", None, None, None, (60_000, 7_000, "svc")),
        ("svc", None, None, "call", (60_000, 7_000, "call")),  # the call's label wins
        (None, 90_000, None, None, (90_000, 30_000, "<host:pid>")),  # that length's default interval
        (None, None, 4_000, None, (60_000, 4_000, "<host:pid>")),  # the service's length
        ("svc", 90_000, 0, None, (90_000, 0, "svc")),  # never heartbeats
    ],
)
def test_claim_terms_take_the_calls_then_the_services_then_the_defaults(
    service_holder: str | None,
    lease_ms: int | None,
    heartbeat_ms: int | None,
    holder: str | None,
    expected: tuple[int, int, str],
) -> None:
    timing, label = claim_terms(
        SERVICE, service_holder, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, holder_override=holder
    )
    lease, heartbeat, want_label = expected
    assert (timing.lease_ms, timing.heartbeat_ms) == (lease, heartbeat)
    assert label == (default_holder() if want_label == "<host:pid>" else want_label)


@pytest.mark.parametrize(
    ("lease_ms", "heartbeat_ms", "holder", "field"),
    [(0, None, None, "lease_ms"), (None, -1, None, "heartbeat_ms"), (None, None, " x", "holder")],
)
def test_claim_terms_refuse_bad_call_options(
    lease_ms: int | None, heartbeat_ms: int | None, holder: str | None, field: str
) -> None:
    with pytest.raises(errors.InvalidLeaseOptionsError) as raised:
        claim_terms(SERVICE, "svc", lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, holder_override=holder)
    assert field in str(raised.value)


def test_a_manual_acquire_records_the_service_heartbeat_setting(engine: sa.Engine) -> None:
    LeaseService(engine, lease_ms=60_000, heartbeat_ms=7_000).acquire(JOB)
    assert recorded(engine) == (60_000, 7_000)
    other = JobIdentity.schedule("holder-timing", "2026-11-30")
    LeaseService(engine, lease_ms=60_000, heartbeat_ms=0).acquire(other)
    assert recorded(engine, other) == (60_000, 0)  # never heartbeats: judged by expiry only
    third = JobIdentity.schedule("holder-timing", "2026-12-01")
    LeaseService(engine, lease_ms=60_000, heartbeat_ms=7_000).acquire(third, lease_ms=90_000)
    assert recorded(engine, third) == (90_000, 30_000)  # that length's default interval


def test_run_exclusive_records_the_interval_it_heartbeats_at(engine: sa.Engine) -> None:
    service = LeaseService(engine, lease_ms=60_000)
    seen: list[tuple[int, int | None]] = []
    service.run_exclusive(
        JOB, lambda lease: seen.append(recorded(engine)), lease_ms=30_000, heartbeat_ms=4_000
    )
    assert seen == [(30_000, 4_000)]


def test_a_reclaim_records_the_new_holder_timing(engine: sa.Engine) -> None:
    first = LeaseService(engine, lease_ms=60_000, heartbeat_ms=20_000).acquire(JOB)
    assert first is not None
    force_expire(engine, JOB)
    second = LeaseService(engine, lease_ms=9_000, heartbeat_ms=1_000).acquire(JOB)
    assert second is not None and second.attempt == 2
    assert recorded(engine) == (9_000, 1_000)
    LeaseService(engine).fail(second, "boom")
    third = LeaseService(engine, lease_ms=5_000, heartbeat_ms=0).acquire(JOB)
    assert third is not None and third.attempt == 3
    assert recorded(engine) == (5_000, 0)


def test_the_staleness_rule_uses_the_holder_interval_and_a_judge_may_only_lengthen_it() -> None:
    # The holder renews every 10 s: a waiter whose own interval is 1 s must not call it stale at 3 s.
    assert stale_after_ms(10_000, legacy_ms=2_000) == 20_000
    assert not is_stale(3_000, stale_after_ms(10_000, legacy_ms=2_000))
    assert is_stale(20_001, stale_after_ms(10_000, legacy_ms=2_000))
    # A judge's setting lengthens, never shortens.
    assert stale_after_ms(10_000, legacy_ms=2_000, at_least_ms=60_000) == 60_000
    assert stale_after_ms(10_000, legacy_ms=2_000, at_least_ms=1_000) == 20_000
    # 0: no heartbeat; only the lease's expiry frees it, whatever the judge says.
    assert stale_after_ms(0, legacy_ms=2_000, at_least_ms=1_000) is None
    assert not is_stale(10**12, stale_after_ms(0, legacy_ms=2_000))
    # A row from before migration 0002: the judge's old rule.
    assert stale_after_ms(None, legacy_ms=2_000, at_least_ms=60_000) == 2_000
    assert stale_after_ms(None, legacy_ms=0) is None


@pytest.fixture(params=["sqlite", "postgresql"])
def old_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.sqlite'}"
        return
    name = f"joblease_old_{uuid.uuid4().hex[:10]}"
    _admin_execute(f'CREATE DATABASE "{name}"')
    yield admin_url().set(database=name).render_as_string(hide_password=False)
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _claim_as_0001_code(engine: sa.Engine) -> None:
    """A row as code from before migration 0002 wrote it: no heartbeat_ms column at all."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, "
                "attempt, lease_ms, holder, created_at, acquired_at, heartbeat_at, expires_at) VALUES "
                "(:k, 'SCHEDULE', :c, :r, 'RUNNING', 'old-token', 1, 60000, 'old-host:1', :t, :t, :t, :e)"
            ),
            {
                "k": JOB.idempotency_key,
                "c": JOB.code,
                "r": JOB.run_key,
                "t": "2026-01-01 00:00:00",
                "e": "2026-01-01 00:01:00",
            },
        )


def test_rows_written_before_0002_upgrade_in_place_and_keep_the_old_rule(old_url: str) -> None:
    engine = create_engine(old_url)
    try:
        migrate(engine, "0001")
        _claim_as_0001_code(engine)
        migrate(engine)
        assert current_revision(engine) == head_revision()
        assert recorded(engine) == (60_000, None)  # NULL: judged by the judge's old rule
        assert stale_after_ms(recorded(engine)[1], legacy_ms=20_000) == 20_000
        # The old row is still an ordinary expired lease: a new claim reclaims it and records its timing.
        taken = LeaseService(engine, lease_ms=30_000, heartbeat_ms=3_000).acquire(JOB)
        assert isinstance(taken, Lease) and taken.attempt == 2
        assert recorded(engine) == (30_000, 3_000)
    finally:
        engine.dispose()


def test_leases_show_judges_staleness_by_the_holder_interval(engine: sa.Engine) -> None:
    slow = JobIdentity.schedule("holder-timing", "slow")
    silent = JobIdentity.schedule("holder-timing", "silent")
    LeaseService(engine, lease_ms=3_600_000, heartbeat_ms=600_000).acquire(slow)
    LeaseService(engine, lease_ms=3_600_000, heartbeat_ms=0).acquire(silent)
    _age(engine, 180)  # 3 minutes without a heartbeat, on the database clock
    shown = admin.show_lease(engine, slow.idempotency_key)
    assert (shown.heartbeat_ms, shown.stale) == (600_000, False)  # 3 min < 2 x 10 min
    assert shown.heartbeat_age_ms is not None and shown.heartbeat_age_ms >= 180_000
    _age(engine, 1_300)
    assert admin.show_lease(engine, slow.idempotency_key).stale
    quiet = admin.show_lease(engine, silent.idempotency_key)
    assert (quiet.heartbeat_ms, quiet.stale) == (0, False)  # never heartbeats: expiry only


def _age(engine: sa.Engine, seconds: int) -> None:
    t = lease_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t).values(heartbeat_at=db_now_plus_ms(sa.literal(-seconds * 1000, sa.BigInteger())))
        )


def test_a_batch_claim_records_the_same_holder_timing(engine: sa.Engine) -> None:
    from dagster_joblease.batch import claim_many

    days = [JobIdentity.schedule("holder-timing", f"batch-{i}") for i in range(3)]
    service = LeaseService(engine, lease_ms=60_000, heartbeat_ms=7_000)
    assert len(claim_many(service, days[:2]).leases) == 2
    assert [recorded(engine, d) for d in days[:2]] == [(60_000, 7_000)] * 2
    claim_many(service, days[2:], lease_ms=90_000, heartbeat_ms=0)
    assert recorded(engine, days[2]) == (90_000, 0)
    force_expire(engine, days[0])
    claim_many(LeaseService(engine, lease_ms=9_000, heartbeat_ms=1_000), days[:1])  # a reclaim
    assert recorded(engine, days[0]) == (9_000, 1_000)
