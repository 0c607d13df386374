"""Lease claims on PostgreSQL beside the *minimal* bare psycopg 3 loop doing the same work (the floor).

    .venv/bin/python benchmarks/lease.py [--fast] [--seconds 2] [--rounds 3] [--processes 1,4]

The server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
postgres``); the script creates its own databases and drops them at the end. Every cell alternates library
and floor rounds (the order flips each round), prints the median of each, the ratio, and the client CPU
per call (``time.process_time``). Paths:

* ``claim``: every call claims a new identity. Floor: a prepared ``INSERT … ON CONFLICT (lock_key) DO
  NOTHING RETURNING id`` of the same row, autocommit, one connection per process.
* ``refused``: every call targets an identity held by a live lease. Floor: a prepared ``INSERT … ON
  CONFLICT (lock_key) DO UPDATE … WHERE <reclaimable> RETURNING id`` (which says nothing about why and
  locks the row). The library also says why (held): its insert finds the row, then one more statement
  reads its status without a lock.
* ``scale``: the library's ``claim`` at 1 process with 1,000,000 finished leases in the table (100,000
  with ``--fast``) vs on an empty table, alternating between two databases, as throughput and as the
  statement's server execution time (``EXPLAIN ANALYZE``, rolled back; the commit flush and the round
  trip, which dominate on a busy machine, left out). Target <= 1.2x.

Targets: library >= 0.85 of its floor for ``claim`` and ``refused`` at 1 and 4 processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import secrets
import statistics
import sys
import time
import uuid
from multiprocessing.synchronize import Barrier
from typing import Any

import psycopg
import sqlalchemy as sa
from report import dsn, print_table
from sqlalchemy.engine import URL, make_url

from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService, psycopg_claim_sql
from dagster_joblease.storage import create_engine, migrate, redact_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
HELD_KEYS = 1_000
LEASE_MS = 3_600_000

_INSERT = (
    "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, attempt, lease_ms, "
    "holder, created_at, acquired_at, heartbeat_at, expires_at) VALUES (%s, 'SCHEDULE', %s, %s, 'RUNNING', "
    "%s, 1, %s, %s, clock_timestamp(), clock_timestamp(), clock_timestamp(), "
    "clock_timestamp() + %s * INTERVAL '1 millisecond') "
)
FLOOR_CLAIM = _INSERT + "ON CONFLICT (lock_key) DO NOTHING RETURNING id"
FLOOR_REFUSED = (
    _INSERT + "ON CONFLICT (lock_key) DO UPDATE SET owner_token = EXCLUDED.owner_token, "
    "attempt = joblease_lease.attempt + 1, expires_at = EXCLUDED.expires_at "
    "WHERE joblease_lease.status = 'FAIL' OR (joblease_lease.status = 'RUNNING' "
    "AND joblease_lease.expires_at < clock_timestamp()) RETURNING id"
)


def _admin(url: URL, sql: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(sql)


def _jobs(workload: str, tag: str, count: int) -> list[JobIdentity]:
    if workload == "refused":
        start = secrets.randbelow(HELD_KEYS)
        return [
            JobIdentity.schedule("bench-held", f"key-{(start + i) % HELD_KEYS}") for i in range(HELD_KEYS)
        ]
    return [JobIdentity.schedule("bench", f"{tag}-{i}") for i in range(count)]


def _worker(kind: str, workload: str, url: str, seconds: float, barrier: Barrier, results: Any) -> None:
    tag = f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    jobs = _jobs(workload, tag, 50_000)
    count = 0
    if kind == "library":
        engine = create_engine(url)
        service = LeaseService(engine, lease_ms=LEASE_MS)
        for i in range(10):  # warm the pool and the prepared statement, like the floor's connection
            service.try_acquire(JobIdentity.schedule("bench-warmup", f"{tag}-{i}"))
        barrier.wait()
        cpu = time.process_time()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            service.try_acquire(jobs[count % len(jobs)])
            count += 1
        cpu = time.process_time() - cpu
        engine.dispose()
    else:
        sql = FLOOR_CLAIM if workload != "refused" else FLOOR_REFUSED
        holder = f"floor:{os.getpid()}"
        with psycopg.connect(dsn(url), autocommit=True) as conn:
            for i in range(10):
                warm = JobIdentity.schedule("bench-warmup", f"{tag}-{i}")
                args = (warm.idempotency_key, warm.code, warm.run_key, "w", LEASE_MS, holder, LEASE_MS)
                conn.execute(sql, args, prepare=True).fetchone()
            barrier.wait()
            cpu = time.process_time()
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                job = jobs[count % len(jobs)]
                args = (
                    job.idempotency_key,
                    job.code,
                    job.run_key,
                    secrets.token_hex(16),
                    LEASE_MS,
                    holder,
                    LEASE_MS,
                )
                conn.execute(sql, args, prepare=True).fetchone()
                count += 1
            cpu = time.process_time() - cpu
    results.put((count, cpu))


def _measure(kind: str, workload: str, url: str, processes: int, seconds: float) -> tuple[float, float]:
    """Calls per second over all processes, and client CPU microseconds per call."""
    mp = multiprocessing.get_context("fork")
    barrier = mp.Barrier(processes)
    results = mp.Queue()
    procs = [
        mp.Process(target=_worker, args=(kind, workload, url, seconds, barrier, results))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    counts: list[tuple[int, float]] = []
    while len(counts) < processes:
        try:
            counts.append(results.get(timeout=0.5))
        except queue.Empty:
            failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"a {kind} worker failed (exit codes {failed})") from None
    for proc in procs:
        proc.join()
    calls = sum(c for c, _ in counts)
    return calls / seconds, sum(cpu for _, cpu in counts) / max(calls, 1) * 1e6


def _reset(url: str, keep_finished: bool) -> None:
    """Drop the rows earlier rounds claimed (keeping the held keys and, if asked, the finished ones)."""
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        if keep_finished:
            conn.execute("DELETE FROM joblease_lease WHERE code IN ('bench', 'bench-warmup')")
        else:
            conn.execute("DELETE FROM joblease_lease WHERE code <> 'bench-held'")
        conn.execute("VACUUM ANALYZE joblease_lease")


def _hold_keys(url: str) -> None:
    engine = create_engine(url)
    service = LeaseService(engine, lease_ms=LEASE_MS)
    for i in range(HELD_KEYS):
        assert service.acquire(JobIdentity.schedule("bench-held", f"key-{i}")) is not None
    engine.dispose()


def _fill_finished(url: str, rows: int) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, attempt, "
            "lease_ms, holder, created_at, acquired_at, heartbeat_at, expires_at, finished_at) "
            "SELECT 'v2:done:' || g, 'SCHEDULE', 'done', 'run-' || g, 'SUCCESS', md5(g::text), 1, 60000, "
            "'h', now(), now(), now(), now(), now() FROM generate_series(1, %s) AS g",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE joblease_lease")


def _server_ms(url: str, reps: int = 50) -> float:
    """Median server execution time of the library's claim of a new key (EXPLAIN ANALYZE, rolled back):
    the statement's own cost, without the commit flush and the round trip that dominate a noisy machine."""
    insert, _ = psycopg_claim_sql()
    samples = []
    with psycopg.connect(dsn(url)) as conn:
        for _ in range(reps):
            job = JobIdentity.schedule("bench", secrets.token_hex(8))
            values = {
                "p_lock_key": job.idempotency_key,
                "p_job_type": job.type.value,
                "p_code": job.code,
                "p_run_key": job.run_key,
                "p_owner_token": secrets.token_hex(16),
                "p_lease_ms": LEASE_MS,
                "p_holder": "bench",
            }
            row = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + insert.sql,
                insert.args(values),
            ).fetchone()
            assert row is not None
            samples.append(float(row[0][0]["Execution Time"]))
            conn.rollback()
    return statistics.median(samples[5:])


