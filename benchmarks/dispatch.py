"""Outbox enqueue and delivery beside the physical floor and the same-table floor, measured in one run.

    .venv/bin/python benchmarks/dispatch.py [--rounds 5] [--seconds 1] [--processes 1,4] [--long]

The server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
postgres``); the script creates scratch databases and drops them at the end. Sides rotate their order
every round (``benchmarks/harness.py``: one window for every process, min / median / max, ``SUSPECT``
flags, the machine's load). Paths:

* ``enqueue``, one row (a ~150-byte JSON payload) per transaction, one connection per process:
  ``physical``: the issue's minimal ``outbox(id bigserial primary key, idempotency_key text unique, topic
  text, payload jsonb, created_at timestamptz default now(), sent_at timestamptz, attempts int default 0)``
  with a partial index on unsent rows, and ``BEGIN; INSERT … ON CONFLICT DO NOTHING RETURNING id; COMMIT``
  (prepared; ``json.dumps`` per row). ``same-table``: the library's table and columns from the same bare
  loop (its JSON text and SHA-256 computed the plain way). The library twice: ``enqueue_once(conn)`` on
  the same kind of psycopg connection then ``commit()``, and ``with engine.begin() as conn:
  enqueue_once(conn, …)``. An info row runs the same-table INSERT inside ``engine.begin()``: what
  SQLAlchemy's transaction scaffolding (checkout, begin, commit, check-in) costs whatever the library does.
* ``delivery``, one process at concurrency 1 and 8: pending rows → ``Dispatcher.dispatch(limit=100)``
  until drained (after one untimed batch of ``concurrency`` warm rows: the database connection and the
  compiled statements, as the floor's keep-alive connections, exist before the clock starts) → HTTP
  POST with ``Idempotency-Key`` → the plain receiver (``benchmarks/plain_receiver.py``, one ``INSERT …
  ON CONFLICT`` into PostgreSQL per request, its own process), vs two floors posting the same bodies
  and keys to the same receiver: a bare keep-alive ``httpx.Client`` loop (at concurrency 8: 8 threads
  sharing one client; the issue's floor), and the minimal one, a prebuilt ``httpx.Request`` straight to a
  keep-alive ``httpx.HTTPTransport`` (how the dispatcher's own client sends). The receiver's CPU share
  of one core is printed for each side: a receiver near 100% is the bottleneck and the figure measures
  it, not the dispatcher.
* ``no-op transport`` (issue 36: the dispatcher's own cost), in 1 and 4 processes: ``Dispatcher.dispatch(
  limit=100)`` at concurrency 1 whose route's transport answers every send at once with a 2xx's
  classification (:class:`NoopTransport`, put in place of the route's HTTP transport by
  :func:`use_noop_transport`: no httpx, no network; claim → message → send → judge → record), vs a bare
  psycopg loop doing the same statements on the same table (claim 100 with ``FOR UPDATE SKIP LOCKED``,
  then mark the 100 SENT in one statement, both prepared, autocommit). Each call is one batch of 100 rows
  (both sides check it), so batches/s x 100 is rows/s; 200,000 due rows are filled before each window.
  ``benchmarks/noop.py`` runs this figure alone.
* ``enqueue_many``, 1,000 rows in one caller transaction per call (``with engine.begin()`` and on a
  psycopg connection), vs a set-based floor: one ``INSERT … SELECT … FROM unnest(keys, payloads,
  sha256s) ON CONFLICT DO NOTHING RETURNING`` of the same rows (JSON text and SHA-256 computed the plain
  way, each array sent as one literal string), one transaction per call.
* ``claim latency``: the dispatcher's claim of 100 rows with 1,000 due among 200,000 sent rows
  (1,000,000 with ``--long``) vs 1,000 due alone, alternating between two databases.

Goals: enqueue >= 0.8 of physical and >= 0.9 of same-table; delivery at concurrency 8 >= 0.8; the no-op
transport >= 0.8 of its bare loop; enqueue_many >= 0.8 of unnest; claim latency <= 1.5x.
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    Figure,
    Sample,
    Setup,
    Step,
    figure,
    print_figures,
    rotate,
    run_window,
)
from benchmarks.lease import add_arguments, databases, server_url
from benchmarks.plain_receiver import start_plain_receiver_process
from benchmarks.report import checkpoint, dsn
from dagster_joblease import outbox
from dagster_joblease.dispatch import Dispatcher, Route, policy
from dagster_joblease.dispatch.transports import OutboxMessage
from dagster_joblease.storage import create_engine, migrate
from dagster_joblease.storage.outbox import claim_due

PHYSICAL_DDL = (
    "CREATE TABLE IF NOT EXISTS outbox (id bigserial PRIMARY KEY, idempotency_key text UNIQUE, topic text, "
    "payload jsonb, created_at timestamptz DEFAULT now(), sent_at timestamptz, attempts int DEFAULT 0); "
    "CREATE INDEX IF NOT EXISTS outbox_unsent ON outbox (id) WHERE sent_at IS NULL"
)
PHYSICAL_INSERT = (
    "INSERT INTO outbox (idempotency_key, topic, payload) VALUES (%s, %s, %s::jsonb) "
    "ON CONFLICT DO NOTHING RETURNING id"
)
SAME_TABLE_INSERT = (
    "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
    "next_attempt_at, created_at, updated_at) VALUES (%s, %s, %s::jsonb, %s, 'PENDING', 0, "
    "clock_timestamp(), clock_timestamp(), clock_timestamp()) "
    "ON CONFLICT (idempotency_key) DO NOTHING RETURNING id"
)
ENQUEUE_SIDES = ("physical", "same-table", "psycopg", "library", "sqlalchemy")


def payload(i: int) -> dict[str, Any]:
    """About 150 bytes of JSON."""
    return {
        "v": 1,
        "order": i,
        "customer": f"c-{i % 97}",
        "currency": "EUR",
        "lines": [{"sku": "A-1", "qty": 2, "cents": 1999}, {"sku": "B-22", "qty": 1, "cents": 500}],
        "note": "monthly",
    }


def _text(i: int) -> str:
    return json.dumps(payload(i), sort_keys=True, separators=(",", ":"))


# -- enqueue --------------------------------------------------------------------------------------------


def enqueue_side(kind: str, url: str) -> Setup:
    def setup() -> tuple[Step, Callable[[], None]]:
        prefix = f"v2:{kind}-{os.getpid()}-{secrets.token_hex(3)}-"
        engine = create_engine(url)
        pg = psycopg.connect(dsn(url))

        def same_table_insert(conn: psycopg.Connection[Any], key: str, i: int) -> None:
            text = _text(i)
            sha = hashlib.sha256(text.encode()).hexdigest()
            conn.execute(SAME_TABLE_INSERT, (key, "bench", text, sha), prepare=True).fetchone()

        # ``pooled``: the same-table loop on a connection held out of the engine's pool (the driver
        # connection engine.begin() would hand out, its setup included) without SQLAlchemy's transaction;
        # ``begin-only``: an empty ``with engine.begin():`` block. CPU-only sides (benchmarks/client.py).
        held = engine.raw_connection() if kind == "pooled" else None

        def step(i: int) -> None:
            key = f"{prefix}{i}"
            if held is not None:
                driver = held.driver_connection
                assert driver is not None
                same_table_insert(driver, key, i)
                driver.commit()
            elif kind == "begin-only":
                with engine.begin():
                    pass
            elif kind == "physical":
                pg.execute(PHYSICAL_INSERT, (key, "bench", _text(i)), prepare=True).fetchone()
                pg.commit()
            elif kind == "same-table":
                same_table_insert(pg, key, i)
                pg.commit()
            elif kind == "psycopg":
                outbox.enqueue_once(pg, idempotency_key=key, topic="bench", payload=payload(i))
                pg.commit()
            else:
                with engine.begin() as conn:
                    if kind == "library":
                        outbox.enqueue_once(conn, idempotency_key=key, topic="bench", payload=payload(i))
                    else:
                        driver = conn.connection.driver_connection
                        assert driver is not None
                        same_table_insert(driver, key, i)

        def close() -> None:
            pg.close()
            if held is not None:
                held.close()
            engine.dispose()

        return step, close

    return setup


def _truncate(url: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute("TRUNCATE joblease_outbox, outbox RESTART IDENTITY")
        conn.execute("TRUNCATE plain_effect")
        conn.execute("ANALYZE joblease_outbox")
        conn.execute("ANALYZE outbox")


# -- delivery -------------------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _deliver(kind: str, url: str, target: str, rows: int, concurrency: int, tag: str, results: Any) -> None:
    """One forked process delivering ``rows`` rows; puts ``(rows, cpu s, wall s)``."""
    if kind == "library":
        engine = create_engine(url)
        with Dispatcher(engine, {"bench": Route(target)}, concurrency=concurrency) as dispatcher:
            # The warm rows first (connections, compiled statements), as a running dispatcher has them and
            # as the floor opens its keep-alive connections before its clock starts.
            warm = dispatcher.dispatch(limit=concurrency)
            assert warm.sent == concurrency, warm
            count = 0
            cpu, start = time.process_time(), time.perf_counter()
            while True:
                report = dispatcher.dispatch(limit=100)
                count += report.sent
                if report.claimed == 0:
                    break
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        engine.dispose()
        results.put((count, cpu, wall))
        return
    bodies = [_text(i).encode() for i in range(rows)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    sent = [0] * concurrency
    if kind == "transport":
        _transport_loop(target, bodies, concurrency, limits, tag, results)
        return
    with httpx.Client(limits=limits) as client:
        for _i in range(concurrency):  # open the keep-alive connections, as a running dispatcher has
            client.post(target, content=b"{}", headers={"Idempotency-Key": f"v2:warm-{secrets.token_hex(6)}"})

        def loop(lane: int) -> None:
            for i in range(lane, rows, concurrency):
                response = client.post(
                    target,
                    content=bodies[i],
                    headers={"Content-Type": "application/json", "Idempotency-Key": f"v2:floor-{tag}-{i}"},
                )
                response.raise_for_status()
                sent[lane] += 1

        cpu, wall = _run_lanes(loop, concurrency)
    results.put((sum(sent), cpu, wall))


def _run_lanes(loop: Any, concurrency: int) -> tuple[float, float]:
    """Run ``loop(lane)`` for every lane (threads at concurrency > 1); (cpu s, wall s)."""
    cpu, start = time.process_time(), time.perf_counter()
    if concurrency == 1:
        loop(0)
    else:
        threads = [threading.Thread(target=loop, args=(lane,)) for lane in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return time.process_time() - cpu, time.perf_counter() - start


def _transport_loop(
    target: str, bodies: list[bytes], concurrency: int, limits: httpx.Limits, tag: str, results: Any
) -> None:
    """The least httpx work per row: a prebuilt request straight to a keep-alive ``HTTPTransport`` (no
    ``Client`` URL, header, cookie or auth merging), which is how the dispatcher's own client sends."""
    sent = [0] * concurrency
    url = httpx.URL(target)
    with httpx.HTTPTransport(limits=limits) as transport:

        def post(body: bytes, key: str) -> None:
            request = httpx.Request(
                "POST",
                url,
                content=body,
                headers={"Content-Type": "application/json", "Idempotency-Key": key},
            )
            response = transport.handle_request(request)
            try:
                response.read()
            finally:
                response.close()
            if response.status_code >= 400:
                raise RuntimeError(f"the receiver answered {response.status_code}")

        for _i in range(concurrency):  # open the keep-alive connections first
            post(b"{}", f"v2:warm-{secrets.token_hex(6)}")

        def loop(lane: int) -> None:
            for i in range(lane, len(bodies), concurrency):
                post(bodies[i], f"v2:floor-{tag}-{i}")
                sent[lane] += 1

        cpu, wall = _run_lanes(loop, concurrency)
    results.put((sum(sent), cpu, wall))


