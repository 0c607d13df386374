"""The index audit: which query of the library each index serves, and what it costs the hot inserts.

    .venv/bin/python benchmarks/indexes.py [--rows 200000] [--rounds 5] [--reps 150] [--long]

Two parts, on scratch databases dropped at the end:

1. **Plans.** Two databases hold the same rows (finished leases and sent outbox rows, plus a few running,
   failed, pending and dead ones): one at an earlier revision (``--before``: 0004, before the claim
   indexes of 0005; 0002 is the one before the first index audit, 0003), one at head. Each
   query the library runs on these tables (listing, show, purge, reconciliation, outbox stats and listing,
   delivery health, the dispatcher's claim) is captured from the library's own call (a SQLAlchemy
   cursor event) and run again under ``EXPLAIN ANALYZE`` in a rolled-back transaction on both; the table
   prints the indexes each plan used, any sequential scan, and the execution time.
2. **Cost on the hot insert.** For each secondary index of ``joblease_lease`` and ``joblease_outbox`` at
   head and before the audit, rounds alternate *with* and *without* that index on an emptied scratch
   table (dropped and re-created between rounds, so load drifts over both alike): per claim statement /
   enqueue INSERT (``EXPLAIN (ANALYZE, BUFFERS, WAL)`` of ``--reps`` new keys in one transaction, rolled
   back) the server execution time, and the WAL records, WAL bytes and buffers it touched, which do not
   depend on the machine's load (the time does; the commit flush and the round trip, which dominate a
   busy machine and hide an index's share, are left out). The primary keys are measured too, for scale;
   the unique indexes that ``ON CONFLICT`` needs cannot be left out.
3. **Table CHECKs against domains.** The same per-statement measure, in alternating rounds, on a scratch
   database at 0005 (the one-column rules as table CHECKs, which PostgreSQL prepares again for every
   statement that writes the table) and one at head (0006: the same rules on the columns' domains).

    .venv/bin/python benchmarks/indexes.py --before 0002   # against the schema before the first audit
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import load
from benchmarks.lease import LEASE_MS, databases, server_url
from benchmarks.report import dsn
from dagster_joblease import admin, outbox
from dagster_joblease.identity import JobIdentity
from dagster_joblease.storage import create_engine, migrate
from dagster_joblease.storage import leases as store
from dagster_joblease.storage.outbox import claim_due

TABLES = ("joblease_lease", "joblease_outbox")
#: The "before" side of every comparison unless ``--before`` says otherwise: the revision just before the
#: claim indexes (0005), whose full (code, run_key) index every claim wrote.
BEFORE_AUDIT = "0004"


# -- data ---------------------------------------------------------------------------------------------


def fill(url: str, rows: int) -> None:
    """``rows`` finished leases over 20 codes and ``rows`` sent outbox rows over 5 topics, with a few live
    ones: 200 RUNNING (20 expired), 50 FAIL, 1,000 PENDING, 100 DEAD. Finished and sent rows are from the
    last day, 1% from 30 days ago: what a regular purge with a 7-day window finds."""
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, attempt, "
            "lease_ms, holder, created_at, acquired_at, heartbeat_at, expires_at, finished_at) "
            "SELECT 'v2:' || encode(sha256(('k' || g)::bytea), 'hex'), 'SCHEDULE', 'code-' || (g %% 20), "
            "'run-' || g, CASE WHEN g <= 200 THEN 'RUNNING' WHEN g <= 250 THEN 'FAIL' ELSE 'SUCCESS' END, "
            "md5(g::text), 1, 60000, 'h', now() - (g || ' s')::interval, now() - (g || ' s')::interval, "
            "now(), CASE WHEN g <= 20 THEN now() - interval '1 min' ELSE now() + interval '1 h' END, "
            "CASE WHEN g <= 200 THEN NULL WHEN g %% 100 = 0 THEN now() - interval '30 days' "
            "ELSE now() - ((g %% 86400) || ' s')::interval END "
            "FROM generate_series(1, %s) AS g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
            "next_attempt_at, created_at, updated_at, sent_at) SELECT 'v2:o' || g, 'topic-' || (g %% 5), "
            "jsonb_build_object('v', 1, 'order', g), md5(g::text) || md5(g::text), "
            "CASE WHEN g <= 1000 THEN 'PENDING' WHEN g <= 1100 THEN 'DEAD' ELSE 'SENT' END, 1, "
            "now() - interval '1 s', now() - (g || ' s')::interval, now(), "
            "CASE WHEN g <= 1100 THEN NULL WHEN g %% 100 = 0 THEN now() - interval '30 days' "
            "ELSE now() - ((g %% 86400) || ' s')::interval END FROM generate_series(1, %s) AS g",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE joblease_lease")
        conn.execute("VACUUM ANALYZE joblease_outbox")


# -- part 1: plans --------------------------------------------------------------------------------------


def _queries() -> list[tuple[str, Callable[[sa.Engine], object]]]:
    day = 86_400_000
    week = 7 * day
    out: list[tuple[str, Callable[[sa.Engine], object]]] = [
        ("leases list (newest 100)", lambda e: admin.list_leases(e)),
        ("leases list --status running", lambda e: admin.list_leases(e, status="running")),
        ("leases list --status fail", lambda e: admin.list_leases(e, status="fail")),
        ("leases list --expired", lambda e: admin.list_leases(e, expired_only=True)),
        ("leases list --code", lambda e: admin.list_leases(e, code="code-3")),
        ("leases show CODE (count of its SCHEDULE rows)", lambda e: _show(e)),
        ("leases show CODE RUN_KEY (near-match hint)", lambda e: _show(e, "run-nope")),
        (
            "leases purge --finished-before 7d (count)",
            lambda e: admin.purge_leases(e, finished_before_ms=week, min_replay_window_ms=day, dry_run=True),
        ),
        ("outbox stats", lambda e: admin.outbox_stats(e)),
        ("outbox list --status dead", lambda e: admin.list_outbox(e, status="dead")),
        ("outbox list --status pending", lambda e: admin.list_outbox(e, status="pending")),
        ("outbox list --topic", lambda e: admin.list_outbox(e, topic="topic-2")),
        (
            "outbox purge --sent-before 7d (count)",
            lambda e: admin.purge_sent(e, older_than_ms=week, min_retention_ms=day, dry_run=True),
        ),
        ("due_summary", lambda e: outbox.due_summary(e)),
        ("dispatcher claim (100 due of a topic, rolled back)", _claim),
        ("delivery_health (topics)", lambda e: outbox.delivery_health(e, topics=["topic-1", "topic-2"])),
    ]
    keys = [f"run-{g}" for g in range(3, 3 + 20 * 200, 20)]  # 200 run keys of code-3, 10 of them live
    lock_keys = {JobIdentity.schedule("code-3", k).idempotency_key: k for k in keys}

    def _on(read: Callable[[sa.Connection], object]) -> Callable[[sa.Engine], object]:
        def run(engine: sa.Engine) -> object:
            with engine.connect() as conn:
                return read(conn)

        return run

    out += [
        (
            "reconciliation: FAIL/RUNNING rows of a code",
            _on(
                lambda c: store.reconcile_page(
                    c,
                    "code-3",
                    lookback_ms=7 * day,
                    statuses=["FAIL", "RUNNING"],
                    sweep_after=0,
                    recent=200,
                    sweep=1_000,
                )
            ),
        ),
        (
            "reconciliation catch-up: which of 200 run keys of a code have a row",
            _on(lambda c: store.run_keys_with_rows(c, "code-3", keys)),
        ),
        (
            "reconciliation walk: the rows of 200 run keys of a code (by lock key)",
            _on(lambda c: store.states_of(c, lock_keys)),
        ),
    ]
    return out


def _claim(engine: sa.Engine) -> None:
    stmt = claim_due("postgresql", token="t" * 32, limit=100, claim_ms=60_000, topics={"topic-1"})
    with engine.connect() as conn:
        tx = conn.begin()
        conn.execute(stmt).all()
        tx.rollback()


def _show(engine: sa.Engine, run_key: str | None = None) -> None:
    try:
        admin.show_lease(engine, "code-3", run_key)
    except Exception:  # not found: the count of that code's SCHEDULE rows ran, which is what we want
        pass


def _capture(engine: sa.Engine, call: Callable[[sa.Engine], object]) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH", "DELETE", "UPDATE")):
            seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        call(engine)
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    return seen


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def explain(engine: sa.Engine, statement: str, parameters: Any) -> tuple[list[str], list[str], float]:
    """Indexes used, tables read by a sequential scan, execution ms (run in a rolled-back transaction)."""
    with engine.connect() as conn:
        with conn.begin() as tx:
            raw = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters).scalar_one()
            tx.rollback()
    doc = raw if isinstance(raw, list) else json.loads(raw)
    nodes = list(_nodes(doc[0]["Plan"]))
    used = sorted({n["Index Name"] for n in nodes if "Index Name" in n})
    seq = sorted({n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"})
    return used, seq, float(doc[0]["Execution Time"])


def plans(old_url: str, new_url: str) -> list[tuple[str, str, str]]:
    old, new = create_engine(old_url), create_engine(new_url)
    rows = []
    try:
        queries = _queries()
        for name, call in queries:
            described = []
            for engine in (old, new):
                try:
                    captured = _capture(engine, call)
                    parts = []
                    for statement, parameters in captured:
                        used, seq, ms = explain(engine, statement, parameters)
                        scan = f" seq scan {', '.join(seq)}" if seq else ""
                        parts.append(f"{'+'.join(used) or '-'}{scan} {ms:.1f} ms")
                    described.append("; ".join(parts) or "(no query)")
                except Exception as exc:  # an API another change moved: say so, keep going
                    described.append(f"skipped: {type(exc).__name__}: {str(exc)[:80]}")
            rows.append((name, described[0], described[1]))
    finally:
        old.dispose()
        new.dispose()
    return rows


# -- part 2: cost of each index on the hot inserts --------------------------------------------------------


def _claim_args(i: int) -> tuple[Any, ...]:
    insert = store.INSERT_CLAIM
    job = JobIdentity.schedule("bench", f"{secrets.token_hex(6)}-{i}")
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


_ENQUEUE = (
    "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
    "next_attempt_at, created_at, updated_at) VALUES (%s, 'bench', %s::jsonb, %s, 'PENDING', 0, "
    "clock_timestamp(), clock_timestamp(), clock_timestamp()) ON CONFLICT (idempotency_key) DO NOTHING "
    "RETURNING id"
)


def insert_cost(url: str, table: str, reps: int) -> dict[str, float]:
    """Medians per new claim (lease) or enqueue (outbox), rolled back: server execution µs, WAL records,
    WAL bytes and shared buffers touched. The last three do not depend on the machine's load."""
    insert = store.INSERT_CLAIM
    samples: dict[str, list[float]] = {"us": [], "wal records": [], "wal bytes": [], "buffers": []}
    with psycopg.connect(dsn(url)) as conn:
        conn.execute(f"TRUNCATE {table}")
        conn.commit()
        for i in range(reps):
            if table == "joblease_lease":
                sql, args = insert.sql, _claim_args(i)
            else:
                text = json.dumps({"v": 1, "order": i, "note": "x" * 100})
                args = (f"v2:{secrets.token_hex(8)}-{i}", text, "0" * 64)
                sql = _ENQUEUE
            row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + sql, args).fetchone()
            assert row is not None
            doc = row[0][0]
            plan = doc["Plan"]
            samples["us"].append(float(doc["Execution Time"]) * 1000)
            samples["wal records"].append(float(plan.get("WAL Records", 0)))
            samples["wal bytes"].append(float(plan.get("WAL Bytes", 0)))
            samples["buffers"].append(
                float(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0))
            )
        conn.rollback()
    return {k: statistics.median(v[10:]) for k, v in samples.items()}


