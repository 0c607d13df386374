"""The reference receiver against the HTTP floor, the inbox middleware's own cost, and the async inbox
against the sync one, measured side by side in one run on a scratch database.

    .venv/bin/python benchmarks/receiver.py [--pg-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
                                            [--rounds 5] [--seconds 2] [--senders 1 4] [--requests 500]

1. Each sender process runs a bare ``httpx.Client`` keep-alive POST loop, a unique ``Idempotency-Key`` per
   POST, for ``--seconds``; posts/s is the sum over processes. Targets, on the same uvicorn (h11):

   * (a) the plain receiver (``benchmarks/plain_receiver.py``: a Starlette app doing one ``INSERT ... ON
     CONFLICT DO NOTHING`` per POST, autocommit) -- the floor;
   * (b) the reference receiver (``joblease receiver``, its own process): InboxMiddleware on an
     AsyncInbox, the effect row and the stored answer in one transaction.

   Rounds alternate (a, b, then b, a, ...) so drift on a shared machine hits both; the table shows min /
   median / max, the per-round ratio b / a (goal >= 0.85), ``SUSPECT`` flags and the machine's load
   (``benchmarks/harness.py``), and each receiver process's CPU per POST (the PostgreSQL backends' work is
   not in it).
2. The middleware's added latency per request, in-process (httpx's ASGI transport, no network): a bare
   Starlette app doing one INSERT per request against the same app under InboxMiddleware, on a first
   apply (a new key each request) and on a replay (one key repeated). Both additions are printed.
3. The AsyncInbox (psycopg pool) against the sync Inbox (64 threads) with 64 keys in flight at once.
4. The SQLite burst (``--burst``): the docs' FastAPI shop (sync Inbox on a SQLite file, sync endpoints) on
   uvicorn, N requests at once on distinct keys, N = 1x, 2x and 4x anyio's worker-thread limit (40):
   seconds from the first request to the last answer, and the answers' status counts. Printed rows.

Senders keep their connections alive, as the dispatcher does (and so does every sender here): before
issue 38 both receivers listened on a socket asyncio never set TCP_NODELAY on, and a kept-alive connection
answered ~21 requests/s on either, which the ratio hid.

The scratch database is dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import anyio
import httpx
import sqlalchemy as sa
import uvicorn
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import Figure, Sample, figure, print_figures, rotate  # noqa: E402
from benchmarks.plain_receiver import (  # noqa: E402
    CREATE_SQL,
    INSERT_SQL,
    libpq_conninfo,
    start_plain_receiver_process,
)
from dagster_joblease.inbox.aio import AsyncInbox  # noqa: E402
from dagster_joblease.inbox.asgi import InboxMiddleware, inbox_connection  # noqa: E402
from dagster_joblease.inbox.sync import Inbox  # noqa: E402
from dagster_joblease.receiver.server import listening_socket  # noqa: E402
from dagster_joblease.storage.engine import create_engine  # noqa: E402
from dagster_joblease.storage.migrate import migrate  # noqa: E402
from tests.inbox_app import build_sync_app, shop_metadata  # noqa: E402
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


# -- the middleware's own cost, in-process ----------------------------------------------------------------


def _middleware_latency(db_url: str, kind: str, requests: int) -> float:
    """Mean µs per request of an in-process Starlette app (httpx's ASGI transport, no network), one
    ``INSERT`` per new key: ``bare`` (no inbox, the INSERT autocommitted), ``apply`` (InboxMiddleware on an
    AsyncInbox, a new key each request, the INSERT through the inbox's transaction) or ``replay`` (the
    same app, one key repeated: the stored answer)."""
    conninfo = libpq_conninfo(db_url)
    tag = uuid.uuid4().hex[:8]

    async def run() -> float:
        pool = AsyncConnectionPool(conninfo, min_size=1, max_size=2, open=False)
        await pool.open()
        try:

            async def bare(request: Request) -> Response:
                await request.body()
                async with pool.connection() as conn:
                    await conn.execute(INSERT_SQL, (request.headers["idempotency-key"],))
                    await conn.commit()
                return PlainTextResponse("ok")

            async def through_inbox(request: Request) -> Response:
                await request.body()
                await inbox_connection(request).execute(INSERT_SQL, (request.headers["idempotency-key"],))
                return PlainTextResponse("ok")

            middleware = (
                [] if kind == "bare" else [Middleware(InboxMiddleware, inbox=AsyncInbox(pool.connection))]
            )
            app = Starlette(
                routes=[Route("/bench", bare if kind == "bare" else through_inbox, methods=["POST"])],
                middleware=middleware,
            )
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:

                async def post(i: int) -> None:
                    key = f"mw-{tag}-{kind}-" + ("same" if kind == "replay" else str(i))
                    answer = await client.post("/bench", content=BODY, headers={"Idempotency-Key": key})
                    assert answer.status_code == 200, answer.text

                for i in range(-20, 0):  # warm up (and store the replayed key)
                    await post(i)
                started = time.perf_counter()
                for i in range(requests):
                    await post(i)
                return (time.perf_counter() - started) / requests * 1e6
        finally:
            await pool.close()

    return anyio.run(run)


def middleware_figures(db_url: str, *, rounds: int, requests: int) -> list[Figure]:
    """The middleware's added latency on a first apply and on a replay, beside the bare app (info rows)."""

    def side(kind: str) -> Sample:
        return Sample(_middleware_latency(db_url, kind, requests), 0.0)

    got = rotate(rounds, {kind: functools.partial(side, kind) for kind in ("bare", "apply", "replay")})
    for bare, apply, replay in zip(got["bare"], got["apply"], got["replay"], strict=True):
        print(
            f"  middleware: bare {bare.rate:6.0f} us  first apply {apply.rate:6.0f} us"
            f" (+{apply.rate - bare.rate:.0f})  replay {replay.rate:6.0f} us"
            f" (+{replay.rate - bare.rate:.0f})",
            flush=True,
        )
    added = {
        k: statistics.median(v.rate - b.rate for v, b in zip(got[k], got["bare"], strict=True))
        for k in ("apply", "replay")
    }
    return [
        figure(
            f"InboxMiddleware, {what} (in-process, one INSERT per new key)",
            "1 conn",
            "bare app",
            got["bare"],
            got[kind],
            unit="us",
            lower_is_better=True,
            note=f"adds {added[kind]:.0f} us per request (median of the rounds)",
        )
        for kind, what in (("apply", "first apply"), ("replay", "replay"))
    ]


# -- the async inbox against the sync one -------------------------------------------------------------------

CONCURRENT_KEYS = 64


def _async_keys_per_s(db_url: str, seconds: float, keys: int = CONCURRENT_KEYS) -> float:
    """Keys/s processed by an AsyncInbox (a psycopg pool of ``keys``) with ``keys`` keys in flight at once."""
    conninfo = libpq_conninfo(db_url)
    tag = uuid.uuid4().hex[:8]

    async def run() -> float:
        pool = AsyncConnectionPool(conninfo, min_size=keys, max_size=keys, open=False)
        await pool.open(wait=True)
        inbox = AsyncInbox(pool.connection)
        done = 0

        async def effect(conn: Any) -> tuple[int, str]:
            return 200, "{}"

        async def worker(w: int, deadline: float) -> None:
            nonlocal done
            n = 0
            while time.perf_counter() < deadline:
                await inbox.process(f"a-{tag}-{w}-{n}", BODY, effect)
                n += 1
                done += 1

        try:
            deadline = time.perf_counter() + seconds
            started = time.perf_counter()
            async with anyio.create_task_group() as group:
                for w in range(keys):
                    group.start_soon(worker, w, deadline)
            return done / (time.perf_counter() - started)
        finally:
            await pool.close()

    return anyio.run(run)


def _sync_keys_per_s(db_url: str, seconds: float, keys: int = CONCURRENT_KEYS) -> float:
    """Keys/s processed by the sync Inbox (an engine pool of ``keys``) from ``keys`` threads at once."""
    engine = create_engine(db_url, pool_size=keys, max_overflow=0)
    inbox = Inbox(engine)
    tag = uuid.uuid4().hex[:8]
    counts = [0] * keys
    deadline = time.perf_counter() + seconds

    def worker(w: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            inbox.process(f"s-{tag}-{w}-{n}", BODY, lambda conn: (200, "{}"))
            n += 1
        counts[w] = n

    try:
        started = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(keys)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - started)
    finally:
        engine.dispose()


def inbox_figure(db_url: str, *, rounds: int, seconds: float) -> Figure:
    sides = {
        "sync": lambda: Sample(_sync_keys_per_s(db_url, seconds), 0.0),
        "async": lambda: Sample(_async_keys_per_s(db_url, seconds), 0.0),
    }
    got = rotate(rounds, sides)
    for sync, async_ in zip(got["sync"], got["async"], strict=True):
        print(
            f"  {CONCURRENT_KEYS} keys at once: sync Inbox {sync.rate:6.0f} keys/s"
            f"  AsyncInbox {async_.rate:6.0f} keys/s"
        )
    return figure(
        f"AsyncInbox vs sync Inbox, {CONCURRENT_KEYS} keys in flight",
        f"{CONCURRENT_KEYS} keys",
        "sync Inbox (threads)",
        got["sync"],
        got["async"],
        note="keys/s, the effect empty: the inbox's own statements",
        faster_because="one event loop instead of 64 threads contending for the GIL",
    )


# -- the SQLite burst ---------------------------------------------------------------------------------------

#: anyio's default worker-thread limit (what FastAPI's sync endpoints and the sync inbox share).
THREADS = 40


def sqlite_burst(size: int) -> tuple[float, dict[int, int]]:
    """Seconds for ``size`` requests at once on distinct keys to the docs' shop on SQLite, served by
    uvicorn in a thread, and how many got each status (a connection error counts as status 0)."""

    folder = tempfile.mkdtemp(prefix="joblease-burst-")
    engine = create_engine(f"sqlite:///{folder}/shop.sqlite")
    migrate(engine)
    shop_metadata.create_all(engine)
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(
        uvicorn.Config(build_sync_app(Inbox(engine)), lifespan="off", log_config=None, access_log=False)
    )
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = "http://{}:{}/orders".format(*sock.getsockname()[:2])

    async def burst() -> tuple[float, dict[int, int]]:
        statuses: collections.Counter[int] = collections.Counter()
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:

            async def one(n: int) -> None:
                try:
                    answer = await client.post(
                        url, json={"order_id": n, "amount": 1}, headers={"Idempotency-Key": f"burst-{n}"}
                    )
                    statuses[answer.status_code] += 1
                except httpx.HTTPError:
                    statuses[0] += 1

            started = time.perf_counter()
            async with anyio.create_task_group() as group:
                for n in range(size):
                    group.start_soon(one, n)
            return time.perf_counter() - started, dict(sorted(statuses.items()))

    try:
        return anyio.run(burst)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        engine.dispose()
        shutil.rmtree(folder, ignore_errors=True)


def burst_rows() -> None:
    """The SQLite burst at 1x, 2x and 4x the worker-thread limit (printed)."""
    for times in (1, 2, 4):
        seconds, statuses = sqlite_burst(THREADS * times)
        print(
            f"  SQLite burst {THREADS * times:4d} requests ({times}x the {THREADS} worker threads): "
            f"{seconds:6.2f} s  statuses {statuses}",
            flush=True,
        )


def _admin(url: str, sql: str) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()


def suite(
    pg_url: str, *, rounds: int, seconds: float, senders: list[int], requests: int = 500
) -> list[Figure]:
    """The reference receiver against the plain one (``rounds`` alternating rounds per sender count), the
    middleware's added latency, and the async inbox against the sync one."""
    admin = sa.make_url(pg_url).set(drivername="postgresql+psycopg")
    name = f"joblease_bench_recv_{uuid.uuid4().hex[:8]}"
    _admin(admin.render_as_string(hide_password=False), f'CREATE DATABASE "{name}"')
    db_url = admin.set(database=name).render_as_string(hide_password=False)
    engine = create_engine(db_url)
    migrate(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(CREATE_SQL)
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
    finally:
        reference.stop()
        stop_plain()
    try:
        extra = middleware_figures(db_url, rounds=rounds, requests=requests)
        extra.append(inbox_figure(db_url, rounds=rounds, seconds=seconds))
    finally:
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
    ] + extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="maintenance db URL")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=500, help="requests per round of the middleware rows")
    parser.add_argument("--burst", action="store_true", help="also the SQLite burst (printed rows)")
    parser.add_argument("--burst-only", action="store_true", help="only the SQLite burst")
    args = parser.parse_args()
    if args.burst or args.burst_only:
        burst_rows()
        if args.burst_only:
            return 0
    started = time.perf_counter()
    figures = suite(
        args.pg_url, rounds=args.rounds, seconds=args.seconds, senders=args.senders, requests=args.requests
    )
    print_figures("reference receiver", figures, args.rounds, started)
    return 0 if all(f.ratio.median >= GOAL for f in figures if f.goal is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