def deliver(
    kind: str, url: str, target: str, rows: int, concurrency: int, receiver_pid: int
) -> tuple[Sample, float]:
    """One delivery round in a fresh process: the sample, and the receiver's CPU share of one core."""
    _truncate(url)
    tag = secrets.token_hex(3)
    if kind == "library":
        _fill_pending(url, concurrency, "v2:warm-")
        _fill_pending(url, rows, f"v2:lib-{tag}-")
    mp = multiprocessing.get_context("fork")
    results = mp.Queue()
    proc = mp.Process(target=_deliver, args=(kind, url, target, rows, concurrency, tag, results))
    receiver_cpu = _cpu_s(receiver_pid)
    started = time.perf_counter()
    proc.start()
    while True:
        try:
            count, cpu, wall = results.get(timeout=0.5)
            break
        except queue.Empty:
            if proc.exitcode not in (None, 0):
                raise SystemExit(f"a {kind} delivery worker failed (exit code {proc.exitcode})") from None
    busy = (_cpu_s(receiver_pid) - receiver_cpu) / (time.perf_counter() - started)
    proc.join()
    with psycopg.connect(dsn(url)) as conn:
        row = conn.execute("SELECT count(*) FROM plain_effect WHERE key LIKE %s", (f"v2:%{tag}%",)).fetchone()
    assert count == rows and row is not None and row[0] == rows, (kind, count, row, rows)
    return Sample(count / wall, cpu / count * 1e6), busy


