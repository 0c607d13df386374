"""A real Dagster single-run backfill of 1,000 daily partitions of a leased asset, in batch mode.

    .venv/bin/python benchmarks/dagster_range.py [--partitions 1000] [--rounds 3] [--per-key]

The server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
postgres``); the script creates its own database (the joblease tables and Dagster's own storage, as a
deployment would have them) and drops it at the end. Each round materializes a fresh range of
``--partitions`` days as one run (``BackfillPolicy.single_run()``, the range tags a backfill puts on its
run) with ``dg.materialize`` on that PostgreSQL-backed instance, and prints the wall time of the run per
partition. Sides, alternating (the order rotates each round):

* ``batch``: ``leased_asset(batch=True)``: one claim statement, one fenced transaction holding one
  ``INSERT … SELECT`` over the range into a domain table and one multi-row outbox insert
  (``run.enqueue_many``), one completion statement.
* ``plain`` (the floor: the minimal way to do the same work in Dagster): a plain ``@dg.asset`` with the same
  range doing the same domain ``INSERT … SELECT`` and the same outbox rows with bare SQL in one
  transaction, no lease.
* ``per-key`` (with ``--per-key``): today's default mode, the body per key (its own claim, heartbeat
  thread, transaction and completion), for the speedup batch mode gives.

Dagster's own work (the run, 1,000 materialization events, the step's events) is in every side; the
ratio batch/plain is what leasing the range costs on top. Figures from a shared, loaded machine are noisy.
"""

# (no postponed annotations: Dagster inspects the asset functions defined below)

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import sqlalchemy as sa
from report import dsn, print_table
from sqlalchemy.engine import make_url

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
DOMAIN_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_invoice (code text, day text, total int, PRIMARY KEY (code, day))"
)
DOMAIN_INSERT = (
    "INSERT INTO bench_invoice (code, day, total) "
    "SELECT :code, d, length(d) FROM unnest(CAST(:days AS text[])) d"
)


def _admin(url: str, sql: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(sql)


def _days(partitions: int, start: str) -> dg.DailyPartitionsDefinition:
    """Exactly ``partitions`` days from ``start``: a definition as long as the range, not to today."""
    first = dt.date.fromisoformat(start)
    return dg.DailyPartitionsDefinition(
        start_date=start, end_date=(first + dt.timedelta(days=partitions)).isoformat()
    )


def _assets(partitions: int, start: str) -> dict[str, Any]:
    from dagster_joblease import outbox
    from dagster_joblease.dagster import LeasedBatch, LeasedRun, leased_asset

    days = _days(partitions, start)
    single = dg.BackfillPolicy.single_run()
    tag = uuid.uuid4().hex[:8]

    @leased_asset(
        code=f"bench-batch-{tag}", name="batch_side", partitions_def=days, backfill_policy=single, batch=True
    )
    def batch_side(run: LeasedBatch) -> None:
        with run.transaction() as conn:
            conn.execute(sa.text(DOMAIN_INSERT), {"code": f"batch-{tag}", "days": run.partition_keys})
            run.enqueue_many(conn, topic="bench.range", payloads={d: {"day": d} for d in run.partition_keys})

    @leased_asset(code=f"bench-key-{tag}", name="per_key_side", partitions_def=days, backfill_policy=single)
    def per_key_side(run: LeasedRun) -> None:
        with run.transaction() as conn:
            conn.execute(sa.text(DOMAIN_INSERT), {"code": f"key-{tag}", "days": [run.partition_key]})
            run.enqueue_once(conn, topic="bench.range", payload={"day": run.partition_key})

    @dg.asset(
        name="plain_side", partitions_def=days, backfill_policy=single, required_resource_keys={"joblease"}
    )
    def plain_side(context: dg.AssetExecutionContext) -> None:
        keys = list(context.partition_keys)
        with context.resources.joblease.engine.begin() as conn:
            conn.execute(sa.text(DOMAIN_INSERT), {"code": f"plain-{tag}", "days": keys})
            outbox.enqueue_many(
                conn, [outbox.OutboxItem(f"plain:{tag}:{d}", "bench.range", {"day": d}) for d in keys]
            )

    return {"batch": batch_side, "plain": plain_side, "per-key": per_key_side}


def _round(instance: Any, asset: Any, keys: list[str]) -> float:
    from dagster_joblease.dagster import JobLeaseResource

    started = time.perf_counter()
    result = dg.materialize(
        [asset],
        instance=instance,
        resources={"joblease": JobLeaseResource()},
        run_config=QUIET,
        tags={"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]},
    )
    took = time.perf_counter() - started
    assert result.success
    materialized = instance.get_materialized_partitions(asset.key)
    assert set(keys) <= materialized, "every key of the range is materialized"
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--partitions", type=int, default=1_000, help="daily partitions per run (default 1,000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating (default 3)")
    parser.add_argument("--per-key", action="store_true", help="also time the per-key mode")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    server = os.environ.get("JOBLEASE_BENCH_PG_URL", DEFAULT_URL)
    name = f"joblease_bench_range_{uuid.uuid4().hex[:8]}"
    url = make_url(server).set(database=name).render_as_string(hide_password=False)
    _admin(server, f'CREATE DATABASE "{name}"')
    home = Path(tempfile.mkdtemp(prefix="joblease-bench-home-"))
    storage_url = make_url(url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)
    (home / "dagster.yaml").write_text(
        f"storage:\n  postgres:\n    postgres_url: {storage_url}\ntelemetry:\n  enabled: false\n"
    )
    os.environ["JOBLEASE_DATABASE_URL"] = url
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        from dagster_joblease.storage import create_engine, migrate

        engine = create_engine(url)
        migrate(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(DOMAIN_DDL))
        engine.dispose()
        instance = dg.DagsterInstance.get()
        sides = ["batch", "plain"] + (["per-key"] if args.per_key else [])
        times: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                start = f"{2000 + r * len(sides) + sides.index(side)}-01-01"  # a fresh range per run
                keys = _days(args.partitions, start).get_partition_keys()
                assert len(keys) == args.partitions
                took = _round(instance, _assets(args.partitions, start)[side], keys)
                times[side].append(took)
                print(
                    f"round {r + 1} {side:<8} {took:7.2f} s  {1000 * took / len(keys):6.2f} ms/partition",
                    flush=True,
                )
        instance.dispose()
        plain = statistics.median(times["plain"])
        rows = []
        for side in sides:
            median = statistics.median(times[side])
            rows.append(
                [
                    side,
                    f"{median:.2f} s",
                    f"{1000 * median / args.partitions:.2f} ms",
                    f"{median / plain:.2f}x",
                ]
            )
        if args.per_key:
            speedup = statistics.median(times["per-key"]) / statistics.median(times["batch"])
            print(f"\nbatch mode is {speedup:.1f}x faster than the per-key mode")
        print(
            f"\n{args.partitions} daily partitions in one run, median of {args.rounds} rounds each "
            "(shared, loaded machine: noisy)"
        )
        print_table(["side", "run wall time", "per partition", "vs plain"], rows, started)
    finally:
        _admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
