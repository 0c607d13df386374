"""A range of daily partitions on PostgreSQL: batch leases vs today's per-key loop vs a bare psycopg floor.

    .venv/bin/python benchmarks/range.py [--sizes 100,1000,10000] [--rounds 3] [--loop-max 10000]

The server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
postgres``); the script creates its own database and drops it at the end. For N days, one measurement is
the time to claim all N leases, heartbeat them once, enqueue one outbox row per key and complete them all:

* ``batch``: :func:`claim_many`, :func:`heartbeat_many`, :func:`enqueue_many` (in ``engine.begin()``),
  :func:`complete_many`.
* ``batch+fence``: the same with the enqueue inside :func:`fenced_transaction_many` (what a range run
  does: the set's rows locked and checked in the transaction that writes its outbox rows).
* ``per-key``: today's loop, key by key: ``try_acquire``, ``heartbeat``, ``enqueue_once`` (in
  ``engine.begin()``), ``complete``.
* ``floor``: the same writes with bare psycopg 3 on one autocommit connection, into tables made
  ``LIKE joblease_lease`` / ``LIKE joblease_outbox INCLUDING ALL`` (same columns, constraints and indexes):
  one multi-row ``INSERT`` of the N lease rows, one multi-row ``INSERT`` of the N outbox rows (payload JSON
  and SHA-256 computed in Python, as the library does), one ``UPDATE`` of the N rows for the heartbeat and
  one for the completion. No conflict handling, no validation, no fencing: the least work that writes
  the same rows.

Every size runs the sides in rotated rounds (``benchmarks.harness.rotate``) and prints each side's wall
time beside the floor's, median (min-max), the per-round ratio (goal: batch <= 1.5x the floor at 1,000 and
10,000 days), client CPU, and the speedup over the per-key loop; then the median time of each phase. The
tables are emptied (and analyzed) before every measurement, outside the timing. ``--loop-max`` skips
the per-key loop above that size (it makes 4 N round trips and N commits).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import URL

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import lease as lease_bench
from benchmarks.harness import (
    Figure,
    Sample,
    cells,
    figure,
    load,
    machine,
    pg_settings,
    print_figures,
    rotate,
)
from benchmarks.report import dsn, print_table
from dagster_joblease.batch import (
    claim_many,
    complete_many,
    fenced_transaction_many,
    heartbeat_many,
)
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.outbox import OutboxItem, enqueue_many, enqueue_once
from dagster_joblease.storage import create_engine, migrate

LEASE_MS = 3_600_000
HEARTBEAT_MS = 60_000
TOPIC = "billing.daily"

Phases = dict[str, float]
PHASES = ("claim", "heartbeat", "enqueue", "complete")

_FLOOR_TABLES = (
    "CREATE TABLE floor_lease (LIKE joblease_lease INCLUDING ALL)",
    "CREATE TABLE floor_outbox (LIKE joblease_outbox INCLUDING ALL)",
)
_FLOOR_LEASES = (
    "INSERT INTO floor_lease (lock_key, job_type, code, run_key, status, owner_token, attempt, lease_ms, "
    "heartbeat_ms, holder, created_at, acquired_at, heartbeat_at, expires_at) "
    "SELECT k, 'SCHEDULE', c, r, 'RUNNING', o, 1, %s, %s, %s, clock_timestamp(), clock_timestamp(), "
    "clock_timestamp(), clock_timestamp() + %s * INTERVAL '1 millisecond' "
    "FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) AS u(k, c, r, o) RETURNING id"
)
_FLOOR_OUTBOX = (
    "INSERT INTO floor_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
    "next_attempt_at, created_at, updated_at) "
    "SELECT k, %s, p::jsonb, s, 'PENDING', 0, clock_timestamp(), clock_timestamp(), clock_timestamp() "
    "FROM unnest(%s::text[], %s::text[], %s::text[]) AS u(k, p, s)"
)
_FLOOR_HEARTBEAT = (
    "UPDATE floor_lease SET heartbeat_at = clock_timestamp(), "
    "expires_at = clock_timestamp() + lease_ms * INTERVAL '1 millisecond' WHERE id = ANY(%s)"
)
_FLOOR_COMPLETE = (
    "UPDATE floor_lease SET status = 'SUCCESS', finished_at = clock_timestamp(), last_error = NULL "
    "WHERE id = ANY(%s)"
)


def _days(count: int, code: str) -> list[JobIdentity]:
    start = dt.date(2000, 1, 1)
    return [JobIdentity.schedule(code, (start + dt.timedelta(days=i)).isoformat()) for i in range(count)]


def _payload(job: JobIdentity) -> dict[str, Any]:
    return {"billingDate": job.run_key}


class _Clock:
    """Wall time per phase of one measurement."""

    def __init__(self) -> None:
        self.phases: Phases = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now


def _batch(service: LeaseService, jobs: list[JobIdentity], fence: bool) -> Phases:
    clock = _Clock()
    claim = claim_many(service, jobs)
    clock.mark("claim")
    assert len(claim.leases) == len(jobs)
    assert not heartbeat_many(service, claim.leases).lost
    clock.mark("heartbeat")
    items = [OutboxItem(x.idempotency_key, TOPIC, _payload(x.identity)) for x in claim.leases]
    if fence:
        with fenced_transaction_many(service, claim.leases) as conn:
            enqueue_many(conn, items)
    else:
        with service.engine.begin() as conn:
            enqueue_many(conn, items)
    clock.mark("enqueue")
    assert not complete_many(service, claim.leases).lost
    clock.mark("complete")
    return clock.phases


def _per_key(service: LeaseService, jobs: list[JobIdentity]) -> Phases:
    clock = _Clock()
    for job in jobs:
        lease = service.try_acquire(job).lease
        assert lease is not None
        clock.mark("claim")
        service.heartbeat(lease)
        clock.mark("heartbeat")
        with service.engine.begin() as conn:
            enqueue_once(conn, idempotency_key=lease.idempotency_key, topic=TOPIC, payload=_payload(job))
        clock.mark("enqueue")
        service.complete(lease)
        clock.mark("complete")
    return clock.phases


def _floor(conn: psycopg.Connection[Any], jobs: list[JobIdentity]) -> Phases:
    clock = _Clock()
    keys = [j.idempotency_key for j in jobs]
    tokens = [os.urandom(16).hex() for _ in jobs]
    ids = [
        row[0]
        for row in conn.execute(
            _FLOOR_LEASES,
            (
                LEASE_MS,
                HEARTBEAT_MS,
                "floor",
                LEASE_MS,
                keys,
                [j.code for j in jobs],
                [j.run_key for j in jobs],
                tokens,
            ),
        ).fetchall()
    ]
    clock.mark("claim")
    conn.execute(_FLOOR_HEARTBEAT, (ids,))
    clock.mark("heartbeat")
    texts = [json.dumps(_payload(j), sort_keys=True, separators=(",", ":")) for j in jobs]
    shas = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    conn.execute(_FLOOR_OUTBOX, (TOPIC, keys, texts, shas))
    clock.mark("enqueue")
    conn.execute(_FLOOR_COMPLETE, (ids,))
    clock.mark("complete")
    return clock.phases


def _empty(conn: psycopg.Connection[Any]) -> None:
    conn.execute("TRUNCATE joblease_lease, joblease_outbox, floor_lease, floor_outbox")
    for table in ("joblease_lease", "joblease_outbox", "floor_lease", "floor_outbox"):
        conn.execute(f"VACUUM ANALYZE {table}")


def _timed(
    run: Callable[[list[JobIdentity]], Phases], jobs: list[JobIdentity], phases: list[Phases]
) -> Sample:
    """One measurement as a Sample: ``rate`` holds the wall time in ms (a cost: lower is better),
    ``cpu_us`` the client CPU of the whole range in µs."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    phases.append(run(jobs))
    return Sample((time.perf_counter() - t0) * 1000, (time.process_time() - cpu0) * 1e6)


