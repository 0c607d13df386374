"""The reference receiver against the HTTP floor, measured side by side in one run on a scratch database.

    .venv/bin/python benchmarks/receiver.py [--pg-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
                                            [--rounds 5] [--seconds 2] [--senders 1 4]

Each sender process runs a bare ``httpx.Client`` keep-alive POST loop, a unique ``Idempotency-Key`` per
POST, for ``--seconds``; posts/s is the sum over processes. Targets:

* (a) the plain receiver (``benchmarks/plain_receiver.py``: one ``INSERT ... ON CONFLICT DO NOTHING`` per
  POST, autocommit) -- the floor;
* (b) the reference receiver (``joblease receiver``, its own process) with its inbox on PostgreSQL: one
  call of its ``joblease_receiver_apply`` function per POST (one round trip, one commit).

Rounds alternate (a, b, then b, a, ...) so drift on a shared machine hits both; the table shows min /
median / max, the per-round ratio b / a (goal >= 0.85), ``SUSPECT`` flags and the machine's load
(``benchmarks/harness.py``), and each receiver process's CPU per POST (all its threads; the PostgreSQL
backends' work is not in it). The scratch database is dropped at the end.

Beside them, what the inbox's guarantees cost the database: each POST's SQL alone, from a bare psycopg loop
on one autocommit connection (each call its own transaction, its commit flushed as a POST's is), in the
same rotated rounds: the reference receiver's ``joblease_receiver_apply`` call (the in-flight advisory
lock behind 409, the key's row with the payload's hash behind 422, the stored response behind a replay,
and the effect row) against the plain receiver's one-column ``INSERT ... ON CONFLICT DO NOTHING``.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import time
import uuid
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx
import psycopg
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import Figure, Sample, figure, print_figures, rotate  # noqa: E402
from benchmarks.plain_receiver import INSERT_SQL, start_plain_receiver_process  # noqa: E402
from benchmarks.report import dsn  # noqa: E402
from dagster_joblease import inbox  # noqa: E402
from dagster_joblease.receiver.app import _APPLY_CALL  # noqa: E402
from dagster_joblease.storage import create_engine, migrate  # noqa: E402
from tests.receiver_proc import start_receiver  # noqa: E402

DEFAULT_PG_URL = os.environ.get(
    "JOBLEASE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
GOAL = 0.85
#: What a sender posts (the same body for every POST; a unique key each).
BODY = b'{"v":1,"invoice":42,"amount_cents":1999}'


def _sender(url: str, seconds: float, go: EventType, out: Any) -> None:
    """A bare keep-alive POST loop: how fast one client can deliver to ``url``."""
    prefix = uuid.uuid4().hex
    body = BODY
    sent = failed = 0
    with httpx.Client(timeout=30.0) as client:
        client.get(url.rsplit("/", 1)[0] + "/health")  # open the keep-alive connection before timing
        go.wait()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            response = client.post(
                url,
                content=body,
                headers={"Idempotency-Key": f"{prefix}-{sent + failed}", "Content-Type": "application/json"},
            )
            if response.status_code == 200:
                sent += 1
            else:
                failed += 1
    out.put((sent, failed))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, senders: int, seconds: float, server_pid: int) -> tuple[float, float]:
    """Posts/s answered 200 by ``url`` from ``senders`` processes at once, and the server's CPU µs/POST."""
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(url, seconds, go, out)) for _ in range(senders)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let every sender import and connect
    cpu_before = _cpu_s(server_pid)
    go.set()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    cpu = _cpu_s(server_pid) - cpu_before
    for p in procs:
        p.join(30)
    failed = sum(f for _, f in results)
    if failed:
        raise SystemExit(f"{failed} POSTs to {url} were not answered 200")
    posts = sum(s for s, _ in results)
    return posts / seconds, cpu / max(posts, 1) * 1e6


