"""Outbox enqueue and end-to-end delivery beside the *minimal* way to do the same work, in one run.

    .venv/bin/python benchmarks/dispatch.py [--fast] [--seconds 2] [--rounds 3] [--processes 1,4]

The server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
postgres``); the script creates scratch databases and drops them at the end. Every cell alternates library
and floor rounds (the order flips each round) and prints medians, the ratio and client CPU per row
(``time.process_time``, summed over the processes). Paths:

* ``enqueue``: one row per transaction, vs a bare psycopg 3 loop on one connection per process:
  ``BEGIN; INSERT … ON CONFLICT DO NOTHING RETURNING id; COMMIT`` with a prepared statement, inserting the
  same row (its JSON text and SHA-256 computed the plain way). The library twice: ``enqueue_once(conn)``
  on the same kind of psycopg connection, then ``commit()``; and ``with engine.begin() as conn:
  enqueue_once(conn, …)``. Target >= 0.85. An extra row runs the floor's own INSERT inside
  ``engine.begin()``, to show how much of the gap is SQLAlchemy's transaction scaffolding (connection
  checkout, begin, commit, checkin), which a caller on SQLAlchemy pays whatever the library does. The four
  sides rotate their order every round.
* ``delivery``: pending rows → ``Dispatcher.dispatch(limit=100)`` in a loop until drained (concurrency 1
  per process) → HTTP POST with ``Idempotency-Key`` → the plain receiver (``benchmarks/plain_receiver.py``,
  one ``INSERT … ON CONFLICT`` per request, in its own process) vs a bare keep-alive ``httpx.Client`` POST
  loop against the same receiver with the same bodies and keys. Target >= 0.70.
* ``claim latency``: the dispatcher's claim of 100 rows with 1,000 due among 1,000,000 sent rows (100,000
  with ``--fast``) vs 1,000 due alone, alternating between two databases. Target <= 1.5x.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import os
import queue
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import httpx
import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from dagster_joblease import outbox
from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.dispatch.dispatcher import claim_statement
from dagster_joblease.storage import create_engine, migrate, redact_url

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_receiver import start_plain_receiver
from report import dsn, print_table

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
FLOOR_INSERT = (
    "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
    "next_attempt_at, created_at, updated_at) VALUES (%s, %s, %s::jsonb, %s, 'PENDING', 0, "
    "clock_timestamp(), clock_timestamp(), clock_timestamp()) "
    "ON CONFLICT (idempotency_key) DO NOTHING RETURNING id"
)


def _payload(i: int) -> dict[str, Any]:
    return {"v": 1, "order": i, "customer": f"c-{i % 97}", "lines": [{"sku": "A-1", "qty": 2}]}


# -- processes ---------------------------------------------------------------------------------------


def _run_processes(
    target: Callable[..., None], processes: int, *args: Any
) -> list[tuple[int, float, float, float]]:
    """Run ``target(barrier, results, *args)`` in ``processes`` forked processes; their (count, cpu, start,
    end) results."""
    mp = multiprocessing.get_context("fork")
    barrier = mp.Barrier(processes)
    results = mp.Queue()
    procs = [mp.Process(target=target, args=(barrier, results, *args)) for _ in range(processes)]
    for proc in procs:
        proc.start()
    out: list[tuple[int, float, float, float]] = []
    while len(out) < processes:
        try:
            out.append(results.get(timeout=0.5))
        except queue.Empty:
            failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"a worker failed (exit codes {failed})") from None
    for proc in procs:
        proc.join()
    return out


def _rate(results: list[tuple[int, float, float, float]]) -> tuple[float, float]:
    """Rows per second over the common span, and client CPU microseconds per row."""
    rows = sum(r[0] for r in results)
    span = max(r[3] for r in results) - min(r[2] for r in results)
    return rows / span, sum(r[1] for r in results) / max(rows, 1) * 1e6


# -- enqueue -------------------------------------------------------------------------------------------


def _enqueue_worker(barrier: Barrier, results: Any, kind: str, url: str, seconds: float) -> None:
    """``floor``: the bare psycopg loop; ``psycopg``: ``enqueue_once`` on the same kind of connection, then
    ``commit()``; ``library``: ``enqueue_once`` in ``engine.begin()``; ``sqlalchemy``: the floor's INSERT
    inside ``engine.begin()`` (what SQLAlchemy's transaction scaffolding alone costs)."""
    prefix = f"v2:{kind}-{os.getpid()}-{secrets.token_hex(3)}-"
    engine = create_engine(url)
    pg = psycopg.connect(dsn(url))

    def floor_insert(conn: psycopg.Connection[Any], key: str, i: int) -> None:
        text = json.dumps(_payload(i), sort_keys=True, separators=(",", ":"))
        sha = hashlib.sha256(text.encode()).hexdigest()
        conn.execute(FLOOR_INSERT, (key, "bench", text, sha), prepare=True).fetchone()

    def step(key: str, i: int) -> None:
        if kind == "floor":
            floor_insert(pg, key, i)
            pg.commit()
            return
        if kind == "psycopg":
            outbox.enqueue_once(pg, idempotency_key=key, topic="bench", payload=_payload(i))
            pg.commit()
            return
        with engine.begin() as conn:
            if kind == "library":
                outbox.enqueue_once(conn, idempotency_key=key, topic="bench", payload=_payload(i))
            else:
                driver = conn.connection.driver_connection
                assert driver is not None
                floor_insert(driver, key, i)

    for i in range(10):
        step(f"{prefix}w{i}", i)
    barrier.wait()
    count = 0
    cpu, start = time.process_time(), time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        step(f"{prefix}{count}", count)
        count += 1
    end, cpu = time.perf_counter(), time.process_time() - cpu
    pg.close()
    engine.dispose()
    results.put((count, cpu, start, end))


# -- delivery ------------------------------------------------------------------------------------------


def _deliver_worker(
    barrier: Barrier, results: Any, kind: str, url: str, target: str, rows: int, tag: str
) -> None:
    count = 0
    if kind == "library":
        engine = create_engine(url)
        with Dispatcher(engine, {"bench": Route(target)}, concurrency=1) as dispatcher:
            barrier.wait()
            cpu, start = time.process_time(), time.perf_counter()
            while True:
                report = dispatcher.dispatch(limit=100)
                count += report.sent
                if report.claimed == 0:
                    break
            end, cpu = time.perf_counter(), time.process_time() - cpu
        engine.dispose()
    else:
        bodies = [
            json.dumps(_payload(i), sort_keys=True, separators=(",", ":")).encode() for i in range(rows)
        ]
        with httpx.Client() as client:
            for i in range(5):
                client.post(
                    target,
                    content=b"{}",
                    headers={"Idempotency-Key": f"v2:warm-{os.getpid()}-{i}-{secrets.token_hex(4)}"},
                )
            barrier.wait()
            cpu, start = time.process_time(), time.perf_counter()
            for i, body in enumerate(bodies):
                response = client.post(
                    target,
                    content=body,
                    headers={
                        "Content-Type": "application/json",
                        "Idempotency-Key": f"v2:floor-{tag}-{os.getpid()}-{i}",
                    },
                )
                response.raise_for_status()
                count += 1
            end, cpu = time.perf_counter(), time.process_time() - cpu
    results.put((count, cpu, start, end))


def _fill_pending(url: str, rows: int, prefix: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
            "next_attempt_at, created_at, updated_at) SELECT %s || g, 'bench', jsonb_build_object('v', 1, "
            "'order', g, 'customer', 'c-' || (g %% 97), 'lines', jsonb_build_array(jsonb_build_object("
            "'sku', 'A-1', 'qty', 2))), md5(g::text) || md5(g::text), 'PENDING', 0, clock_timestamp(), "
            "clock_timestamp(), clock_timestamp() FROM generate_series(1, %s) AS g",
            (prefix, rows),
        )
        conn.execute("VACUUM ANALYZE joblease_outbox")


def _truncate(url: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute("TRUNCATE joblease_outbox RESTART IDENTITY")
        conn.execute("TRUNCATE plain_effect")
        conn.execute("VACUUM ANALYZE joblease_outbox")


# -- claim latency -------------------------------------------------------------------------------------


def _claim_ms(url: str, reps: int) -> list[float]:
    engine = create_engine(url)
    samples = []
    try:
        with engine.connect() as conn:
            stmt = claim_statement(
                "postgresql", token=secrets.token_hex(16), limit=100, claim_ms=60_000, topics={"bench"}
            )
            for _ in range(reps):
                with conn.begin() as tx:
                    start = time.perf_counter()
                    claimed = conn.execute(stmt).all()
                    samples.append((time.perf_counter() - start) * 1000)
                    tx.rollback()
                assert len(claimed) == 100
    finally:
        engine.dispose()
    return samples


def _fill_sent(url: str, rows: int) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
            "next_attempt_at, created_at, updated_at, sent_at) SELECT 'v2:sent-' || g, 'bench', "
            "jsonb_build_object('v', 1, 'order', g), md5(g::text) || md5(g::text), 'SENT', 1, "
            "clock_timestamp(), clock_timestamp(), clock_timestamp(), clock_timestamp() "
            "FROM generate_series(1, %s) AS g",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE joblease_outbox")


# -- main ----------------------------------------------------------------------------------------------


def _rotate(
    rounds: int, sides: dict[str, Callable[[], tuple[float, float]]]
) -> dict[str, tuple[float, float]]:
    """Run every side once per round, the order rotated by one each round (two sides simply alternate);
    medians of each side's (rate, cpu)."""
    names = list(sides)
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            got[name].append(sides[name]())
    return {
        name: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
        for name, v in got.items()
    }


def _alternate(
    rounds: int, a: Callable[[], tuple[float, float]], b: Callable[[], tuple[float, float]]
) -> tuple[float, float, float, float]:
    """Alternate ``a`` (library) and ``b`` (floor): their median rate and CPU, ``a``'s first."""
    got = _rotate(rounds, {"a": a, "b": b})
    return (*got["a"], *got["b"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per enqueue round (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell (default 3)")
    parser.add_argument("--processes", default="1,4", help="process counts (default 1,4)")
    parser.add_argument("--deliver-rows", type=int, default=2_000, help="rows per delivery round")
    parser.add_argument("--sent-rows", type=int, default=1_000_000, help="sent rows for the claim latency")
    parser.add_argument("--fast", action="store_true", help="quick check: short rounds, 100,000 sent rows")
    args = parser.parse_args(argv)
    if args.fast:
        args.seconds, args.deliver_rows, args.sent_rows = 0.5, 600, min(args.sent_rows, 100_000)
    counts = [int(x) for x in args.processes.split(",")]

    server = make_url(os.environ.get("JOBLEASE_BENCH_PG_URL", DEFAULT_URL)).set(
        drivername="postgresql+psycopg"
    )
    names = [f"joblease_bench_{os.getpid()}_{i}" for i in (1, 2)]
    urls = [server.set(database=n).render_as_string(hide_password=False) for n in names]
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')
    table: list[tuple[str, ...]] = []

    def add(path: str, procs: str, floor: str, lib: str, ratio: str, cpu: str, target: str) -> None:
        table.append((path, procs, floor, lib, ratio, cpu, target))
        print("  " + " | ".join(table[-1]), flush=True)

    started = time.perf_counter()
    url = urls[0]
    base_url = ""
    stop_receiver: Callable[[], None] = _noop
    try:
        for u in urls:
            migrate(create_engine(u, poolclass=sa.pool.NullPool))
        base_url, stop_receiver = start_plain_receiver(dsn(url))
        print(
            f"PostgreSQL {redact_url(server)}; {os.cpu_count()} CPUs; {args.rounds} alternating rounds per "
            "cell, medians",
            flush=True,
        )
        for processes in counts:

            def enqueue(kind: str, p: int = processes) -> tuple[float, float]:
                _truncate(url)
                return _rate(_run_processes(_enqueue_worker, p, kind, url, args.seconds))

            got = _rotate(
                args.rounds,
                {
                    kind: functools.partial(enqueue, kind)
                    for kind in ("psycopg", "library", "floor", "sqlalchemy")
                },
            )
            floor, floor_cpu = got["floor"]
            for kind, label, goal in (
                ("psycopg", "enqueue, 1 row/transaction, psycopg connection", True),
                ("library", "enqueue, 1 row/transaction, SQLAlchemy engine.begin()", True),
                ("sqlalchemy", "  (floor's INSERT inside engine.begin(): SQLAlchemy's share)", False),
            ):
                rate, cpu = got[kind]
                ok = "OK" if rate >= 0.85 * floor else "MISSED"
                add(
                    label,
                    str(processes),
                    f"{floor:,.0f}/s",
                    f"{rate:,.0f}/s",
                    f"{rate / floor:.2f}",
                    f"{cpu:.0f} / {floor_cpu:.0f}",
                    f">= 0.85 {ok}" if goal else "(info)",
                )
        target = base_url + "/bench"
        for processes in counts:
            rows = args.deliver_rows * processes

            def deliver(kind: str, p: int = processes, n: int = rows) -> tuple[float, float]:
                _truncate(url)
                tag = secrets.token_hex(3)
                if kind == "library":
                    _fill_pending(url, n, f"v2:lib-{tag}-")
                    results = _run_processes(_deliver_worker, p, kind, url, target, 0, tag)
                    assert sum(r[0] for r in results) == n, results
                else:
                    results = _run_processes(_deliver_worker, p, kind, url, target, n // p, tag)
                with psycopg.connect(dsn(url)) as conn:
                    effects = conn.execute(
                        "SELECT count(*) FROM plain_effect WHERE key LIKE %s", (f"v2:%{tag}%",)
                    )
                    landed = effects.fetchone()
                assert landed is not None and landed[0] == n, (landed, n)
                return _rate(results)

            lib, lib_cpu, floor, floor_cpu = _alternate(
                args.rounds, lambda: deliver("library"), lambda: deliver("floor")
            )
            add(
                "delivery → plain receiver",
                str(processes),
                f"{floor:,.0f}/s",
                f"{lib:,.0f}/s",
                f"{lib / floor:.2f}",
                f"{lib_cpu:.0f} / {floor_cpu:.0f}",
                f">= 0.70 {'OK' if lib >= 0.7 * floor else 'MISSED'}",
            )
        stop_receiver()
        stop_receiver = _noop
        print(f"claim latency: filling {args.sent_rows:,} sent rows ...", flush=True)
        for u in urls:
            _truncate_outbox_only(u)
            _fill_pending(u, 1_000, "v2:due-")
        _fill_sent(urls[1], args.sent_rows)

        def latency(u: str) -> tuple[float, float]:
            return statistics.median(_claim_ms(u, 40)[5:]), 0.0

        big, _, small, _ = _alternate(args.rounds, lambda: latency(urls[1]), lambda: latency(urls[0]))
        add(
            f"claim 100 of 1,000 due among {args.sent_rows:,} sent vs alone",
            "1",
            f"{small:.2f} ms",
            f"{big:.2f} ms",
            f"{big / small:.2f}x cost",
            "-",
            f"<= 1.50x {'OK' if big <= 1.5 * small else 'MISSED'}",
        )
    finally:
        stop_receiver()
        with psycopg.connect(dsn(server), autocommit=True) as conn:
            for name in names:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    headers = ("path", "procs", "floor", "library", "ratio", "cpu us/row lib / floor", "target")
    print_table(headers, table, started)
    return 0


def _noop() -> None:
    pass


def _truncate_outbox_only(url: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute("TRUNCATE joblease_outbox RESTART IDENTITY")


if __name__ == "__main__":
    sys.exit(main())