def _fill_pending(url: str, rows: int, prefix: str) -> None:
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
            "next_attempt_at, created_at, updated_at) SELECT %s || g, 'bench', jsonb_build_object('v', 1, "
            "'order', g, 'customer', 'c-' || (g %% 97), 'currency', 'EUR', 'lines', jsonb_build_array("
            "jsonb_build_object('sku', 'A-1', 'qty', 2, 'cents', 1999), jsonb_build_object('sku', 'B-22', "
            "'qty', 1, 'cents', 500)), 'note', 'monthly'), md5(g::text) || md5(g::text), 'PENDING', 0, "
            "clock_timestamp(), clock_timestamp(), clock_timestamp() FROM generate_series(1, %s) AS g",
            (prefix, rows),
        )
        conn.execute("ANALYZE joblease_outbox")


# -- the no-op transport: the dispatcher's own cost --------------------------------------------------------

NOOP_FILL = 200_000
BARE_CLAIM = (
    "WITH due AS (SELECT id FROM joblease_outbox WHERE status = 'PENDING' AND topic = 'bench' "
    "AND next_attempt_at <= clock_timestamp() AND (claim_expires_at IS NULL OR claim_expires_at <= "
    "clock_timestamp()) ORDER BY next_attempt_at, id LIMIT 100 FOR UPDATE SKIP LOCKED) "
    "UPDATE joblease_outbox o SET claim_token = %s, claim_expires_at = clock_timestamp() + interval '60 s', "
    "attempts = o.attempts + 1, updated_at = clock_timestamp() FROM due WHERE o.id = due.id "
    "RETURNING o.id, o.idempotency_key, o.payload::text"
)
BARE_SENT = (
    "UPDATE joblease_outbox SET status = 'SENT', sent_at = clock_timestamp(), last_status = 200, "
    "claim_token = NULL, claim_expires_at = NULL, updated_at = clock_timestamp() "
    "WHERE id = ANY(%s) AND claim_token = %s AND status = 'PENDING'"
)


