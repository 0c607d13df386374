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

Every size alternates the sides round by round (the order rotates), prints the median of each, the
batch/floor ratio (goal: <= 1.5 at 1,000 and 10,000) and the speedup of batch over the per-key loop; the
tables are emptied between measurements (outside the timing). ``--loop-max`` skips the per-key loop above
that size (it makes 4 N round trips and N commits).
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
from typing import Any

import psycopg
from report import dsn, print_table
from sqlalchemy.engine import URL, make_url

from dagster_joblease.batch import (
    claim_many,
    complete_many,
    fenced_transaction_many,
    heartbeat_many,
)
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.outbox import OutboxItem, enqueue_many, enqueue_once
from dagster_joblease.storage import create_engine, migrate, redact_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LEASE_MS = 3_600_000
HEARTBEAT_MS = 60_000
TOPIC = "billing.daily"

Phases = dict[str, float]

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


def _admin(server: URL, sql: str) -> None:
    with psycopg.connect(dsn(server.set(database="postgres")), autocommit=True) as conn:
        conn.execute(sql)


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
    conn.execute("VACUUM ANALYZE joblease_lease")
    conn.execute("VACUUM ANALYZE joblease_outbox")
    conn.execute("VACUUM ANALYZE floor_lease")
    conn.execute("VACUUM ANALYZE floor_outbox")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="100,1000,10000", help="range sizes in days (default 100,1000,10000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per size (default 3)")
    parser.add_argument("--loop-max", type=int, default=10_000, help="largest size the per-key loop runs at")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]

    server = make_url(os.environ.get("JOBLEASE_BENCH_PG_URL", DEFAULT_URL)).set(
        drivername="postgresql+psycopg"
    )
    name = f"joblease_bench_range_{os.getpid()}"
    url = server.set(database=name)
    _admin(server, f'CREATE DATABASE "{name}"')
    started = time.perf_counter()
    table: list[tuple[str, ...]] = []
    phase_rows: list[tuple[str, ...]] = []
    engine = create_engine(url.render_as_string(hide_password=False))
    try:
        migrate(engine)
        service = LeaseService(engine, lease_ms=LEASE_MS, heartbeat_ms=HEARTBEAT_MS, holder="bench")
        with psycopg.connect(dsn(url), autocommit=True) as floor_conn:
            for sql in _FLOOR_TABLES:
                floor_conn.execute(sql)
            settings = {
                k: floor_conn.execute(f"SHOW {k}").fetchone()[0]  # type: ignore[index]
                for k in ("server_version", "synchronous_commit", "fsync")
            }
            print(
                f"PostgreSQL {redact_url(server)} {settings}; {os.cpu_count()} CPUs; {args.rounds} "
                "alternating rounds per size, medians. The machine may be shared and loaded: figures are "
                "noisy.",
                flush=True,
            )
            # Warm up every path once (connections, compiled statements, prepared plans).
            _batch(service, _days(20, "warmup"), fence=True)
            _per_key(service, _days(5, "warmup-loop"))
            _floor(floor_conn, _days(20, "warmup-floor"))
            for size in sizes:
                sides: list[tuple[str, Callable[[list[JobIdentity]], Phases]]] = [
                    ("floor", lambda jobs: _floor(floor_conn, jobs)),
                    ("batch", lambda jobs: _batch(service, jobs, fence=False)),
                    ("batch+fence", lambda jobs: _batch(service, jobs, fence=True)),
                ]
                if size <= args.loop_max:
                    sides.append(("per-key", lambda jobs: _per_key(service, jobs)))
                wall: dict[str, list[float]] = {side: [] for side, _ in sides}
                cpu: dict[str, list[float]] = {side: [] for side, _ in sides}
                phases: dict[str, list[Phases]] = {side: [] for side, _ in sides}
                for round_ in range(args.rounds):
                    shift = round_ % len(sides)
                    for side, run in sides[shift:] + sides[:shift]:
                        _empty(floor_conn)
                        jobs = _days(size, f"bench-{side}-{round_}")
                        cpu0, t0 = time.process_time(), time.perf_counter()
                        measured = run(jobs)
                        wall[side].append(time.perf_counter() - t0)
                        cpu[side].append(time.process_time() - cpu0)
                        phases[side].append(measured)
                    print(f"  {size} days, round {round_ + 1}/{args.rounds} done", flush=True)
                med = {side: statistics.median(v) for side, v in wall.items()}
                floor = med["floor"]
                for side, _ in sides:
                    ratio = med[side] / floor
                    goal = "-"
                    if side == "batch" and size >= 1_000:
                        goal = f"<= 1.5x {'OK' if ratio <= 1.5 else 'MISSED'}"
                    speedup = "-"
                    if "per-key" in med and side.startswith("batch"):
                        speedup = f"{med['per-key'] / med[side]:.1f}x"
                    row = (
                        str(size),
                        side,
                        f"{med[side] * 1000:,.1f} ms",
                        f"{med[side] / size * 1e6:,.0f} us",
                        f"{ratio:.2f}x",
                        f"{statistics.median(cpu[side]) * 1000:,.0f} ms",
                        speedup,
                        goal,
                    )
                    table.append(row)
                    print("  " + " | ".join(row), flush=True)
                    split = {
                        p: statistics.median(m.get(p, 0.0) for m in phases[side])
                        for p in ("claim", "heartbeat", "enqueue", "complete")
                    }
                    phase_rows.append((str(size), side, *(f"{v * 1000:,.1f}" for v in split.values())))
    finally:
        engine.dispose()
        _admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print_table(("phase ms", "side", "claim", "heartbeat", "enqueue", "complete"), phase_rows, started)
    headers = ("days", "side", "wall", "per day", "vs floor", "client cpu", "speedup vs per-key", "goal")
    print_table(headers, table, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
