"""Lease claims on PostgreSQL beside two floors, measured in one run: the physical one and the same-table one.

    .venv/bin/python benchmarks/lease.py [--rounds 5] [--seconds 1] [--processes 1,4] [--long]

The server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
postgres``); the script creates its own databases and drops them at the end. Three sides rotate their
order every round (see ``benchmarks/harness.py``: one window for every process, min / median / max,
``SUSPECT`` flags, the machine's load), each in its own forked processes, one connection per process:

* ``physical``: the least a lease needs, the issue's minimal table ``lease(id bigserial primary key,
  lock_key text unique, owner_token uuid, status text, fencing bigint default 1, acquired_at /
  heartbeat_at timestamptz default now(), expires_at timestamptz)`` and a prepared ``INSERT … VALUES (key,
  gen_random_uuid(), 'RUNNING', now() + interval '15 min') ON CONFLICT (lock_key) DO NOTHING RETURNING
  id``, autocommit.
* ``same-table``: the library's own table and claim statement from the same bare psycopg loop (so every
  index and column the library adds is inside it; the gap to ``physical`` is the table's cost).
* ``library``: ``LeaseService.try_acquire(JobIdentity.schedule(code, run_key))``, the identity built per
  call (its SHA-256 is part of what a caller pays; the floors get ready-made key strings, and the
  identity's own cost is printed apart).

Paths: ``claim`` (every call a new key) and ``refused`` (every call one of 100 keys held by a live
lease; the floors' statement is ``ON CONFLICT (lock_key) DO UPDATE … WHERE <reclaimable> RETURNING id``,
which locks the row to refuse it). ``scale``: the library's claim with 200,000 finished leases in the
table (1,000,000 with ``--long``) against an empty table, as throughput and as the statement's server
execution time (``EXPLAIN ANALYZE``, rolled back; no commit flush, no round trip); beside it, the physical
floor's statement on its own table with as many rows against its empty table: how much any table's claim
slows with its size (its unique index is deeper: a new key's entry lands on a random leaf of it), the
reference for the library's figure.

Goals: library >= 0.8 of the physical floor and >= 0.9 of the same-table floor; scale <= 1.2x.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    Figure,
    Sample,
    Setup,
    Stat,
    Step,
    figure,
    print_figures,
    rotate,
    run_window,
)
from benchmarks.report import checkpoint, dsn
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine, migrate
from dagster_joblease.storage import leases as store

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
HELD_KEYS = 100
LEASE_MS = 900_000  # the physical floor's 15 minutes

PHYSICAL_DDL = (
    "CREATE TABLE IF NOT EXISTS lease (id bigserial PRIMARY KEY, lock_key text UNIQUE, owner_token uuid, "
    "status text, fencing bigint DEFAULT 1, acquired_at timestamptz DEFAULT now(), "
    "heartbeat_at timestamptz DEFAULT now(), expires_at timestamptz)"
)
_PHYSICAL_INSERT = (
    "INSERT INTO lease (lock_key, owner_token, status, expires_at) "
    "VALUES (%s, gen_random_uuid(), 'RUNNING', now() + interval '15 min') "
)
PHYSICAL_CLAIM = _PHYSICAL_INSERT + "ON CONFLICT (lock_key) DO NOTHING RETURNING id"
PHYSICAL_REFUSED = (
    _PHYSICAL_INSERT + "ON CONFLICT (lock_key) DO UPDATE SET owner_token = EXCLUDED.owner_token, "
    "fencing = lease.fencing + 1, acquired_at = now(), heartbeat_at = now(), "
    "expires_at = EXCLUDED.expires_at "
    "WHERE lease.status = 'FAIL' OR (lease.status = 'RUNNING' AND lease.expires_at < now()) RETURNING id"
)

_INSERT = (
    "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, attempt, lease_ms, "
    "heartbeat_ms, holder, created_at, acquired_at, heartbeat_at, expires_at) VALUES (%s, 'SCHEDULE', %s, "
    "%s, 'RUNNING', %s, 1, %s, 30000, %s, clock_timestamp(), clock_timestamp(), clock_timestamp(), "
    "clock_timestamp() + %s * INTERVAL '1 millisecond') "
)
SAME_TABLE_CLAIM = _INSERT + "ON CONFLICT (lock_key) DO NOTHING RETURNING id"
SAME_TABLE_REFUSED = (
    _INSERT + "ON CONFLICT (lock_key) DO UPDATE SET owner_token = EXCLUDED.owner_token, "
    "attempt = joblease_lease.attempt + 1, expires_at = EXCLUDED.expires_at "
    "WHERE joblease_lease.status = 'FAIL' OR (joblease_lease.status = 'RUNNING' "
    "AND joblease_lease.expires_at < clock_timestamp()) RETURNING id"
)

HELD = [JobIdentity.schedule("bench-held", f"key-{i}") for i in range(HELD_KEYS)]


def _key(tag: str, i: int) -> str:
    """A ready-made key the length of a ``v2:`` key (3 + 64 characters)."""
    return f"v2:{tag}-{i}".ljust(67, "0")


# -- the sides (each runs in a forked worker) ------------------------------------------------------------


def physical(url: str, workload: str) -> Setup:
    def setup() -> tuple[Step, Any]:
        tag = uuid.uuid4().hex[:12]
        conn = psycopg.connect(dsn(url), autocommit=True)
        if workload == "refused":
            keys = [job.idempotency_key for job in HELD]
            offset = secrets.randbelow(HELD_KEYS)

            def step(i: int) -> object:
                return conn.execute(
                    PHYSICAL_REFUSED, (keys[(offset + i) % HELD_KEYS],), prepare=True
                ).fetchone()
        else:

            def step(i: int) -> object:
                return conn.execute(PHYSICAL_CLAIM, (_key(tag, i),), prepare=True).fetchone()

        return step, conn.close

    return setup


def same_table(url: str, workload: str) -> Setup:
    def setup() -> tuple[Step, Any]:
        tag = uuid.uuid4().hex[:12]
        holder = f"floor:{os.getpid()}"
        conn = psycopg.connect(dsn(url), autocommit=True)
        sql = SAME_TABLE_REFUSED if workload == "refused" else SAME_TABLE_CLAIM
        offset = secrets.randbelow(HELD_KEYS)

        def step(i: int) -> object:
            if workload == "refused":
                job = HELD[(offset + i) % HELD_KEYS]
                key, code, run_key = job.idempotency_key, job.code, job.run_key
            else:
                key, code, run_key = _key(tag, i), "bench", f"{tag}-{i}"
            args = (key, code, run_key, secrets.token_hex(16), LEASE_MS, holder, LEASE_MS)
            return conn.execute(sql, args, prepare=True).fetchone()

        return step, conn.close

    return setup


def library(url: str, workload: str) -> Setup:
    def setup() -> tuple[Step, Any]:
        tag = uuid.uuid4().hex[:12]
        engine = create_engine(url)
        service = LeaseService(engine, lease_ms=LEASE_MS)
        offset = secrets.randbelow(HELD_KEYS)

        def step(i: int) -> object:
            if workload == "refused":
                job = JobIdentity.schedule("bench-held", f"key-{(offset + i) % HELD_KEYS}")
            else:
                job = JobIdentity.schedule("bench", f"{tag}-{i}")
            return service.try_acquire(job)

        return step, engine.dispose

    return setup


SIDES = {"physical": physical, "same-table": same_table, "library": library}


# -- databases -------------------------------------------------------------------------------------------


def prepare(url: str) -> None:
    """Migrate the library's tables and create the physical floor's table beside them."""
    engine = create_engine(url, poolclass=sa.pool.NullPool)
    migrate(engine)
    engine.dispose()
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(PHYSICAL_DDL)


def reset(url: str) -> None:
    """Empty both tables and hold the same 100 keys in each: every side starts from the same state."""
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute("TRUNCATE joblease_lease, lease RESTART IDENTITY")
        with conn.cursor() as cur:
            cur.executemany(
                _INSERT + "RETURNING id",
                [
                    (j.idempotency_key, j.code, j.run_key, secrets.token_hex(16), LEASE_MS, "held", LEASE_MS)
                    for j in HELD
                ],
            )
            cur.executemany(_PHYSICAL_INSERT, [(j.idempotency_key,) for j in HELD])
        conn.execute("ANALYZE joblease_lease")
        conn.execute("ANALYZE lease")


def _fill_finished(url: str, rows: int) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, attempt, "
            "lease_ms, holder, created_at, acquired_at, heartbeat_at, expires_at, finished_at) "
            "SELECT 'v2:' || encode(sha256(('done:' || g)::bytea), 'hex'), 'SCHEDULE', 'done', 'run-' || g, "
            "'SUCCESS', md5(g::text), 1, 60000, 'h', now(), now(), now(), now(), now() "
            "FROM generate_series(1, %s) AS g",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE joblease_lease")
        # The physical floor's table gets as many rows, keyed alike: the reference for how much any
        # table's claim slows with its size (a deeper unique index), whatever the library adds.
        conn.execute(
            "INSERT INTO lease (lock_key, owner_token, status, expires_at) "
            "SELECT 'v2:' || encode(sha256(('done:' || g)::bytea), 'hex'), gen_random_uuid(), 'SUCCESS', "
            "now() FROM generate_series(1, %s) AS g",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE lease")


def _drop_claimed(url: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute("DELETE FROM joblease_lease WHERE code <> 'done'")
        conn.execute("DELETE FROM lease WHERE status <> 'SUCCESS'")
        conn.execute("VACUUM ANALYZE joblease_lease")
        conn.execute("VACUUM ANALYZE lease")


def _explain_ms(url: str, sql: str, args: Callable[[JobIdentity], Any], reps: int) -> float:
    """Median server execution time of ``sql`` with ``args(job)`` for a new key each time (``EXPLAIN
    ANALYZE``, rolled back): the statement's own cost, without the commit flush and the round trip that
    dominate a busy machine."""
    samples = []
    with psycopg.connect(dsn(url)) as conn:
        for _ in range(reps):
            job = JobIdentity.schedule("bench", secrets.token_hex(8))
            row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, args(job)).fetchone()
            assert row is not None
            samples.append(float(row[0][0]["Execution Time"]))
            conn.rollback()
    return statistics.median(samples[5:])


def server_ms(url: str, reps: int = 60) -> float:
    """The library's claim of a new key, as :func:`_explain_ms` measures it."""
    insert = store.INSERT_CLAIM

    def args(job: JobIdentity) -> Any:
        return insert.args(
            {
                "p_lock_key": job.idempotency_key,
                "p_job_type": job.type.value,
                "p_code": job.code,
                "p_run_key": job.run_key,
                "p_owner_token": secrets.token_hex(16),
                "p_lease_ms": LEASE_MS,
                "p_heartbeat_ms": 30_000,
                "p_holder": "bench",
            }
        )

    return _explain_ms(url, insert.sql, args, reps)


