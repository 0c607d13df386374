"""Outbox and dispatcher throughput against floors measured in the same run, on a scratch PostgreSQL database.

    .venv/bin/python benchmarks/dispatch.py [--pg-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres]

Rows measured, each as a ratio to its floor:

* enqueue rows/s with ``enqueue_once`` (one row per transaction, and 100 per transaction) vs the same
  INSERT (same canonical JSON and SHA-256 work) from a bare psycopg loop;
* delivered rows/s with 1, 2 and 4 dispatcher processes vs a bare keep-alive httpx POST loop against the
  same reference receiver process (plus one dispatcher at concurrency 1, the like-for-like comparison);
* the claim statement's latency with 1,000 due rows among 1,000,000 sent rows vs among 1,000 rows.

Targets: enqueue >= 0.7 of its floor; one dispatcher >= 0.6 of the HTTP floor; claim latency at 1,000,000
within 1.5x of that at 1,000. The whole run takes a few minutes; the scratch database is dropped at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dagster_joblease import outbox  # noqa: E402
from dagster_joblease.dispatch.dispatcher import claim_statement  # noqa: E402
from dagster_joblease.storage import create_engine, migrate  # noqa: E402
from tests import dispatch_workers  # noqa: E402
from tests.receiver_proc import start_receiver  # noqa: E402

DEFAULT_PG_URL = os.environ.get(
    "JOBLEASE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)

INSERT_SQL = (
    "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
    "next_attempt_at, created_at, updated_at) VALUES (%s, %s, %s::jsonb, %s, 'PENDING', 0, "
    "clock_timestamp(), clock_timestamp(), clock_timestamp()) "
    "ON CONFLICT (idempotency_key) DO NOTHING RETURNING id"
)

rows_out: list[tuple[str, str, str, str, str]] = []


def record(name: str, value: float, floor: float, unit: str, target: str, ok: bool) -> None:
    ratio = value / floor if floor else float("nan")
    rows_out.append(
        (
            name,
            f"{value:,.1f} {unit}",
            f"{floor:,.1f} {unit}",
            f"{ratio:.2f}",
            f"{target} {'OK' if ok else 'MISSED'}",
        )
    )
    print(f"  {name}: {value:,.1f} {unit} vs floor {floor:,.1f} ({ratio:.2f})", flush=True)


def _truncate(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("TRUNCATE joblease_outbox RESTART IDENTITY")


def _payload(i: int) -> dict[str, Any]:
    return {"v": 1, "order": i, "customer": f"c-{i % 97}", "lines": [{"sku": "A-1", "qty": 2}]}


# -- enqueue -------------------------------------------------------------------------------------------


def bench_enqueue(engine: sa.Engine, dsn: str, n: int) -> None:
    print(f"enqueue: {n} rows per measurement", flush=True)

    def library(batch: int) -> float:
        _truncate(engine)
        prefix = uuid.uuid4().hex[:6]
        start = time.perf_counter()
        for first in range(0, n, batch):
            with engine.begin() as conn:
                for i in range(first, min(n, first + batch)):
                    outbox.enqueue_once(
                        conn, idempotency_key=f"v2:{prefix}-{i}", topic="bench", payload=_payload(i)
                    )
        return n / (time.perf_counter() - start)

    def floor(batch: int) -> float:
        _truncate(engine)
        prefix = uuid.uuid4().hex[:6]
        with psycopg.connect(dsn) as conn:
            start = time.perf_counter()
            with conn.cursor() as cur:
                for i in range(n):
                    text = json.dumps(_payload(i), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                    sha = hashlib.sha256(text.encode()).hexdigest()
                    cur.execute(INSERT_SQL, (f"v2:{prefix}-{i}", "bench", text, sha))
                    cur.fetchone()
                    if (i + 1) % batch == 0:
                        conn.commit()
            conn.commit()
            return n / (time.perf_counter() - start)

    for batch, label in ((1, "enqueue_once, 1 row/transaction"), (100, "enqueue_once, 100 rows/transaction")):
        lib = statistics.median(library(batch) for _ in range(3))
        base = statistics.median(floor(batch) for _ in range(3))
        record(label, lib, base, "rows/s", ">= 0.70", lib >= 0.7 * base)
    _truncate(engine)


# -- delivery ------------------------------------------------------------------------------------------


def _fill_pending(engine: sa.Engine, n: int, prefix: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, "
                "attempts,"
                " next_attempt_at, created_at, updated_at) SELECT :prefix || g, 'bench', "
                "jsonb_build_object('v', 1, 'order', g), md5(g::text) || md5(g::text), 'PENDING', 0, "
                "clock_timestamp(), clock_timestamp(), clock_timestamp() FROM generate_series(1, :n) AS g"
            ),
            {"prefix": prefix, "n": n},
        )


def bench_delivery(engine: sa.Engine, url: str, n: int, floor_n: int) -> None:
    print(f"delivery: {n} rows per dispatcher run, {floor_n} POSTs for the bare loop", flush=True)
    ctx = multiprocessing.get_context("spawn")
    with start_receiver(url) as receiver, tempfile.TemporaryDirectory() as tmp:
        target = receiver.url + "/bench"
        body = json.dumps({"v": 1, "order": 1}).encode()
        with httpx.Client() as client:
            for i in range(20):  # warm up the receiver and the connection
                client.post(
                    target,
                    content=body,
                    headers={"Idempotency-Key": f"v2:warm-{i}", "Content-Type": "application/json"},
                )
            start = time.perf_counter()
            for i in range(floor_n):
                response = client.post(
                    target,
                    content=body,
                    headers={
                        "Idempotency-Key": f"v2:bare-{i}-{secrets.token_hex(4)}",
                        "Content-Type": "application/json",
                    },
                )
                response.raise_for_status()
            http_floor = floor_n / (time.perf_counter() - start)
        print(f"  bare keep-alive httpx POST loop: {http_floor:,.1f} req/s", flush=True)

        def run(processes: int, concurrency: int, rows: int) -> float:
            _truncate(engine)
            _fill_pending(engine, rows, f"v2:d{processes}c{concurrency}-{uuid.uuid4().hex[:6]}-")
            paths = [Path(tmp) / f"{uuid.uuid4().hex}.json" for _ in range(processes)]
            workers = [
                ctx.Process(
                    target=dispatch_workers.drain,
                    args=(url, {"bench": {"url": target}}, {"concurrency": concurrency}, str(p), 250),
                )
                for p in paths
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join(300)
            results = [json.loads(p.read_text()) for p in paths]
            assert sum(r["sent"] for r in results) == rows, results
            span = max(r["finished"] for r in results) - min(r["started"] for r in results)
            return rows / span

        like = run(1, 1, floor_n)
        record("1 dispatcher, concurrency 1", like, http_floor, "rows/s", ">= 0.60", like >= 0.6 * http_floor)
        for processes in (1, 2, 4):
            rate = run(processes, 8, n)
            target_text = ">= 0.60" if processes == 1 else "(info)"
            record(
                f"{processes} dispatcher process{'es' if processes > 1 else ''}, concurrency 8",
                rate,
                http_floor,
                "rows/s",
                target_text,
                rate >= 0.6 * http_floor,
            )
    _truncate(engine)


# -- claim latency -----------------------------------------------------------------------------------


def _claim_latency_ms(engine: sa.Engine, reps: int = 40) -> float:
    samples = []
    with engine.connect() as conn:
        stmt = claim_statement("postgresql", token=secrets.token_hex(16), limit=100, claim_ms=60_000)
        for _ in range(reps + 5):
            with conn.begin() as tx:
                start = time.perf_counter()
                claimed = conn.execute(stmt).all()
                samples.append((time.perf_counter() - start) * 1000)
                tx.rollback()
            assert len(claimed) == 100
    return statistics.median(samples[5:])


def bench_claim(engine: sa.Engine, sent: int, due: int) -> None:
    print(f"claim latency: {due} due rows among {sent:,} sent rows vs alone", flush=True)
    _truncate(engine)
    _fill_pending(engine, due, "v2:due-")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE joblease_outbox")
    small = _claim_latency_ms(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, "
                "attempts,"
                " next_attempt_at, created_at, updated_at, sent_at) SELECT 'v2:sent-' || g, 'bench', "
                "jsonb_build_object('v', 1, 'order', g), md5(g::text) || md5(g::text), 'SENT', 1, "
                "clock_timestamp(), clock_timestamp(), clock_timestamp(), clock_timestamp() "
                "FROM generate_series(1, :n) AS g"
            ),
            {"n": sent},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE joblease_outbox")
    big = _claim_latency_ms(engine)
    with engine.connect() as conn:
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                sa.text(
                    "EXPLAIN "
                    + str(
                        claim_statement("postgresql", token="x", limit=100, claim_ms=1).compile(
                            dialect=engine.dialect, compile_kwargs={"literal_binds": True}
                        )
                    )
                )
            )
        )
    uses_index = "ix_joblease_outbox_due" in plan
    # Latency: lower is better, so the ratio shown is floor/value (>= 1/1.5 meets the target).
    rows_out.append(
        (
            f"claim 100 of {due} due among {sent:,} sent",
            f"{big:.2f} ms",
            f"{small:.2f} ms",
            f"{big / small:.2f}x",
            f"<= 1.50x {'OK' if big <= 1.5 * small else 'MISSED'} (partial index used: {uses_index})",
        )
    )
    print(
        f"  {big:.2f} ms vs {small:.2f} ms alone; plan uses ix_joblease_outbox_due: {uses_index}", flush=True
    )
    _truncate(engine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="a role that may create databases")
    parser.add_argument("--enqueue-rows", type=int, default=2_000)
    parser.add_argument("--deliver-rows", type=int, default=1_000)
    parser.add_argument("--floor-posts", type=int, default=200)
    parser.add_argument("--sent-rows", type=int, default=1_000_000)
    args = parser.parse_args()

    admin = sa.create_engine(
        sa.engine.make_url(args.pg_url).set(drivername="postgresql+psycopg"),
        isolation_level="AUTOCOMMIT",
        poolclass=sa.pool.NullPool,
    )
    name = f"joblease_bench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url_obj = sa.engine.make_url(args.pg_url).set(drivername="postgresql+psycopg", database=name)
    url = url_obj.render_as_string(hide_password=False)
    dsn = url_obj.set(drivername="postgresql").render_as_string(hide_password=False)
    engine = create_engine(url)
    started = time.perf_counter()
    try:
        migrate(engine)
        bench_enqueue(engine, dsn, args.enqueue_rows)
        bench_delivery(engine, url, args.deliver_rows, args.floor_posts)
        bench_claim(engine, args.sent_rows, 1_000)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
    headers = ("measure", "value", "floor", "ratio", "target")
    widths = [max(len(h), *(len(r[i]) for r in rows_out)) for i, h in enumerate(headers)]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows_out:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print(f"\ntotal runtime {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