def _size(
    service: LeaseService, floor_conn: psycopg.Connection[Any], size: int, rounds: int, loop: bool
) -> tuple[list[Figure], list[tuple[str, ...]]]:
    """The figures (each side beside the floor) and the per-phase rows of one range size."""
    runs: dict[str, Callable[[list[JobIdentity]], Phases]] = {
        "floor": lambda jobs: _floor(floor_conn, jobs),
        "batch": lambda jobs: _batch(service, jobs, fence=False),
        "batch+fence": lambda jobs: _batch(service, jobs, fence=True),
    }
    if loop:
        runs["per-key"] = lambda jobs: _per_key(service, jobs)
    phases: dict[str, list[Phases]] = {name: [] for name in runs}
    counter = iter(range(10**9))

    def side(name: str) -> Callable[[], Sample]:
        def measure() -> Sample:
            _empty(floor_conn)
            jobs = _days(size, f"bench-{name}-{next(counter)}")
            return _timed(runs[name], jobs, phases[name])

        return measure

    got = rotate(rounds, {name: side(name) for name in runs})
    per_key = statistics.median(s.rate for s in got["per-key"]) if "per-key" in got else None
    figures = []
    for name in runs:
        if name == "floor":
            continue
        median = statistics.median(s.rate for s in got[name])
        note = f"{median / size * 1000:,.0f} us per day"
        if per_key is not None and name != "per-key":
            note += f"; {per_key / median:.1f}x faster than the per-key loop"
        fig = figure(
            f"{size:,} days: {name}",
            1,
            "floor",
            got["floor"],
            got[name],
            unit="ms",
            lower_is_better=True,
            goal=1.5 if name == "batch" and size >= 1_000 else None,
            note=note,
        )
        figures.append(fig)
        print("  " + " | ".join(cells(fig)), flush=True)
    rows = []
    for name in runs:
        split = [statistics.median(m.get(p, 0.0) for m in phases[name]) for p in PHASES]
        rows.append((f"{size:,}", name, *(f"{v * 1000:,.1f}" for v in split)))
    return figures, rows