class NoopTransport:
    """A :class:`~dagster_joblease.dispatch.transports.Transport` whose every send returns at once with a
    2xx's classification: what is left of a delivery is the dispatcher's own work."""

    SENT = policy.Classification(policy.Outcome.SENT, 200, "HTTP 200")

    def send(
        self, message: OutboxMessage, route: Route, deadline: float, send_by: float | None
    ) -> policy.Classification:
        return self.SENT

    def classify_exception(self, exc: BaseException) -> policy.Classification:
        raise AssertionError("the no-op transport's send never raises") from exc

    def close(self) -> None:
        pass


def use_noop_transport(dispatcher: Dispatcher) -> None:
    """Benchmark-only: every route of ``dispatcher`` sends through one :class:`NoopTransport` instead of
    the transport its URL chose (reaches into the dispatcher's private ``Sender``; the transport it
    replaces is closed, unused)."""
    sender = dispatcher._sender
    for transport in set(sender.transports.values()):
        transport.close()
    noop = NoopTransport()
    sender.transports = {topic: noop for topic in sender.transports}


def noop_side(kind: str, url: str) -> Setup:
    """One batch of 100 rows per call: the dispatcher over a transport that answers at once, or the bare
    claim + mark-SENT loop."""

    def setup() -> tuple[Step, Callable[[], None]]:
        if kind == "bare":
            conn = psycopg.connect(dsn(url), autocommit=True)

            def bare(_i: int) -> None:
                token = secrets.token_hex(16)
                rows = conn.execute(BARE_CLAIM, (token,), prepare=True).fetchall()
                assert len(rows) == 100, len(rows)
                conn.execute(BARE_SENT, ([r[0] for r in rows], token), prepare=True)

            return bare, conn.close
        engine = create_engine(url)
        dispatcher = Dispatcher(engine, {"bench": Route("http://noop.invalid/bench")}, concurrency=1)
        use_noop_transport(dispatcher)

        def library(_i: int) -> None:
            report = dispatcher.dispatch(limit=100)
            assert report.sent == 100, report

        def close() -> None:
            dispatcher.close()
            engine.dispose()

        return library, close

    return setup