def physical_server_ms(url: str, reps: int = 60) -> float:
    """The physical floor's claim of a new key on its own table, measured the same way."""
    return _explain_ms(url, PHYSICAL_CLAIM, lambda job: (job.idempotency_key,), reps)


def identity_cpu_us(calls: int = 20_000) -> float:
    """Client CPU µs of ``JobIdentity.schedule(code, run_key)`` (validation, NFC, JSON, SHA-256)."""
    start = time.process_time()
    for i in range(calls):
        JobIdentity.schedule("bench", f"run-{i}")
    return (time.process_time() - start) / calls * 1e6


# -- the suite -------------------------------------------------------------------------------------------


def databases(server: URL, count: int) -> tuple[list[str], Any]:
    """``count`` scratch databases on ``server`` and a function that drops them."""
    names = [f"joblease_bench_{os.getpid()}_{secrets.token_hex(3)}_{i}" for i in range(count)]
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(dsn(server), autocommit=True) as conn:
            for name in names:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return [server.set(database=n).render_as_string(hide_password=False) for n in names], drop


def suite(server: URL, *, rounds: int, seconds: float, processes: list[int], finished: int) -> list[Figure]:
    """Every figure of this benchmark (printed as it goes)."""
    urls, drop = databases(server, 2)
    out: list[Figure] = []
    try:
        for url in urls:
            prepare(url)
        url = urls[0]
        hashing = identity_cpu_us()
        for workload in ("claim", "refused"):
            for procs in processes:

                def side(name: str, p: int = procs, w: str = workload) -> Sample:
                    reset(url)
                    return run_window(SIDES[name](url, w), p, seconds, before_window=lambda: checkpoint(url))

                got = rotate(rounds, {name: functools.partial(side, name) for name in SIDES})
                label = "lease claim, new key" if workload == "claim" else "claim refused, key held"
                note = f"library CPU includes the identity ({hashing:.0f} us)"
                why = (
                    "the floor's ON CONFLICT DO UPDATE WHERE locks the row to refuse it (a transaction id, "
                    "a commit flush); the library's refusal reads the row without a lock"
                    if workload == "refused"
                    else ""
                )
                for fig in (
                    figure(
                        label,
                        procs,
                        "physical",
                        got["physical"],
                        got["library"],
                        goal=0.8,
                        note=note,
                        faster_because=why,
                    ),
                    figure(
                        label,
                        procs,
                        "same-table",
                        got["same-table"],
                        got["library"],
                        goal=0.9,
                        note=note,
                        faster_because=why,
                    ),
                    figure(
                        "  (same-table floor vs physical: the table's share)",
                        procs,
                        "physical",
                        got["physical"],
                        got["same-table"],
                    ),
                ):
                    out.append(fig)
                    print("  " + " | ".join(_brief(fig)), flush=True)
        print(f"scale: filling {finished:,} finished leases ...", flush=True)
        _fill_finished(urls[1], finished)

        def scaled(u: str) -> Sample:
            _drop_claimed(u)
            return run_window(library(u, "claim"), 1, seconds)

        got = rotate(rounds, {"big": lambda: scaled(urls[1]), "empty": lambda: scaled(urls[0])})
        # As a cost: the empty table's rate over the big one's (1.10 = a claim costs 10% more).
        cost = [Sample(e.rate / b.rate, 0.0) for b, e in zip(got["big"], got["empty"], strict=True)]
        out.append(
            Figure(
                path=f"claim with {finished:,} finished leases vs empty (throughput)",
                procs="1",
                floor_name="empty",
                floor=Stat.of([s.rate for s in got["empty"]]),
                value=Stat.of([s.rate for s in got["big"]]),
                ratio=Stat.of([c.rate for c in cost]),
                goal=1.2,
                lower_is_better=True,
            )
        )
        for label, measure, goal in (
            ("claim statement server time", server_ms, 1.2),
            ("(physical floor's claim statement, same rows: any table's share)", physical_server_ms, None),
        ):
            big_ms: list[float] = []
            small_ms: list[float] = []
            for r in range(rounds):
                for u, bucket in ((urls[1], big_ms), (urls[0], small_ms))[:: 1 if r % 2 == 0 else -1]:
                    bucket.append(measure(u))
            out.append(
                Figure(
                    path=f"{label}, {finished:,} finished vs empty",
                    procs="1",
                    floor_name="empty",
                    floor=Stat.of([x * 1000 for x in small_ms]),
                    value=Stat.of([x * 1000 for x in big_ms]),
                    ratio=Stat.of([b / s for b, s in zip(big_ms, small_ms, strict=True)]),
                    unit="us",
                    goal=goal,
                    lower_is_better=True,
                )
            )
    finally:
        drop()
    return out


