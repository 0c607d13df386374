"""Reconciliation sensor tick time at 5,000 and 50,000 lease rows and 1,000 range runs, on PostgreSQL.

    .venv/bin/python benchmarks/reconcile.py [--rows 5000,50000] [--range-runs 1000] [--range-keys 10]
                                             [--ticks 3] [--profile]

The server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
postgres``); the script creates one database per size (the joblease tables and Dagster's run storage in it)
and drops it at the end. Each size gets that many ``FAIL`` lease rows of one code inside the lookback,
one Dagster run per ten partitions (a tenth of them canceled by a person, the rest failed) so the sensor's
run lookups find something, and ``--range-runs`` failed range runs of ``--range-keys`` keys each (half
of each range's keys never claimed: no row), stored as the daemon stores them. Then the sensor is
evaluated as the daemon evaluates it: ``--ticks`` ticks from an empty cursor with every candidate
actionable (each tick judges a full recent page, a full sweep page and the keys the range runs left
undone), and one full sweep (``rows / 1000`` ticks, cursor carried over). Printed: median and slowest
tick; what one tick reads (statements on the joblease engine, statements on Dagster's storage, run
records read); and the floor: the two bare SELECTs of the same lease pages (what reading the rows costs
without deciding anything), alternating with the sensor's ticks.

Figures are printed, never asserted. On a shared, loaded machine they are noisy: compare ratios taken in
one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import os
import pstats
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import dagster as dg
import psycopg
import sqlalchemy as sa
from dagster._core.storage.dagster_run import DagsterRun, RunRecord
from dagster._core.storage.runs.schema import RunsTable, RunTagsTable
from dagster._core.storage.runs.sql_run_storage import SqlRunStorage
from dagster._serdes import serialize_value
from dagster._time import get_current_datetime
from report import dsn, print_table
from sqlalchemy.engine import URL, make_url

from dagster_joblease.dagster import JobLeaseResource, build_reconciliation_sensor, leased_op
from dagster_joblease.dagster.sensors import db_clock
from dagster_joblease.identity import JobIdentity
from dagster_joblease.storage import create_engine, lease_table, migrate

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
CODE = "bench-reconcile"
RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"
PARTITIONS = dg.DailyPartitionsDefinition(start_date="1850-01-01", end_date="2025-01-01")
#: The last round's medians (ms: tick from an empty cursor, sweep tick; docs/performance.md, taken under a
#: load of 3.6-5.3), printed beside this run's: a tick may not grow. Another load makes them a rough guide;
#: the tick / floor ratio, taken in one run, is the comparison that holds.
LAST_ROUND_MS = {50_000: (2_477, 2_204)}


def _admin(url: URL, sql: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(sql)


@leased_op(code=CODE, name="bench_reconcile_op")
def _op(run: object) -> None:
    return None


@dg.job(name="bench_reconcile_job", partitions_def=PARTITIONS)
def bench_job() -> None:
    _op()


def _fill(
    engine: sa.Engine, instance: dg.DagsterInstance, rows: int, range_runs: int, range_keys: int
) -> list[str]:
    with dg.partition_loading_context(effective_dt=dt.datetime(2025, 6, 1, tzinfo=dt.UTC)):
        every = list(PARTITIONS.get_partition_keys())
    keys = every[-rows:]
    # Range runs over the keys before the lease rows: half of each range has FAIL rows, half none.
    spans = [every[-rows - (i + 1) * range_keys : -rows - i * range_keys] for i in range(range_runs)]
    now = db_clock(engine)
    batch = []
    for i, key in enumerate(keys):
        at = now - dt.timedelta(seconds=3_600 + i)
        batch.append(
            {
                "lock_key": JobIdentity.schedule(CODE, key).idempotency_key,
                "job_type": "SCHEDULE",
                "code": CODE,
                "run_key": key,
                "status": "FAIL",
                "owner_token": secrets.token_hex(16),
                "attempt": 1,
                "lease_ms": 180_000,
                "heartbeat_ms": 10_000,
                "holder": "bench:1",
                "created_at": at,
                "acquired_at": at,
                "heartbeat_at": at,
                "expires_at": at + dt.timedelta(minutes=3),
                "finished_at": at,
                "last_error": "RuntimeError: boom",
            }
        )
    for span in spans:
        for key in span[: range_keys // 2]:
            batch.append(
                {**batch[0], "lock_key": JobIdentity.schedule(CODE, key).idempotency_key, "run_key": key}
            )
    with engine.begin() as conn:
        for offset in range(0, len(batch), 5_000):
            conn.execute(sa.insert(lease_table), batch[offset : offset + 5_000])
    runs = [
        DagsterRun(
            job_name=bench_job.name,
            run_id=str(uuid.uuid4()),
            status=dg.DagsterRunStatus.CANCELED if i % 10 == 0 else dg.DagsterRunStatus.FAILURE,
            tags={"dagster/partition": key},
        )
        for i, key in enumerate(keys[::10])
    ]
    runs += [
        DagsterRun(
            job_name=bench_job.name,
            run_id=str(uuid.uuid4()),
            status=dg.DagsterRunStatus.FAILURE,
            tags={RANGE_START: span[0], RANGE_END: span[-1], "joblease/outcome": "failed"},
        )
        for span in spans
    ]
    _add_runs(instance, runs)
    with engine.begin() as conn:  # the statistics autovacuum keeps (a fresh table has none: bad plans)
        conn.exec_driver_sql("ANALYZE")
    return keys


def _add_runs(instance: dg.DagsterInstance, runs: list[DagsterRun]) -> None:
    """The rows ``instance.add_run`` writes, in one transaction (it connects and commits per run)."""
    storage = instance.run_storage
    assert isinstance(storage, SqlRunStorage)
    now = get_current_datetime()
    extra = {"backfill_id": None} if storage.has_backfill_id_column() else {}
    values = [
        {
            "run_id": r.run_id,
            "pipeline_name": r.job_name,
            "status": r.status.value,
            "run_body": serialize_value(r),
            "snapshot_id": None,
            "partition": r.tags.get("dagster/partition"),
            "partition_set": None,
            "create_timestamp": now,
            **extra,
        }
        for r in runs
    ]
    tags = [{"run_id": r.run_id, "key": k, "value": v} for r in runs for k, v in r.tags_for_storage().items()]
    with storage.connect() as conn:
        conn.execute(RunsTable.insert(), values)
        conn.execute(RunTagsTable.insert(), tags)


def _floor(engine: sa.Engine, after: int) -> None:
    """The two pages the sensor reads, as bare SELECTs: the cost of reading rows, deciding nothing."""
    t = lease_table
    activity = sa.func.coalesce(t.c.finished_at, t.c.heartbeat_at)
    where = [t.c.code == CODE, t.c.status.in_(["FAIL", "RUNNING"])]
    with engine.connect() as conn:
        conn.execute(sa.select(t).where(*where).order_by(activity.desc()).limit(200)).all()
        conn.execute(sa.select(t).where(*where, t.c.id > after).order_by(t.c.id).limit(1_000)).all()


class _Reads:
    """What a tick reads: statements per driver (joblease: psycopg; Dagster's storage: psycopg2) and run
    records, counted while ``counting`` is set."""

    def __init__(self) -> None:
        self.counting = False
        self.statements: dict[str, int] = {}
        self.records = 0
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", self._statement)
        original = dg.DagsterInstance.get_run_records

        def counted(instance: dg.DagsterInstance, *args: object, **kwargs: object) -> list[RunRecord]:
            found = list(original(instance, *args, **kwargs))  # type: ignore[arg-type]
            if self.counting:
                self.records += len(found)
            return found

        dg.DagsterInstance.get_run_records = counted  # type: ignore[method-assign,assignment]

    def _statement(self, conn: sa.Connection, *_args: object) -> None:
        if self.counting:
            driver = conn.dialect.driver
            self.statements[driver] = self.statements.get(driver, 0) + 1

    def start(self) -> None:
        self.statements, self.records, self.counting = {}, 0, True

    def stop(self) -> tuple[int, int, int]:
        self.counting = False
        return self.statements.get("psycopg", 0), self.statements.get("psycopg2", 0), self.records


READS = _Reads()


def _tick(
    instance: dg.DagsterInstance, sensor: dg.SensorDefinition, defs: dg.Definitions, cursor: str | None
) -> tuple[float, str | None, str]:
    with dg.build_sensor_context(
        instance=instance, resources={"joblease": JobLeaseResource()}, cursor=cursor, definitions=defs
    ) as context:
        began = time.perf_counter()
        data = sensor.evaluate_tick(context)
        took = time.perf_counter() - began
    return took, data.cursor, data.skip_message or f"{len(data.run_requests or [])} requests"


def bench(server: URL, rows: int, range_runs: int, range_keys: int, ticks: int, profile: bool) -> list[str]:
    name = f"joblease_bench_rc_{uuid.uuid4().hex[:8]}"
    _admin(server, f'CREATE DATABASE "{name}"')
    url = server.set(database=name)
    home = Path(tempfile.mkdtemp(prefix="joblease-bench-dagster-"))
    storage = url.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)
    (home / "dagster.yaml").write_text(
        f"storage:\n  postgres:\n    postgres_url: {storage}\ntelemetry:\n  enabled: false\n"
    )
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ["JOBLEASE_DATABASE_URL"] = url.render_as_string(hide_password=False)
    engine = create_engine(url.render_as_string(hide_password=False))
    try:
        migrate(engine)
        instance = dg.DagsterInstance.get()
        _fill(engine, instance, rows, range_runs, range_keys)
        sensor = build_reconciliation_sensor(
            bench_job, code=CODE, max_requests_per_tick=10_000, lookback=dt.timedelta(days=365 * 200)
        )
        defs = dg.Definitions(jobs=[bench_job], sensors=[sensor], resources={"joblease": JobLeaseResource()})
        _tick(instance, sensor, defs, None)  # warm-up: imports, partition keys, connections
        READS.start()
        _tick(instance, sensor, defs, None)
        joblease_statements, dagster_statements, records = READS.stop()
        fresh, floors = [], []
        for i in range(ticks):
            if i % 2:
                began = time.perf_counter()
                _floor(engine, 0)
                floors.append(time.perf_counter() - began)
                fresh.append(_tick(instance, sensor, defs, None)[0])
            else:
                fresh.append(_tick(instance, sensor, defs, None)[0])
                began = time.perf_counter()
                _floor(engine, 0)
                floors.append(time.perf_counter() - began)
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            _tick(instance, sensor, defs, None)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        sweep: list[float] = []
        cursor: str | None = None
        for _ in range(rows // 1_000 + 1):
            took, cursor, _message = _tick(instance, sensor, defs, cursor)
            sweep.append(took)
        instance.dispose()
        return [
            f"{rows:,}",
            f"{range_runs:,} x {range_keys}",
            f"{statistics.median(fresh) * 1000:.0f} ms",
            f"{max(fresh) * 1000:.0f} ms",
            f"{statistics.median(sweep) * 1000:.0f} ms",
            f"{max(sweep) * 1000:.0f} ms",
            f"{len(sweep)}",
            f"{statistics.median(floors) * 1000:.1f} ms",
            f"{statistics.median(fresh) / statistics.median(floors):.0f}x",
            f"{joblease_statements} / {dagster_statements} / {records:,}",
            " / ".join(f"{ms:,} ms" for ms in LAST_ROUND_MS.get(rows, ())) or "-",
        ]
    finally:
        engine.dispose()
        _admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="5000,50000", help="lease row counts, comma-separated")
    parser.add_argument("--range-runs", type=int, default=1_000, help="failed range runs stored per size")
    parser.add_argument("--range-keys", type=int, default=10, help="keys per range run (half never claimed)")
    parser.add_argument("--ticks", type=int, default=3, help="ticks from an empty cursor per size")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one tick per size")
    args = parser.parse_args()
    server = make_url(os.environ.get("JOBLEASE_BENCH_PG_URL", DEFAULT_URL)).set(
        drivername="postgresql+psycopg"
    )
    started = time.perf_counter()
    table = [
        bench(server, int(n), args.range_runs, args.range_keys, args.ticks, args.profile)
        for n in args.rows.split(",")
    ]
    print_table(
        [
            "lease rows",
            "range runs",
            "tick (median)",
            "tick (slowest)",
            "sweep tick (median)",
            "sweep tick (slowest)",
            "sweep ticks",
            "floor: read pages",
            "tick / floor",
            "one tick reads: joblease stmts / Dagster stmts / run records",
            "last round: tick / sweep tick (medians)",
        ],
        table,
        started,
    )
    print(
        "A tick judges up to 1,200 lease-row candidates (200 recent + 1,000 swept) and up to 1,000 keys the "
        "range runs left undone (20,000 looked at). Measured on a shared, loaded machine: noisy; Dagster's "
        "sensor timeout is 60 s."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
