"""Per-key ordering's cost: the same rows delivered with and without ordering keys, by several dispatchers.

    .venv/bin/python benchmarks/ordering.py [--rows 10000] [--keys 1000] [--processes 3] [--rounds 3]

The PostgreSQL server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@
127.0.0.1:5432/postgres``); the script creates a scratch database and drops it at the end. The downstream is
``benchmarks/limits.py``'s recording receiver (a thread per request in this process), answering after
``--latency-ms``.

Each round delivers ``--rows`` rows twice, the two sides in alternating order: ``keys``, the rows spread
round-robin over ``--keys`` ordering keys (enqueued in one ``enqueue_many``: key 0's first row, key 1's
first row, …, so a key's rows are ``--keys`` ids apart), and ``no keys``, the same rows without one. Three
dispatcher processes (concurrency 8 each, no limits) drain the table; the figure is rows per second from
the first request the receiver saw to the last (process start and imports left out). With ordering keys a
key's next row is claimable only once its previous one is SENT, and each keyed candidate costs the claim
one probe of ``ix_joblease_outbox_ordering``. Printed per side: the median rows/s and the range, and the
ratio of the medians (keys / no keys). The machine may be shared: quote the figures with their load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.limits import DEFAULT_PG, PG_ENV, receiving, reset, run_dispatchers
from dagster_joblease import outbox
from dagster_joblease.storage import create_engine, migrate

SIDES = ("keys", "no keys")


def fill(engine: sa.Engine, rows: int, keys: int, keyed: bool) -> None:
    items = [
        outbox.OutboxItem(
            f"v2:o-{i:06d}", "work", {"v": 1, "n": i}, f"customer-{i % keys}" if keyed else None
        )
        for i in range(rows)
    ]
    with engine.begin() as conn:
        outbox.enqueue_many(conn, items)


def deliver(url: str, engine: sa.Engine, side: str, args: argparse.Namespace) -> dict[str, Any]:
    reset(engine)
    fill(engine, args.rows, args.keys, keyed=side == "keys")
    with engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE joblease_outbox")
    latency = args.latency_ms / 1000
    with receiving(latency) as rx:
        totals = run_dispatchers(url, {"work": {"url": rx.url + "/work"}}, args.processes, 600)
        times = rx.times()
    span = times[-1] - times[0] + latency
    with engine.connect() as conn:
        sent = int(
            conn.exec_driver_sql("SELECT count(*) FROM joblease_outbox WHERE status = 'SENT'").scalar_one()
        )
    assert sent == args.rows, f"{side}: {sent} of {args.rows} rows SENT"
    return {"rows_per_s": len(times) / span, "requests": len(times), "claimed": totals.get("claimed")}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    args = parser.parse_args()
    admin = sa.engine.make_url(os.environ.get(PG_ENV, DEFAULT_PG))
    name = f"joblease_bench_ordering_{uuid.uuid4().hex[:8]}"
    admin_engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin.set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url)
    results: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        migrate(engine)
        print(
            f"{args.rows} rows, {args.keys} ordering keys, {args.processes} dispatcher processes x "
            f"concurrency 8, downstream latency {args.latency_ms} ms; load average before: {os.getloadavg()}",
            flush=True,
        )
        for round_no in range(args.rounds):
            order = SIDES if round_no % 2 == 0 else SIDES[::-1]
            for side in order:
                started = time.monotonic()
                figure = deliver(url, engine, side, args)
                results[side].append(figure["rows_per_s"])
                print(
                    f"  round {round_no + 1} {side:>7}: {figure['rows_per_s']:8.1f} rows/s "
                    f"({figure['requests']} requests, {time.monotonic() - started:.1f} s with setup)",
                    flush=True,
                )
        medians = {side: statistics.median(values) for side, values in results.items()}
        for side in SIDES:
            low, high = min(results[side]), max(results[side])
            print(f"{side:>7}: median {medians[side]:.1f} rows/s (min {low:.1f}, max {high:.1f})")
        print(f"ratio keys / no keys: {medians['keys'] / medians['no keys']:.3f}")
        print(f"load average after: {os.getloadavg()}")
    finally:
        engine.dispose()
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin_engine.dispose()


if __name__ == "__main__":
    main()
