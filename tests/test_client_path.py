"""The claim's fast client path keeps the lease's rules: a service that has met a key's row starts its next
claim of that key with the reclaim-or-status statement (one round trip for a refusal or a reclaim), and
every outcome is the one the insert-first order gives, including when the row has gone in between."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import lease as lease_module
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import AcquireResult, Lease, LeaseService, NotAcquiredReason
from dagster_joblease.storage import lease_table

pytestmark = pytest.mark.postgres_only

JOB = JobIdentity.schedule("client-path", "2026-12-01")


def _status(engine: sa.Engine, job: JobIdentity) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(lease_table.c.status, lease_table.c.attempt).where(
                lease_table.c.lock_key == job.idempotency_key
            )
        ).all()
    return [(r.status, r.attempt) for r in rows]


def _delete(engine: sa.Engine, job: JobIdentity) -> None:
    with engine.begin() as conn:
        conn.execute(sa.delete(lease_table).where(lease_table.c.lock_key == job.idempotency_key))


def test_a_known_key_is_refused_reclaimed_and_told_succeeded(pg_engine: sa.Engine) -> None:
    holder = LeaseService(pg_engine, lease_ms=60_000)
    rival = LeaseService(pg_engine, lease_ms=60_000)
    first = holder.acquire(JOB)
    assert first is not None
    for _ in range(3):  # the first refusal meets the row; the next ones start from it
        assert rival.try_acquire(JOB).reason is NotAcquiredReason.HELD
    assert JOB.idempotency_key in rival._known
    holder.fail(first, "boom")
    second = rival.acquire(JOB)
    assert second is not None
    assert (second.attempt, second.id, second.previous_error) == (2, first.id, "boom")
    assert holder.try_acquire(JOB).reason is NotAcquiredReason.HELD
    rival.complete(second)
    assert holder.try_acquire(JOB).reason is NotAcquiredReason.SUCCEEDED
    assert rival.try_acquire(JOB).reason is NotAcquiredReason.SUCCEEDED
    assert _status(pg_engine, JOB) == [("SUCCESS", 2)]


def test_a_known_key_whose_row_was_purged_is_claimed_afresh(pg_engine: sa.Engine) -> None:
    service = LeaseService(pg_engine, lease_ms=60_000)
    lease = service.acquire(JOB)
    assert lease is not None
    assert JOB.idempotency_key not in service._known  # a first claim does not fill it
    service.complete(lease)
    assert service.try_acquire(JOB).reason is NotAcquiredReason.SUCCEEDED
    assert JOB.idempotency_key in service._known
    _delete(pg_engine, JOB)  # a purge, unknown to the service
    again = service.try_acquire(JOB)
    assert again.lease is not None, again.reason
    assert again.lease.attempt == 1 and again.lease.id != lease.id
    assert _status(pg_engine, JOB) == [("RUNNING", 1)]
    assert JOB.idempotency_key not in service._known


def _claim(service: LeaseService, barrier: threading.Barrier, results: list[AcquireResult]) -> None:
    barrier.wait()
    results.append(service.try_acquire(JOB))


def test_one_winner_among_threads_that_all_know_the_failed_key(pg_engine: sa.Engine) -> None:
    """Threads of two services that have both met the row start from the reclaim statement at once."""
    services = [LeaseService(pg_engine, lease_ms=60_000) for _ in range(2)]
    first = services[0].acquire(JOB)
    assert first is not None
    for service in services:  # both meet the row (the holder's own claim refused too)
        assert service.try_acquire(JOB).reason is NotAcquiredReason.HELD
    current = first
    for _round in range(5):
        services[0].fail(current, "again")
        assert all(JOB.idempotency_key in s._known for s in services)
        results: list[AcquireResult] = []
        barrier = threading.Barrier(8)
        threads = [
            threading.Thread(target=_claim, args=(services[i % 2], barrier, results)) for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [r.lease for r in results if r.lease is not None]
        assert len(won) == 1, results
        assert [r.reason for r in results if r.lease is None] == [NotAcquiredReason.HELD] * 7
        current = won[0]
        assert _status(pg_engine, JOB) == [("RUNNING", current.attempt)]
    assert current.attempt == 6


def test_the_known_keys_stay_bounded(pg_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease_module, "KNOWN_KEYS", 5)
    holder = LeaseService(pg_engine, lease_ms=60_000)
    service = LeaseService(pg_engine, lease_ms=60_000)
    for i in range(23):
        job = JobIdentity.schedule("bounded", str(i))
        assert holder.acquire(job) is not None
        assert service.try_acquire(job).reason is NotAcquiredReason.HELD
        assert job.idempotency_key in service._known
        assert len(service._known) <= 5
    assert holder._known == set()


def test_a_lease_built_on_the_fast_path_is_a_whole_lease(pg_engine: sa.Engine) -> None:
    """The claim sets the lease's fields directly: every dataclass field, and nothing else."""
    lease = LeaseService(pg_engine, lease_ms=60_000).acquire(JOB)
    assert lease is not None
    names = {f.name for f in dataclasses.fields(Lease)}
    assert set(vars(lease)) == names
    copy: dict[str, Any] = {name: getattr(lease, name) for name in names if name != "_lost"}
    rebuilt = Lease(**copy)
    assert repr(rebuilt) == repr(lease)
    assert not lease.lost
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.attempt = 3  # type: ignore[misc]
