"""Leases under real concurrency and real crashes: OS processes racing, SIGKILLed holders, skewed clocks."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing.context import ForkContext
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import Lease, LeaseService, NotAcquiredReason
from dagster_joblease.storage import create_engine, lease_table
from tests import lease_workers
from tests.conftest import wait_until

pytestmark = pytest.mark.chaos


@pytest.fixture
def mp() -> ForkContext:
    # fork: the workers inherit the imported package, so 16 of them start in well under a second.
    return multiprocessing.get_context("fork")


def _run_race(mp: ForkContext, url: str, processes: int, identities: int) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {lease_workers.RACE_TABLE} (key VARCHAR(80), pid INTEGER)"))
        barrier = mp.Barrier(processes)
        workers = [
            mp.Process(target=lease_workers.race_worker, args=(url, identities, seed, barrier))
            for seed in range(processes)
        ]
        for proc in workers:
            proc.start()
        for proc in workers:
            proc.join(timeout=120)
        assert [proc.exitcode for proc in workers] == [0] * processes

        expected = {job.idempotency_key for job in lease_workers.race_identities(identities)}
        with engine.connect() as conn:
            leases = conn.execute(
                sa.select(lease_table.c.lock_key, lease_table.c.status, lease_table.c.attempt)
            ).all()
            records = conn.execute(sa.text(f"SELECT key, pid FROM {lease_workers.RACE_TABLE}")).all()
        # Exactly one winner per identity, seen from both sides: the lease table and the callbacks.
        assert len(leases) == identities
        assert {row.lock_key for row in leases} == expected
        assert {(row.status, row.attempt) for row in leases} == {("SUCCESS", 1)}
        assert len(records) == identities
        assert {row.key for row in records} == expected
        assert {row.pid for row in records} <= {proc.pid for proc in workers}
    finally:
        engine.dispose()


def test_sixteen_processes_race_two_hundred_identities_on_postgresql(mp: ForkContext, pg_url: str) -> None:
    _run_race(mp, pg_url, processes=16, identities=200)


def test_four_processes_race_fifty_identities_on_sqlite(mp: ForkContext, sqlite_url: str) -> None:
    _run_race(mp, sqlite_url, processes=4, identities=50)


@pytest.fixture
def pg_service(pg_url: str) -> Iterator[LeaseService]:
    engine = create_engine(pg_url)
    yield LeaseService(engine, lease_ms=60_000)
    engine.dispose()


def _row(service: LeaseService, job: JobIdentity) -> sa.Row[Any]:
    with service.engine.connect() as conn:
        return conn.execute(sa.select(lease_table).where(lease_table.c.lock_key == job.idempotency_key)).one()


def test_sigkilled_holder_is_reclaimed_and_fenced(
    mp: ForkContext, pg_url: str, pg_service: LeaseService, tmp_path: Path
) -> None:
    job = JobIdentity.schedule("sigkill", "2026-11-29")
    out = tmp_path / "holder.json"
    holder = mp.Process(
        target=lease_workers.hold_and_hang, args=(pg_url, job.code, job.run_key, 600, 100, str(out))
    )
    holder.start()
    try:
        wait_until(out.exists, timeout=30)
        dead = lease_workers.lease_from_file(out, job)

        # Alive and heartbeating, the holder keeps its 600 ms lease well past 600 ms.
        def renewed_past_its_length() -> bool:
            row = _row(pg_service, job)
            return bool((row.heartbeat_at - row.acquired_at).total_seconds() > 0.7)

        wait_until(renewed_past_its_length)
        assert pg_service.try_acquire(job).reason is NotAcquiredReason.HELD
        assert _row(pg_service, job).owner_token == dead.owner_token
    finally:
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(timeout=30)
    assert holder.exitcode == -signal.SIGKILL

    # Nobody renews it now; once it expires on the database clock, the next worker reclaims it.
    reclaimed: list[Lease] = []

    def reclaim() -> bool:
        lease = pg_service.acquire(job)
        if lease is not None:
            reclaimed.append(lease)
        return lease is not None

    wait_until(reclaim, timeout=30)
    (new,) = reclaimed
    assert new.idempotency_key == dead.idempotency_key == job.idempotency_key
    assert new.id == dead.id
    assert new.owner_token != dead.owner_token
    assert (dead.attempt, new.attempt) == (1, 2)
    assert "expired" in (new.previous_error or "")

    zombie = LeaseService(create_engine(pg_url))
    try:
        for action in (zombie.heartbeat, zombie.complete, zombie.release):
            with pytest.raises(errors.LostLeaseError):
                action(dead)
        with pytest.raises(errors.LostLeaseError):
            zombie.fail(dead, "zombie woke up")
    finally:
        zombie.engine.dispose()
    row = _row(pg_service, job)
    assert (row.status, row.attempt, row.owner_token) == ("RUNNING", 2, new.owner_token)
    pg_service.complete(new)


def _skewed_attempt(mp: ForkContext, url: str, job: JobIdentity, lease_ms: int) -> dict[str, Any]:
    results = mp.Queue()
    proc = mp.Process(
        target=lease_workers.skewed_try_acquire, args=(url, job.code, job.run_key, lease_ms, results)
    )
    proc.start()
    outcome: dict[str, Any] = results.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    return outcome


def test_skewed_clock_and_short_lease_cannot_steal_a_live_lease(
    mp: ForkContext, pg_url: str, pg_service: LeaseService
) -> None:
    job = JobIdentity.schedule("skew", "2026-11-29")
    live = pg_service.acquire(job, lease_ms=60_000)
    assert live is not None
    before = _row(pg_service, job)

    # A reclaimer whose clock runs six hours ahead sees the lease as long expired -- if it asked its own
    # clock. It must ask the database's.
    for lease_ms in (60_000, 3):
        outcome = _skewed_attempt(mp, pg_url, job, lease_ms)
        assert all(abs(v - lease_workers.SKEW_S) < 60 for v in outcome["skews"].values()), outcome
        assert (outcome["acquired"], outcome["reason"]) == (False, "HELD")

    # A caller with a 3 ms lease does not judge a 60 s lease by its own length.
    short = LeaseService(create_engine(pg_url), lease_ms=3, heartbeat_ms=0)
    try:
        for _ in range(5):
            assert short.try_acquire(job).reason is NotAcquiredReason.HELD
    finally:
        short.engine.dispose()

    after = _row(pg_service, job)
    assert (after.owner_token, after.attempt, after.expires_at, after.lease_ms) == (
        before.owner_token,
        1,
        before.expires_at,
        60_000,
    )
    pg_service.complete(live)