def noop_figures(url: str, rounds: int, seconds: float, processes: list[int]) -> list[Figure]:
    """The no-op transport figure for each process count (see the module's docstring)."""
    out: list[Figure] = []
    for procs in processes:

        def noop(kind: str, p: int = procs) -> Sample:
            _truncate(url)
            _fill_pending(url, NOOP_FILL, f"v2:noop-{secrets.token_hex(3)}-")
            sample = run_window(
                noop_side(kind, url), p, seconds, warm=2, before_window=lambda: checkpoint(url)
            )
            return Sample(sample.rate * 100, sample.cpu_us / 100)  # rows/s, CPU us per row

        got = rotate(rounds, {"bare": lambda: noop("bare"), "library": lambda: noop("library")})
        out.append(
            figure(
                "no-op transport: claim -> send -> record, rows/s",
                procs,
                "bare claim+SENT loop",
                got["bare"],
                got["library"],
                goal=0.8,
                note=f"bare loop median {statistics.median(s.rate for s in got['bare']):,.0f} rows/s, "
                f"dispatcher {statistics.median(s.rate for s in got['library']):,.0f}; CPU us/row "
                f"{statistics.median(s.cpu_us for s in got['library']):.0f} / "
                f"{statistics.median(s.cpu_us for s in got['bare']):.0f}",
            )
        )
        _show(out[-1])
    return out


# -- enqueue_many: 1,000 rows in one transaction --------------------------------------------------------

MANY_ROWS = 1_000
UNNEST_INSERT = (
    "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts, "
    "next_attempt_at, created_at, updated_at) SELECT k, 'bench', p::jsonb, s, 'PENDING', 0, "
    "clock_timestamp(), clock_timestamp(), clock_timestamp() FROM unnest(%s::text[], %s::text[], "
    "%s::text[]) AS r(k, p, s) ORDER BY k ON CONFLICT (idempotency_key) DO NOTHING RETURNING idempotency_key"
)
MANY_SIDES = ("unnest", "psycopg", "library")


def _array(values: list[str]) -> str:
    """A PostgreSQL array literal of ``values``, built as one string: psycopg's Python dumper of a list
    costs more client CPU per element than the whole INSERT's other work (the library avoids it too,
    ``storage/rowset.py``)."""
    quoted = (v.replace("\\", "\\\\").replace('"', '\\"') for v in values)
    return "{" + ",".join(f'"{q}"' for q in quoted) + "}"