def suite(server: URL, *, rounds: int, sizes: list[int], loop_max: int) -> list[Figure]:
    """Every figure of this benchmark (printed as it goes), and the per-phase table at the end."""
    urls, drop = lease_bench.databases(server, 1)
    figures: list[Figure] = []
    phase_rows: list[tuple[str, ...]] = []
    started = time.perf_counter()
    engine = create_engine(urls[0])
    try:
        migrate(engine)
        service = LeaseService(engine, lease_ms=LEASE_MS, heartbeat_ms=HEARTBEAT_MS, holder="bench")
        with psycopg.connect(dsn(urls[0]), autocommit=True) as floor_conn:
            for sql in _FLOOR_TABLES:
                floor_conn.execute(sql)
            # Warm up every path once (connections, compiled statements, prepared plans).
            _batch(service, _days(20, "warmup"), fence=True)
            _per_key(service, _days(5, "warmup-loop"))
            _floor(floor_conn, _days(20, "warmup-floor"))
            for size in sizes:
                got_figures, got_phases = _size(service, floor_conn, size, rounds, size <= loop_max)
                figures += got_figures
                phase_rows += got_phases
    finally:
        engine.dispose()
        drop()
    print_table(("days", "side", *(f"{p} ms" for p in PHASES)), phase_rows, started)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="100,1000,10000", help="range sizes in days (default 100,1000,10000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rotated rounds per size (default 3)")
    parser.add_argument("--loop-max", type=int, default=10_000, help="largest size the per-key loop runs at")
    args = parser.parse_args(argv)
    server = lease_bench.server_url()
    with psycopg.connect(dsn(server)) as conn:
        described = machine(pg_settings(conn))
    started = time.perf_counter()
    print(f"{described}\n{load()}", flush=True)
    figures = suite(
        server, rounds=args.rounds, sizes=[int(x) for x in args.sizes.split(",")], loop_max=args.loop_max
    )
    print_figures(
        "range of daily partitions: claim, heartbeat, enqueue, complete", figures, args.rounds, started
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