def index_defs(url: str) -> list[tuple[str, str, str, str | None]]:
    """(table, index, definition, constraint it backs or None) of our two tables."""
    with psycopg.connect(dsn(url)) as conn:
        rows = conn.execute(
            "SELECT i.tablename, i.indexname, i.indexdef, c.conname FROM pg_indexes i "
            "LEFT JOIN pg_constraint c ON c.conname = i.indexname "
            "WHERE i.tablename = ANY(%s) ORDER BY i.tablename, i.indexname",
            (list(TABLES),),
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def _drop(url: str, name: str, constraint: str | None, table: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table}")
        if constraint:
            conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{constraint}"')
        else:
            conn.execute(f'DROP INDEX "{name}"')


def _restore(url: str, definition: str, constraint: str | None, table: str, kind: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table}")
        if constraint:
            cols = definition.split("USING btree ", 1)[1]
            conn.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{constraint}" {kind} {cols}')
        else:
            conn.execute(definition)


def costs(url: str, rounds: int, reps: int) -> list[tuple[str, str, str, dict[str, float], dict[str, float]]]:
    """Per index: (table, name, definition, medians with it, medians without it; NaN where ON CONFLICT
    needs it)."""
    out = []
    for table, name, definition, constraint in index_defs(url):
        kind = "PRIMARY KEY" if name.startswith("pk_") else "UNIQUE"
        needed = constraint is not None and kind == "UNIQUE"
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for r in range(rounds):
            for present in (True, False) if r % 2 == 0 else (False, True):
                if present:
                    runs[True].append(insert_cost(url, table, reps))
                    continue
                if needed:  # ON CONFLICT (key) cannot run without its unique index
                    continue
                _drop(url, name, constraint, table)
                try:
                    runs[False].append(insert_cost(url, table, reps))
                finally:
                    _restore(url, definition, constraint, table, kind)
        keys = runs[True][0].keys()
        with_ = {k: statistics.median(x[k] for x in runs[True]) for k in keys}
        without = {
            k: statistics.median(x[k] for x in runs[False]) if runs[False] else float("nan") for k in keys
        }
        out.append((table, name, definition.split(" USING ", 1)[1], with_, without))
    return out


#: The revision whose hot tables still carried table CHECKs (0006 moved their rules onto domains).
CHECKS_REVISION = "0005"


def rules_cost(checks_url: str, domains_url: str, rounds: int, reps: int) -> list[tuple[str, float, float]]:
    """Per table: (table, median server µs per insert with 0005's table CHECKs, the same with 0006's
    domains), the two sides alternating their order every round."""
    out = []
    for table in TABLES:
        runs: dict[str, list[float]] = {checks_url: [], domains_url: []}
        for r in range(rounds):
            for url in (checks_url, domains_url) if r % 2 == 0 else (domains_url, checks_url):
                runs[url].append(insert_cost(url, table, reps)["us"])
        out.append((table, statistics.median(runs[checks_url]), statistics.median(runs[domains_url])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, default=200_000, help="finished leases and sent rows (default 200k)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per index (default 5)")
    parser.add_argument("--reps", type=int, default=150, help="statements timed per round (default 150)")
    parser.add_argument("--long", action="store_true", help="1,000,000 rows, 7 rounds, 400 statements")
    parser.add_argument("--skip-plans", action="store_true", help="only the per-index insert cost")
    parser.add_argument(
        "--before", default=BEFORE_AUDIT, help=f"the revision to compare head with (default {BEFORE_AUDIT})"
    )
    parser.add_argument("--plans-only", action="store_true", help="only the plans")
    args = parser.parse_args(argv)
    if args.long:
        args.rows, args.rounds, args.reps = 1_000_000, max(args.rounds, 7), max(args.reps, 400)
    started = time.perf_counter()
    (old_url, new_url, scratch_old, scratch_new, scratch_checks), drop = databases(server_url(), 5)
    print(load(), flush=True)
    try:
        for url, revision in (
            (old_url, args.before),
            (new_url, "head"),
            (scratch_old, args.before),
            (scratch_new, "head"),
            (scratch_checks, CHECKS_REVISION),
        ):
            engine = create_engine(url, poolclass=sa.pool.NullPool)
            migrate(engine, revision)
            engine.dispose()
        if not args.skip_plans:
            print(f"filling {args.rows:,} rows per table in two databases ...", flush=True)
            fill(old_url, args.rows)
            fill(new_url, args.rows)
            rows = plans(old_url, new_url)
            print(f"\nplans with {args.rows:,} finished leases and sent rows: indexes used, seq scans, time")
            width = max(len(r[0]) for r in rows)
            for name, before, after in rows:
                print(f"{name.ljust(width)} | {args.before}: {before}\n{' ' * width} | head: {after}")
        for label, url in () if args.plans_only else (("head", scratch_new), (args.before, scratch_old)):
            print(
                f"\ncost of each index on the hot insert at {label} ({args.rounds} alternating rounds with "
                f"and without it, medians of {args.reps} statements; time is under load, WAL and buffers "
                f"are not; {load()})",
                flush=True,
            )
            for _table, name, definition, w, wo in costs(url, args.rounds, args.reps):
                if wo["us"] != wo["us"]:
                    verdict = "needed by ON CONFLICT"
                else:
                    verdict = (
                        f"costs {w['us'] - wo['us']:+4.0f} us ({(w['us'] - wo['us']) / w['us']:+.0%}), "
                        f"{w['wal records'] - wo['wal records']:+.0f} WAL records, "
                        f"{w['wal bytes'] - wo['wal bytes']:+.0f} WAL bytes, "
                        f"{w['buffers'] - wo['buffers']:+.0f} buffers"
                    )
                print(
                    f"  {name:38} {definition[:60]:60} insert: {w['us']:4.0f} us, {w['wal records']:.0f} WAL "
                    f"records, {w['wal bytes']:.0f} B, {w['buffers']:.0f} buffers; this index {verdict}",
                    flush=True,
                )
        if not args.plans_only:
            print(
                f"\ntable CHECKs ({CHECKS_REVISION}) against domains (head), {args.rounds} alternating "
                f"rounds, medians of {args.reps} statements ({load()})",
                flush=True,
            )
            for table, checks, domains in rules_cost(scratch_checks, scratch_new, args.rounds, args.reps):
                print(
                    f"  {table:16} insert with table CHECKs {checks:4.0f} us, with domains {domains:4.0f} us "
                    f"({domains / checks:.2f}x)",
                    flush=True,
                )
    finally:
        drop()
    print(f"\n{load()}; total runtime {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