def many_side(kind: str, url: str) -> Setup:
    """One call: 1,000 rows enqueued in one transaction."""

    def setup() -> tuple[Step, Callable[[], None]]:
        prefix = f"v2:many-{kind}-{os.getpid()}-{secrets.token_hex(3)}-"
        engine = create_engine(url)
        pg = psycopg.connect(dsn(url))

        def step(i: int) -> None:
            keys = [f"{prefix}{i}-{j}" for j in range(MANY_ROWS)]
            if kind == "unnest":
                texts = [_text(j) for j in range(MANY_ROWS)]
                shas = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
                arrays = (_array(keys), _array(texts), _array(shas))
                got = pg.execute(UNNEST_INSERT, arrays, prepare=True).fetchall()
                assert len(got) == MANY_ROWS
                pg.commit()
                return
            items = [(key, "bench", payload(j)) for j, key in enumerate(keys)]
            if kind == "psycopg":
                outbox.enqueue_many(pg, items)
                pg.commit()
            else:
                with engine.begin() as conn:
                    outbox.enqueue_many(conn, items)

        def close() -> None:
            pg.close()
            engine.dispose()

        return step, close

    return setup


def many_and_noop(url: str, rounds: int, seconds: float, processes: list[int]) -> list[Figure]:
    """The enqueue_many and no-op transport figures (see the module's docstring)."""
    out: list[Figure] = []
    for procs in processes:

        def many(kind: str, p: int = procs) -> Sample:
            _truncate(url)
            return run_window(many_side(kind, url), p, seconds, warm=2, before_window=lambda: checkpoint(url))

        got = rotate(rounds, {kind: functools.partial(many, kind) for kind in MANY_SIDES})
        for kind, label in (
            ("psycopg", "enqueue_many, 1,000 rows/transaction, psycopg connection"),
            ("library", "enqueue_many, 1,000 rows/transaction, inside engine.begin()"),
        ):
            out.append(figure(label, procs, "unnest INSERT", got["unnest"], got[kind], goal=0.8))
            _show(out[-1])
    return out + noop_figures(url, rounds, seconds, processes)


# -- claim latency --------------------------------------------------------------------------------------


def claim_ms(url: str, reps: int = 40) -> float:
    engine = create_engine(url)
    samples = []
    try:
        with engine.connect() as conn:
            token = secrets.token_hex(16)
            for _ in range(reps):
                with conn.begin() as tx:
                    start = time.perf_counter()
                    claimed = claim_due(conn, token=token, limit=100, claim_ms=60_000, topics={"bench"})
                    samples.append((time.perf_counter() - start) * 1000)
                    tx.rollback()
                assert len(claimed) == 100
    finally:
        engine.dispose()
    return statistics.median(samples[5:])


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


# -- the suite ------------------------------------------------------------------------------------------


def prepare(url: str) -> None:
    engine = create_engine(url)
    migrate(engine)
    engine.dispose()
    with psycopg.connect(dsn(url), autocommit=True) as conn:
        conn.execute(PHYSICAL_DDL)
        conn.execute("CREATE TABLE IF NOT EXISTS plain_effect (key text PRIMARY KEY)")


def _show(fig: Figure) -> None:
    print(
        f"  {fig.path.strip()} | {fig.procs} | ratio {fig.ratio.median:.2f} | {'; '.join(fig.flags)}",
        flush=True,
    )


