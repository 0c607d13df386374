"""Module-level worker functions that lease tests run in real OS processes (multiprocessing)."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import Lease, LeaseService
from dagster_joblease.storage import create_engine, migrate

RACE_TABLE = "race_record"


def race_identities(count: int) -> list[JobIdentity]:
    return [JobIdentity.schedule("race", f"key-{i:04d}") for i in range(count)]


def race_worker(url: str, count: int, seed: int, barrier: Barrier) -> None:
    """Try every identity once, in a shuffled order; each win writes one record row from the callback."""
    engine = create_engine(url)
    service = LeaseService(engine, lease_ms=60_000)
    jobs = race_identities(count)
    random.Random(seed).shuffle(jobs)
    record = sa.text(f"INSERT INTO {RACE_TABLE} (key, pid) VALUES (:key, :pid)")
    with engine.connect():
        pass  # open the pool's first connection before the start line, so the race is about the SQL
    barrier.wait(timeout=60)

    def write_record(lease: Lease) -> None:
        with engine.begin() as conn:
            conn.execute(record, {"key": lease.idempotency_key, "pid": os.getpid()})

    try:
        for job in jobs:
            service.run_exclusive(job, write_record)
    finally:
        engine.dispose()


def hold_and_hang(url: str, code: str, run_key: str, lease_ms: int, heartbeat_ms: int, out: str) -> None:
    """Win the lease, write it out for the test, then hang inside the callback until killed."""
    engine = create_engine(url)
    service = LeaseService(engine)

    def hang(lease: Lease) -> None:
        tmp = Path(out + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "id": lease.id,
                    "owner_token": lease.owner_token,
                    "attempt": lease.attempt,
                    "lease_ms": lease.lease_ms,
                    "expires_at": lease.expires_at.isoformat(),
                }
            )
        )
        tmp.replace(out)  # atomic: the test never reads a half-written file
        while True:
            time.sleep(3600)

    service.run_exclusive(
        JobIdentity.schedule(code, run_key), hang, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms
    )


def lease_from_file(path: str | Path, job: JobIdentity) -> Lease:
    """Rebuild a dead holder's lease from what it wrote out (what a zombie worker still believes)."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return Lease(
        id=data["id"],
        identity=job,
        owner_token=data["owner_token"],
        attempt=data["attempt"],
        lease_ms=data["lease_ms"],
        expires_at=dt.datetime.fromisoformat(data["expires_at"]),
    )


SKEW_S = 6 * 3600


def _skew_python_clock(seconds: float) -> None:
    """Move every Python wall clock this process could consult ``seconds`` ahead."""
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + seconds
    time.time_ns = lambda: real_time_ns() + int(seconds * 1e9)

    class SkewedDateTime(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> SkewedDateTime:
            return cls.fromtimestamp(time.time(), tz)

        @classmethod
        def utcnow(cls) -> SkewedDateTime:
            return cls.fromtimestamp(time.time(), dt.UTC).replace(tzinfo=None)

    dt.datetime = SkewedDateTime  # type: ignore[misc]


def skewed_try_acquire(url: str, code: str, run_key: str, lease_ms: int, results: Any) -> None:
    """Try to take a lease from a process whose clock runs SKEW_S ahead; report what happened."""
    before_dt, before_time, before_ns = dt.datetime.now(dt.UTC), time.time(), time.time_ns()
    _skew_python_clock(SKEW_S)
    skews = {
        "datetime": (dt.datetime.now(dt.UTC) - before_dt).total_seconds(),
        "time": time.time() - before_time,
        "time_ns": (time.time_ns() - before_ns) / 1e9,
    }
    engine = create_engine(url)
    try:
        result = LeaseService(engine).try_acquire(JobIdentity.schedule(code, run_key), lease_ms=lease_ms)
        results.put(
            {
                "skews": skews,
                "acquired": result.acquired,
                "reason": result.reason.name if result.reason else None,
            }
        )
    finally:
        engine.dispose()


def migrate_worker(url: str, barrier: Barrier, results: Any) -> None:
    """Run migrate() at the same moment as the other workers; report the revision or the error."""
    engine = create_engine(url)
    try:
        barrier.wait(timeout=60)
        try:
            migrate(engine)
            results.put(("ok", os.getpid()))
        except Exception as exc:
            results.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        engine.dispose()