def _brief(fig: Figure) -> list[str]:
    return [
        fig.path.strip(),
        f"{fig.procs} procs",
        f"{fig.floor_name} {fig.floor.median:,.0f}",
        f"measured {fig.value.median:,.0f}",
        f"ratio {fig.ratio.median:.2f}",
        *fig.flags,
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per window (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="rotated rounds per cell (default 5)")
    parser.add_argument("--processes", default="1,4", help="process counts (default 1,4)")
    parser.add_argument(
        "--long", action="store_true", help="trustworthy run: 5 s windows, 7 rounds, 1,000,000 rows"
    )


def server_url() -> URL:
    return make_url(os.environ.get("JOBLEASE_BENCH_PG_URL", DEFAULT_URL)).set(drivername="postgresql+psycopg")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument("--finished", type=int, default=None, help="finished leases for the scale row")
    args = parser.parse_args(argv)
    if args.long:
        args.seconds, args.rounds = max(args.seconds, 5.0), max(args.rounds, 7)
    finished = args.finished or (1_000_000 if args.long else 200_000)
    started = time.perf_counter()
    figures = suite(
        server_url(),
        rounds=args.rounds,
        seconds=args.seconds,
        processes=[int(x) for x in args.processes.split(",")],
        finished=finished,
    )
    print_figures("lease claims", figures, args.rounds, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