def suite(
    server: Any,
    *,
    rounds: int,
    seconds: float,
    processes: list[int],
    deliver_rows: int,
    sent_rows: int,
) -> list[Figure]:
    urls, drop = databases(server, 2)
    out: list[Figure] = []
    stop_receiver: Callable[[], None] = _noop
    try:
        for u in urls:
            prepare(u)
        url = urls[0]
        for procs in processes:

            def enqueue(kind: str, p: int = procs) -> Sample:
                _truncate(url)
                return run_window(enqueue_side(kind, url), p, seconds, before_window=lambda: checkpoint(url))

            got = rotate(rounds, {kind: functools.partial(enqueue, kind) for kind in ENQUEUE_SIDES})
            for kind, label in (
                ("psycopg", "enqueue, 1 row/transaction, psycopg connection"),
                ("library", "enqueue, 1 row/transaction, inside engine.begin()"),
            ):
                for floor, goal in (("physical", 0.8), ("same-table", 0.9)):
                    out.append(figure(label, procs, floor, got[floor], got[kind], goal=goal))
                    _show(out[-1])
            out.append(
                figure(
                    "  (same-table floor vs physical: the table's share)",
                    procs,
                    "physical",
                    got["physical"],
                    got["same-table"],
                )
            )
            out.append(
                figure(
                    "  (same-table INSERT inside engine.begin(): SQLAlchemy's share)",
                    procs,
                    "same-table",
                    got["same-table"],
                    got["sqlalchemy"],
                )
            )
            _show(out[-1])
        out.extend(many_and_noop(url, rounds, seconds, processes))
        target_base, stop_receiver, receiver_pid = start_plain_receiver_process(dsn(url))
        target = target_base + "/bench"
        for concurrency in (1, 8):
            busy: dict[str, list[float]] = {"library": [], "floor": [], "transport": []}

            def side(kind: str, c: int = concurrency, shares: dict[str, list[float]] = busy) -> Sample:
                sample, share = deliver(kind, url, target, deliver_rows, c, receiver_pid)
                shares[kind].append(share)
                return sample

            got = rotate(
                rounds,
                {
                    "library": lambda: side("library"),
                    "floor": lambda: side("floor"),
                    "transport": lambda: side("transport"),
                },
            )
            for floor_kind, floor_name, why in (
                (
                    "floor",
                    "httpx loop",
                    "the dispatcher sends a prebuilt request straight to httpx's transport; the httpx.Client "
                    "loop pays the Client's per-request URL, header, cookie and auth merging (the transport "
                    "row below is the minimal floor)",
                ),
                ("transport", "httpx transport loop", ""),
            ):
                note = (
                    f"receiver busy {statistics.median(busy['library']):.0%} / "
                    f"{statistics.median(busy[floor_kind]):.0%} of a core"
                )
                if max(busy[floor_kind] + busy["library"]) > 0.85:
                    note += " (receiver-bound: SUSPECT)"
                out.append(
                    figure(
                        f"delivery, 1 process, concurrency {concurrency}",
                        1,
                        floor_name,
                        got[floor_kind],
                        got["library"],
                        goal=0.8 if concurrency == 8 else None,
                        note=note,
                        faster_because=why,
                    )
                )
                _show(out[-1])
        stop_receiver()
        stop_receiver = _noop
        print(f"claim latency: filling {sent_rows:,} sent rows ...", flush=True)
        for u in urls:
            with psycopg.connect(dsn(u), autocommit=True) as conn:
                conn.execute("TRUNCATE joblease_outbox RESTART IDENTITY")
            _fill_pending(u, 1_000, "v2:due-")
        _fill_sent(urls[1], sent_rows)
        times = rotate(
            rounds,
            {"big": lambda: Sample(claim_ms(urls[1]), 0.0), "small": lambda: Sample(claim_ms(urls[0]), 0.0)},
        )
        out.append(
            figure(
                f"claim 100 of 1,000 due among {sent_rows:,} sent vs alone",
                1,
                "alone",
                times["small"],
                times["big"],
                unit="ms",
                goal=1.5,
                lower_is_better=True,
            )
        )
    finally:
        stop_receiver()
        drop()
    return out


def _noop() -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument(
        "--deliver-rows", type=int, default=None, help="rows per delivery round (default 500)"
    )
    parser.add_argument("--sent-rows", type=int, default=None, help="sent rows for the claim latency")
    args = parser.parse_args(argv)
    if args.long:
        args.seconds, args.rounds = max(args.seconds, 5.0), max(args.rounds, 7)
    started = time.perf_counter()
    figures = suite(
        server_url(),
        rounds=args.rounds,
        seconds=args.seconds,
        processes=[int(x) for x in args.processes.split(",")],
        deliver_rows=args.deliver_rows or (5_000 if args.long else 500),
        sent_rows=args.sent_rows or (1_000_000 if args.long else 200_000),
    )
    print_figures("outbox enqueue and delivery", figures, args.rounds, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
