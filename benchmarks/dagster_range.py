"""A real Dagster single-run backfill of 1,000 daily partitions of a leased asset, in batch mode.

    .venv/bin/python benchmarks/dagster_range.py [--partitions 1000] [--rounds 3] [--per-key]
                                                 [--no-batch] [--no-plain] [--private-server]

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

Per run it also prints what the run cost the databases:

* **statements**, counted by ``pg_stat_statements`` when the server has it loaded
  (``shared_preload_libraries``): the joblease engine connects as a role of its own, so its statements
  (claims on raw driver connections included) are told from Dagster's. ``joblease tables``: calls of
  statements naming a ``joblease_*`` table; ``other on joblease conn``: the rest on that connection (the
  domain insert, ``BEGIN``/``COMMIT``, pings); ``Dagster``: every statement of Dagster's storage.
  ``--private-server`` starts a throwaway cluster for that (``initdb`` in a temporary directory, a free
  port, ``-c shared_preload_libraries=pg_stat_statements``; as root through ``runuser -u postgres``),
  stopped and removed whichever way the script ends (short of a SIGKILL). Without either the counts come
  from SQLAlchemy's ``before_cursor_execute`` events and miss the statements the library runs on raw
  driver connections (the note printed says so).
* **event-log bytes**: ``sum(octet_length(event))`` of the run's rows in Dagster's ``event_logs``.
* the 1-minute **load average** when the run ended (the machine's other work moves the seconds).

Dagster's own work (the run, 1,000 materialization events, the step's events) is in every side; the
ratio batch/plain is what leasing the range costs on top. Figures from a shared, loaded machine are noisy.
"""

# (no postponed annotations: Dagster inspects the asset functions defined below)

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import sqlalchemy as sa
from private_pg import private_server
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
PGSS = "pg_stat_statements"
COUNTED_BY = {True: PGSS, False: "SQLAlchemy events (raw driver statements missed)"}
EVENT_BYTES = "SELECT count(*), coalesce(sum(octet_length(event)), 0) FROM event_logs WHERE run_id = %s"