def sql_us(db_url: str, kind: str, seconds: float) -> float:
    """Mean wall µs of one POST's SQL alone (``apply`` or ``plain``), commit included, over ``seconds``."""
    prefix = f"v2:sql-{kind}-{uuid.uuid4().hex[:8]}-"
    topic, payload = "bench", BODY.decode()
    sha = inbox.request_fingerprint(BODY)
    with psycopg.connect(dsn(db_url), autocommit=True) as conn:
        cursor = conn.cursor()

        def call(i: int) -> None:
            key = f"{prefix}{i}"
            if kind == "apply":
                response = f'{{"applied": true, "key": "{key}", "topic": "{topic}"}}'
                cursor.execute(_APPLY_CALL, (key, sha, topic, payload, 200, response), prepare=True)
                row = cursor.fetchone()
                assert row is not None and row[0] == "applied", row
            else:
                cursor.execute(INSERT_SQL, (key,), prepare=True)

        for i in range(20):  # prepare the statement, warm the caches
            call(-1 - i)
        calls, started = 0, time.perf_counter()
        deadline = started + seconds
        while (now := time.perf_counter()) < deadline:
            call(calls)
            calls += 1
    return (now - started) / calls * 1e6


def sql_figure(db_url: str, *, rounds: int, seconds: float) -> Figure:
    """The apply call against the plain INSERT (wall µs per call, lower is better), rotated rounds."""

    def side(kind: str) -> Sample:
        return Sample(sql_us(db_url, kind, seconds), 0.0)

    got = rotate(rounds, {kind: functools.partial(side, kind) for kind in ("plain", "apply")})
    for plain, apply in zip(got["plain"], got["apply"], strict=True):
        print(
            f"  SQL alone: plain INSERT {plain.rate:6.0f} us  apply function {apply.rate:6.0f} us", flush=True
        )
    return figure(
        "(the inbox's guarantees in SQL: one POST's statement alone, apply function vs plain INSERT)",
        "1 conn",
        "plain INSERT",
        got["plain"],
        got["apply"],
        unit="us",
        lower_is_better=True,
        note="wall time per call, commit flushed: advisory lock, inbox row (hash, response), effect row",
    )


def _admin(url: str, sql: str) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()


def suite(pg_url: str, *, rounds: int, seconds: float, senders: list[int]) -> list[Figure]:
    """The reference receiver against the plain one, ``rounds`` alternating rounds per sender count."""
    admin = sa.make_url(pg_url).set(drivername="postgresql+psycopg")
    name = f"joblease_bench_recv_{uuid.uuid4().hex[:8]}"
    _admin(admin.render_as_string(hide_password=False), f'CREATE DATABASE "{name}"')
    db_url = admin.set(database=name).render_as_string(hide_password=False)
    engine = create_engine(db_url)
    migrate(engine)
    engine.dispose()
    got: dict[int, dict[str, list[Sample]]] = {}
    plain_url, stop_plain, plain_pid = start_plain_receiver_process(db_url)
    reference = start_receiver(db_url)
    try:
        targets = {"plain": plain_url + "/bench", "reference": reference.url + "/bench"}
        pids = {"plain": plain_pid, "reference": reference.pid}
        for count in senders:

            def side(target: str, n: int = count) -> Sample:
                rate, cpu = measure(targets[target], n, seconds, pids[target])
                print(
                    f"  senders {n} {target:9} {rate:8.0f} posts/s  server CPU {cpu:5.0f} us/POST", flush=True
                )
                return Sample(rate, cpu)

            got[count] = rotate(
                rounds, {"plain": lambda: side("plain"), "reference": lambda: side("reference")}
            )
        sql = sql_figure(db_url, rounds=rounds, seconds=seconds)
    finally:
        reference.stop()
        stop_plain()
        _admin(admin.render_as_string(hide_password=False), f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return [
        figure(
            "reference receiver vs plain receiver",
            f"{count} senders",
            "plain",
            got[count]["plain"],
            got[count]["reference"],
            goal=GOAL,
            note="cpu: the receiver process's, per POST",
        )
        for count in senders
    ] + [sql]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="maintenance db URL")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    started = time.perf_counter()
    figures = suite(args.pg_url, rounds=args.rounds, seconds=args.seconds, senders=args.senders)
    print_figures("reference receiver", figures, args.rounds, started)
    return 0 if all(f.ratio.median >= GOAL for f in figures if f.goal is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