def _cell(
    label: str, a: tuple[str, str], b: tuple[str, str], workload: str, processes: int, args: Any
) -> tuple[float, float, float, float]:
    """Alternate ``a`` (library) and ``b`` (floor) rounds; medians of rate and CPU per call for each."""
    rates: dict[str, list[float]] = {"a": [], "b": []}
    cpus: dict[str, list[float]] = {"a": [], "b": []}
    for round_ in range(args.rounds):
        order = (("a", a), ("b", b)) if round_ % 2 == 0 else (("b", b), ("a", a))
        for side, (kind, url) in order:
            _reset(url, keep_finished=label == "scale")
            rate, cpu = _measure(kind, workload, url, processes, args.seconds)
            rates[side].append(rate)
            cpus[side].append(cpu)
    return (
        statistics.median(rates["a"]),
        statistics.median(rates["b"]),
        statistics.median(cpus["a"]),
        statistics.median(cpus["b"]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per round (default 2)")
    parser.add_argument("--processes", default="1,4", help="process counts (default 1,4)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell (default 3)")
    parser.add_argument("--finished", type=int, default=1_000_000, help="finished leases for the scale row")
    parser.add_argument("--fast", action="store_true", help="quick check: 0.5 s rounds, 100,000 finished")
    args = parser.parse_args(argv)
    if args.fast:
        args.seconds, args.finished = 0.5, min(args.finished, 100_000)
    counts = [int(x) for x in args.processes.split(",")]

    server = make_url(os.environ.get("JOBLEASE_BENCH_PG_URL", DEFAULT_URL)).set(
        drivername="postgresql+psycopg"
    )
    names = [f"joblease_bench_{os.getpid()}_{i}" for i in (1, 2)]
    urls = [server.set(database=n).render_as_string(hide_password=False) for n in names]
    for name in names:
        _admin(server, f'CREATE DATABASE "{name}"')
    started = time.perf_counter()
    table: list[tuple[str, str, str, str, str, str, str]] = []
    try:
        for url in urls:
            migrate(create_engine(url, poolclass=sa.pool.NullPool))
        _hold_keys(urls[0])
        with psycopg.connect(dsn(server)) as conn:
            settings = {
                k: conn.execute(f"SHOW {k}").fetchone()[0]  # type: ignore[index]
                for k in ("server_version", "synchronous_commit", "fsync")
            }
        print(
            f"PostgreSQL {redact_url(server)} {settings}; {os.cpu_count()} CPUs; "
            f"{args.seconds:g} s x {args.rounds} alternating rounds per cell, medians",
            flush=True,
        )
        url = urls[0]
        for workload in ("claim", "refused"):
            for processes in counts:
                lib, floor, lib_cpu, floor_cpu = _cell(
                    workload, ("library", url), ("floor", url), workload, processes, args
                )
                ratio = lib / floor
                row = (
                    workload,
                    str(processes),
                    f"{floor:,.0f}/s",
                    f"{lib:,.0f}/s",
                    f"{ratio:.2f}",
                    f"{lib_cpu:.0f} / {floor_cpu:.0f}",
                    f">= 0.85 {'OK' if ratio >= 0.85 else 'MISSED'}",
                )
                table.append(row)
                print("  " + " | ".join(row), flush=True)
        print(f"filling {args.finished:,} finished leases for the scale row ...", flush=True)
        _fill_finished(urls[1], args.finished)
        big, empty, big_cpu, empty_cpu = _cell(
            "scale", ("library", urls[1]), ("library", urls[0]), "claim", 1, args
        )
        cost = empty / big  # cost per claim with many rows relative to the empty table
        row = (
            f"claim, {args.finished:,} finished vs empty",
            "1",
            f"{empty:,.0f}/s",
            f"{big:,.0f}/s",
            f"{cost:.2f}x cost",
            f"{big_cpu:.0f} / {empty_cpu:.0f}",
            f"<= 1.20x {'OK' if cost <= 1.2 else 'MISSED'}",
        )
        table.append(row)
        big_ms, small_ms = [], []
        for _ in range(args.rounds):
            big_ms.append(_server_ms(urls[1]))
            small_ms.append(_server_ms(urls[0]))
        big_med, small_med = statistics.median(big_ms), statistics.median(small_ms)
        table.append(
            (
                f"claim statement server time, {args.finished:,} finished vs empty",
                "1",
                f"{small_med * 1000:.0f} us",
                f"{big_med * 1000:.0f} us",
                f"{big_med / small_med:.2f}x cost",
                "-",
                f"<= 1.20x {'OK' if big_med <= 1.2 * small_med else 'MISSED'}",
            )
        )
    finally:
        for name in names:
            _admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    headers = ("path", "procs", "floor", "library", "ratio", "cpu us/call lib / floor", "target")
    print_table(headers, table, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