def _admin(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def _days(partitions: int, start: str) -> dg.DailyPartitionsDefinition:
    """Exactly ``partitions`` days from ``start``: a definition as long as the range, not to today."""
    first = dt.date.fromisoformat(start)
    return dg.DailyPartitionsDefinition(
        start_date=start, end_date=(first + dt.timedelta(days=partitions)).isoformat()
    )


def _assets(partitions: int, start: str) -> dict[str, Any]:
    from dagster_joblease import outbox
    from dagster_joblease.dagster import LeasedRun, leased_asset
    from dagster_joblease.dagster.ops import LeasedBatch

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


# --- what a run cost the databases ---------------------------------------------------------------------


@dataclass
class Cost:
    joblease: int  # statements naming a joblease_* table
    other: int  # the rest on the joblease engine's connections (domain insert, BEGIN/COMMIT, pings)
    dagster: int  # Dagster's storage
    events: int  # event_logs rows of the run
    event_bytes: int


class Statements:
    """Statements per run: ``pg_stat_statements`` by role when the server has it, else SQLAlchemy events
    by driver (joblease: psycopg; Dagster's storage: psycopg2), which miss raw driver statements."""

    def __init__(self, admin_url: str, database: str, role: str | None) -> None:
        self.admin_url, self.role = admin_url, role
        self.counts: dict[str, int] = {}
        self.listing: list[tuple[str, int, str]] = []
        self.dealloc = 0
        self.counting = False
        if role is None:
            sa.event.listen(sa.engine.Engine, "before_cursor_execute", self._event)
            return
        _admin(admin_url, f"CREATE EXTENSION IF NOT EXISTS {PGSS}")
        ((self.dbid, self.roleid),) = _admin(
            admin_url,
            "SELECT (SELECT oid FROM pg_database WHERE datname = %s), "
            "(SELECT oid FROM pg_roles WHERE rolname = %s)",
            (database, role),
        )

    def _event(self, conn: sa.Connection, _cursor: object, statement: str, *_args: object) -> None:
        if not self.counting:
            return
        if conn.dialect.driver == "psycopg2":
            side = "dagster"
        else:
            side = "joblease" if "joblease_" in statement.lower() else "other"
        self.counts[side] = self.counts.get(side, 0) + 1

    def start(self) -> None:
        self.counts, self.counting = {}, True
        if self.role is not None:
            _admin(self.admin_url, f"SELECT {PGSS}_reset(0, %s, 0)", (self.dbid,))
            self.dealloc = self._dealloc()

    def _dealloc(self) -> int:
        ((count,),) = _admin(self.admin_url, f"SELECT dealloc FROM {PGSS}_info")
        return int(count)

    def stop(self) -> dict[str, int]:
        self.counting = False
        if self.role is None:
            return self.counts
        rows = _admin(
            self.admin_url,
            f"SELECT userid = %s, query, calls FROM {PGSS} WHERE dbid = %s AND query NOT LIKE '%%{PGSS}%%'",
            (self.roleid, self.dbid),
        )
        if self._dealloc() > self.dealloc:
            print(f"warning: {PGSS} evicted entries during the run ({PGSS}.max): counts are low", flush=True)
        counts = {"joblease": 0, "other": 0, "dagster": 0}
        self.listing = []
        for ours, query, calls in rows:
            side = ("joblease" if "joblease_" in query.lower() else "other") if ours else "dagster"
            counts[side] += calls
            self.listing.append((side, calls, " ".join(query.split())))
        return counts

    def show(self) -> None:
        """Print the last run's statements, most called first (pg_stat_statements only)."""
        for side, calls, query in sorted(self.listing, key=lambda r: (r[0], -r[1])):
            print(f"    {side:<8} {calls:>7,}  {query[:150]}")


def _round(instance: Any, asset: Any, keys: list[str], statements: Statements, admin_url: str) -> Cost:
    from dagster_joblease.dagster import JobLeaseResource

    statements.start()
    result = dg.materialize(
        [asset],
        instance=instance,
        resources={"joblease": JobLeaseResource()},
        run_config=QUIET,
        tags={"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]},
    )
    counts = statements.stop()
    assert result.success
    materialized = instance.get_materialized_partitions(asset.key)
    assert set(keys) <= materialized, "every key of the range is materialized"
    ((events, size),) = _admin(admin_url, EVENT_BYTES, (result.run_id,))
    return Cost(counts.get("joblease", 0), counts.get("other", 0), counts.get("dagster", 0), events, size)


@dataclass
class Measured:
    seconds: list[float]
    costs: list[Cost]
    loads: list[float]


def _med(values: list[float] | list[int]) -> float:
    return float(statistics.median(values))


def _rows(measured: dict[str, Measured], partitions: int) -> list[list[str]]:
    plain = measured.get("plain")
    rows = []
    for side, m in measured.items():
        median = _med(m.seconds)
        costs = m.costs
        rows.append(
            [
                side,
                f"{median:.2f} s",
                f"{1000 * median / partitions:.2f} ms",
                f"{median / _med(plain.seconds):.2f}x" if plain else "-",
                f"{_med([c.joblease for c in costs]):,.0f}",
                f"{_med([c.other for c in costs]):,.0f}",
                f"{_med([c.dagster for c in costs]):,.0f}",
                f"{_med([c.event_bytes for c in costs]) / 1e6:.2f} MB"
                f" / {_med([c.events for c in costs]):,.0f}",
                f"{_med(m.loads):.1f} ({min(m.loads):.1f}-{max(m.loads):.1f})",
            ]
        )
    return rows


def _measure(args: argparse.Namespace, server: str, pgss: bool) -> None:
    started = time.perf_counter()
    name = f"joblease_bench_range_{uuid.uuid4().hex[:8]}"
    role = f"{name}_lease" if pgss else None
    admin_url = make_url(server).set(database=name).render_as_string(hide_password=False)
    url = make_url(admin_url).set(username=role) if role else make_url(admin_url)
    if role:  # the joblease engine's own role: pg_stat_statements keys its statements by it
        _admin(server, f'CREATE ROLE "{role}" LOGIN')
    _admin(server, f'CREATE DATABASE "{name}"' + (f' OWNER "{role}"' if role else ""))
    home = Path(tempfile.mkdtemp(prefix="joblease-bench-home-"))
    storage_url = (
        make_url(admin_url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)
    )
    (home / "dagster.yaml").write_text(
        f"storage:\n  postgres:\n    postgres_url: {storage_url}\ntelemetry:\n  enabled: false\n"
    )
    os.environ["JOBLEASE_DATABASE_URL"] = url.render_as_string(hide_password=False)
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        from dagster_joblease.storage import create_engine, migrate

        engine = create_engine(url.render_as_string(hide_password=False))
        migrate(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(DOMAIN_DDL))
        engine.dispose()
        statements = Statements(admin_url, name, role)
        if not pgss:
            print(
                "note: the server has no pg_stat_statements loaded (try --private-server): statements are "
                "SQLAlchemy's before_cursor_execute events, which miss the statements the library runs on "
                "raw driver connections (its claims, completions and heartbeats among them)",
                flush=True,
            )
        instance = dg.DagsterInstance.get()
        sides = [
            s for s, on in (("batch", args.batch), ("plain", args.plain), ("per-key", args.per_key)) if on
        ]
        measured = {s: Measured([], [], []) for s in sides}
        for i, side in enumerate(sides):  # warm-up, not counted: imports, connections, Dagster's caches
            start = f"{1800 + i * 10}-01-01"
            _round(
                instance,
                _assets(2, start)[side],
                list(_days(2, start).get_partition_keys()),
                statements,
                admin_url,
            )
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                start = f"{1700 + (r * len(sides) + sides.index(side)) * 30}-01-01"  # fresh, in the past
                keys = list(_days(args.partitions, start).get_partition_keys())
                assert len(keys) == args.partitions
                asset = _assets(args.partitions, start)[side]
                began = time.perf_counter()
                cost = _round(instance, asset, keys, statements, admin_url)
                took = time.perf_counter() - began
                load = os.getloadavg()[0]
                m = measured[side]
                m.seconds.append(took)
                m.costs.append(cost)
                m.loads.append(load)
                print(
                    f"round {r + 1} {side:<8} {took:7.2f} s  {1000 * took / len(keys):6.2f} ms/partition  "
                    f"statements joblease {cost.joblease:,} other {cost.other:,} Dagster {cost.dagster:,}  "
                    f"event log {cost.event_bytes:,} B in {cost.events:,} rows  load {load:.1f}",
                    flush=True,
                )
                if args.statements:
                    statements.show()
        instance.dispose()
        if "per-key" in measured and "batch" in measured:
            speedup = _med(measured["per-key"].seconds) / _med(measured["batch"].seconds)
            print(f"\nbatch mode is {speedup:.1f}x faster than the per-key mode")
        print(
            f"\n{args.partitions:,} daily partitions in one run, median of {args.rounds} round(s) each; "
            f"statements per run by {COUNTED_BY[pgss]}; "
            f"{os.cpu_count()} CPUs (shared, loaded machine: noisy)"
        )
        print_table(
            [
                "side",
                "run wall time",
                "per partition",
                "vs plain",
                "stmts: joblease tables",
                "other on joblease conn",
                "Dagster",
                "event log / rows",
                "load 1m at end (min-max)",
            ],
            _rows(measured, args.partitions),
            started,
        )
    finally:
        _admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if role:
            _admin(server, f'DROP ROLE IF EXISTS "{role}"')
        shutil.rmtree(home, ignore_errors=True)


def _has_pgss(server: str) -> bool:
    try:
        ((libraries,),) = _admin(server, "SELECT current_setting('shared_preload_libraries')")
    except psycopg.Error:
        return False
    return PGSS in str(libraries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--partitions", type=int, default=1_000, help="daily partitions per run (default 1,000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating (default 3)")
    parser.add_argument("--per-key", action="store_true", help="also time the per-key mode")
    parser.add_argument("--no-batch", dest="batch", action="store_false", help="leave the batch side out")
    parser.add_argument("--no-plain", dest="plain", action="store_false", help="leave the plain side out")
    parser.add_argument(
        "--statements", action="store_true", help="list each run's statements (pg_stat_statements only)"
    )
    parser.add_argument(
        "--private-server",
        action="store_true",
        help="when the server has no pg_stat_statements loaded: run on a throwaway cluster that has",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    server = os.environ.get("JOBLEASE_BENCH_PG_URL", DEFAULT_URL)
    if _has_pgss(server) or not args.private_server:
        _measure(args, server, _has_pgss(server))
        return 0
    with private_server(settings=(f"shared_preload_libraries={PGSS}", f"{PGSS}.max=100000")) as private:
        _measure(args, private, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
