"""Rows per second into NATS JetStream and RabbitMQ, and enqueue-to-consumer latency (issue 37, Measure).

    .venv/bin/python benchmarks/brokers.py [--rows 3000] [--rounds 3] [--processes 1,4] [--concurrency 8]
        [--transports jetstream,rabbitmq] [--rate 100] [--latency-seconds 10] [--poll-s 0.05]

The PostgreSQL server comes from ``JOBLEASE_BENCH_PG_URL`` (default ``postgresql+psycopg://postgres@
127.0.0.1:5432/postgres``; a scratch database is created and dropped), NATS from ``JOBLEASE_TEST_NATS_URL``
(default ``nats://127.0.0.1:4222``), RabbitMQ from ``JOBLEASE_TEST_AMQP_URL`` (default
``amqp://127.0.0.1:5672/``); the benchmark makes a stream, or an exchange and a queue, of its own and removes
them at the end.

**Throughput.** Each round runs two sides per process count, in alternating order, on the same broker
objects (emptied between runs):

* ``dispatcher``: ``--rows`` PENDING rows are enqueued (untimed), then N dispatcher processes (the
  library's ``Dispatcher``, concurrency ``--concurrency``) are started, connect, and wait at a barrier; the
  figure is rows / (the last process's end - the barrier's release), each process dispatching until no row
  is left.
* ``bare client``: N processes publish the same messages (the same subject or routing key, payload,
  ``Nats-Msg-Id`` / ``message_id`` and, for RabbitMQ, ``mandatory`` and persistence) with the same
  acknowledgement awaited (a JetStream publish ack with ``Nats-Expected-Stream``; a publisher confirm),
  ``--concurrency`` publishes in flight per process on one connection, timed the same way. No database.

* ``transport alone``: the same messages sent through the library's transport (``open_transports``), by
  ``--concurrency`` threads per process as the dispatcher's delivery threads call it, no database: how much
  of the gap is the hand-off between delivery threads and the transport's event loop.

Each round runs the three sides, the order rotated by one each round. The ratio is per round
(dispatcher / bare client of the same round); the goal is >= 0.8.

**Latency.** One producer thread enqueues a row every 1/``--rate`` s for ``--latency-seconds`` (its own
transaction each, the payload carrying ``time.time()``); one dispatcher process runs ``Dispatcher.run`` with
``poll_interval_s=--poll-s``; one consumer process subscribed to the stream or queue notes each message's
arrival. Printed: p50 and p99 of arrival - enqueue, in ms. The machine may be shared: quote figures with
the load average printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.limits import DEFAULT_PG, PG_ENV, reset
from dagster_joblease import outbox
from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.dispatch.transports import NO_HEADERS, OutboxMessage, open_transports
from dagster_joblease.storage import create_engine, migrate

CTX = multiprocessing.get_context("fork")
NATS_URL = os.environ.get("JOBLEASE_TEST_NATS_URL", "nats://127.0.0.1:4222")
AMQP_URL = os.environ.get("JOBLEASE_TEST_AMQP_URL", "amqp://127.0.0.1:5672/")
TOPIC = "bench"
GOAL = 0.8


class Target:
    """One broker's objects of this run: where rows go, how to empty them, a route to them, a bare
    publisher of the same messages, and a consumer for the latency run."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.tag = uuid.uuid4().hex[:8]
        self.stream = f"JLBENCH{self.tag}".upper()
        self.subject = f"jlbench{self.tag}.rows"
        self.exchange = f"jl-bench-x-{self.tag}"
        self.queue = f"jl-bench-q-{self.tag}"

    def route(self) -> Route:
        if self.transport == "jetstream":
            return Route(NATS_URL, subject=self.subject, stream=self.stream, dedupe_window=60, timeout_s=5)
        return Route(AMQP_URL, exchange=self.exchange, routing_key="rows", timeout_s=5)

    def create(self) -> None:
        asyncio.run(self._admin("create"))

    def empty(self) -> None:
        asyncio.run(self._admin("empty"))

    def remove(self) -> None:
        asyncio.run(self._admin("remove"))

    async def _admin(self, what: str) -> None:
        if self.transport == "jetstream":
            import nats

            nc = await nats.connect(NATS_URL)
            js = nc.jetstream()
            if what == "create":
                await js.add_stream(name=self.stream, subjects=[f"jlbench{self.tag}.>"], duplicate_window=120)
            elif what == "empty":
                await js.purge_stream(self.stream)
            else:
                await js.delete_stream(self.stream)
            await nc.close()
            return
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL)
        channel = await connection.channel()
        if what == "create":
            exchange = await channel.declare_exchange(self.exchange, aio_pika.ExchangeType.DIRECT)
            queue = await channel.declare_queue(self.queue, durable=True)
            await queue.bind(exchange, "rows")
        elif what == "empty":
            await (await channel.get_queue(self.queue)).purge()
        else:
            await channel.exchange_delete(self.exchange)
            await channel.queue_delete(self.queue)
        await connection.close()

    async def publish_all(self, messages: list[tuple[str, bytes]], concurrency: int) -> None:
        """The bare client: publish ``messages`` (key, payload) with ``concurrency`` in flight."""
        todo = list(reversed(messages))
        if self.transport == "jetstream":
            import nats

            nc = await nats.connect(NATS_URL)
            js = nc.jetstream()

            async def worker() -> None:
                while todo:
                    key, payload = todo.pop()
                    await js.publish(
                        self.subject, payload, timeout=5, stream=self.stream, headers={"Nats-Msg-Id": key}
                    )

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            await nc.close()
            return
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(self.exchange)

        async def amqp_worker() -> None:
            while todo:
                key, payload = todo.pop()
                message = aio_pika.Message(
                    payload,
                    message_id=key,
                    headers={},
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                )
                await exchange.publish(message, "rows", mandatory=True, timeout=5)

        await asyncio.gather(*(amqp_worker() for _ in range(concurrency)))
        await connection.close()

    async def consume(self, count: int, arrivals: Any) -> None:
        """Note each message's arrival time and its enqueue time, until ``count`` arrived."""
        seen: list[tuple[float, float]] = []
        done = asyncio.Event()

        def note(body: bytes) -> None:
            seen.append((time.time(), json.loads(body)["t"]))
            if len(seen) >= count:
                done.set()

        if self.transport == "jetstream":
            import nats

            nc = await nats.connect(NATS_URL)

            async def on_msg(msg: Any) -> None:
                note(msg.data)

            await nc.jetstream().subscribe(self.subject, stream=self.stream, cb=on_msg, ordered_consumer=True)
            arrivals.put("ready")
            await done.wait()
            await nc.close()
        else:
            import aio_pika

            connection = await aio_pika.connect(AMQP_URL)
            channel = await connection.channel()
            queue = await channel.get_queue(self.queue)

            async def on_message(message: Any) -> None:
                note(message.body)

            await queue.consume(on_message, no_ack=True)
            arrivals.put("ready")
            await done.wait()
            await connection.close()
        arrivals.put(seen)


def _payload(n: int, t: float | None = None) -> dict[str, Any]:
    return {"v": 1, "n": n, "pad": "x" * 64} if t is None else {"t": t, "n": n}


# -- throughput ---------------------------------------------------------------------------------------


def _dispatcher_proc(url: str, target: Target, concurrency: int, barrier: Any, ends: Any) -> None:
    engine = create_engine(url)
    dispatcher = Dispatcher(engine, {TOPIC: target.route()}, concurrency=concurrency, backoff_base_ms=10)
    with dispatcher:
        barrier.wait()
        while True:
            if dispatcher.dispatch(limit=200).claimed == 0:
                with engine.connect() as conn:
                    left = conn.execute(
                        sa.text("SELECT count(*) FROM joblease_outbox WHERE status = 'PENDING'")
                    ).scalar_one()
                if not left:
                    break
                time.sleep(0.005)
    ends.put(time.monotonic())
    engine.dispose()


def _bare_proc(
    target: Target, share: list[tuple[str, bytes]], concurrency: int, barrier: Any, ends: Any
) -> None:
    async def run() -> None:
        # Connect first (as the dispatcher does at start), then wait at the barrier like it.
        await asyncio.to_thread(barrier.wait)
        await target.publish_all(share, concurrency)

    asyncio.run(run())
    ends.put(time.monotonic())


def _threads_proc(
    target: Target, share: list[tuple[str, bytes]], concurrency: int, barrier: Any, ends: Any
) -> None:
    route = target.route()
    transport = open_transports({TOPIC: route}, {TOPIC: {}}, concurrency, None)[TOPIC]
    messages = [OutboxMessage(key, TOPIC, None, payload, NO_HEADERS) for key, payload in share]
    barrier.wait()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda m: transport.send(m, route, time.monotonic() + 5, None), messages))
    ends.put(time.monotonic())
    transport.close()


def _timed(procs: list[Any], barrier: Any, ends: Any) -> float:
    for proc in procs:
        proc.start()
    barrier.wait()
    start = time.monotonic()
    last = max(ends.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(60)
    return last - start


def dispatcher_side(url: str, engine: sa.Engine, target: Target, rows: int, procs: int, conc: int) -> float:
    reset(engine)
    target.empty()
    prefix = uuid.uuid4().hex[:8]
    items = [outbox.OutboxItem(f"v2:{prefix}-{i:06d}", TOPIC, _payload(i)) for i in range(rows)]
    with engine.begin() as conn:
        outbox.enqueue_many(conn, items)
        conn.exec_driver_sql("ANALYZE joblease_outbox")
    barrier, ends = CTX.Barrier(procs + 1), CTX.Queue()
    span = _timed(
        [CTX.Process(target=_dispatcher_proc, args=(url, target, conc, barrier, ends)) for _ in range(procs)],
        barrier,
        ends,
    )
    with engine.connect() as conn:
        sent = conn.execute(
            sa.text("SELECT count(*) FROM joblease_outbox WHERE status = 'SENT'")
        ).scalar_one()
    assert sent == rows, f"{sent} of {rows} rows SENT"
    return rows / span


def bare_side(target: Target, rows: int, procs: int, conc: int, threads: bool = False) -> float:
    """The bare client (``threads``: the library's transport alone, driven by ``conc`` threads as the
    dispatcher's delivery threads drive it, no database)."""
    target.empty()
    prefix = uuid.uuid4().hex[:8]
    messages = [(f"v2:{prefix}-{i:06d}", json.dumps(_payload(i)).encode()) for i in range(rows)]
    barrier, ends = CTX.Barrier(procs + 1), CTX.Queue()
    shares = [messages[p::procs] for p in range(procs)]
    span = _timed(
        [
            CTX.Process(
                target=_threads_proc if threads else _bare_proc, args=(target, share, conc, barrier, ends)
            )
            for share in shares
        ],
        barrier,
        ends,
    )
    return rows / span


# -- latency ------------------------------------------------------------------------------------------


def _run_dispatcher(url: str, target: Target, poll_s: float, stop: Any) -> None:
    engine = create_engine(url)
    with Dispatcher(engine, {TOPIC: target.route()}, concurrency=8) as dispatcher:
        stop_event = threading.Event()
        threading.Thread(target=lambda: (stop.wait(), stop_event.set()), daemon=True).start()
        dispatcher.run(poll_interval_s=poll_s, stop=stop_event)
    engine.dispose()


def _consume(target: Target, count: int, arrivals: Any) -> None:
    asyncio.run(target.consume(count, arrivals))


def latency(
    url: str, engine: sa.Engine, target: Target, rate: float, seconds: float, poll_s: float
) -> list[float]:
    reset(engine)
    target.empty()
    count = int(rate * seconds)
    arrivals, stop = CTX.Queue(), CTX.Event()
    consumer = CTX.Process(target=_consume, args=(target, count, arrivals))
    consumer.start()
    assert arrivals.get(timeout=60) == "ready"
    dispatcher = CTX.Process(target=_run_dispatcher, args=(url, target, poll_s, stop))
    dispatcher.start()
    time.sleep(2.0)  # the dispatcher connected and idles
    prefix = uuid.uuid4().hex[:8]
    began = time.monotonic()
    for i in range(count):
        wait = began + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        with engine.begin() as conn:
            outbox.enqueue_once(
                conn, idempotency_key=f"v2:{prefix}-{i:06d}", topic=TOPIC, payload=_payload(i, time.time())
            )
    seen = arrivals.get(timeout=120)
    stop.set()
    dispatcher.join(60)
    consumer.join(30)
    return sorted((arrived - enqueued) * 1000 for arrived, enqueued in seen)


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", default="1,4")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--transports", default="jetstream,rabbitmq")
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--poll-s", type=float, default=0.05)
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()
    admin = sa.engine.make_url(os.environ.get(PG_ENV, DEFAULT_PG))
    name = f"joblease_bench_brokers_{uuid.uuid4().hex[:8]}"
    admin_engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin.set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url)
    print(f"load average before: {os.getloadavg()}; {os.cpu_count()} CPUs", flush=True)
    try:
        migrate(engine)
        for transport in args.transports.split(","):
            target = Target(transport)
            target.create()
            try:
                for procs in (int(p) for p in args.processes.split(",")):
                    _throughput(url, engine, target, procs, args)
                if not args.skip_latency:
                    got = latency(url, engine, target, args.rate, args.latency_seconds, args.poll_s)
                    print(
                        f"{transport}: enqueue-to-consumer at {args.rate:g} rows/s offered, poll "
                        f"{args.poll_s} s: p50 {_pct(got, 50):.1f} ms, p99 {_pct(got, 99):.1f} ms, "
                        f"max {got[-1]:.1f} ms "
                        f"({len(got)} rows); load average {os.getloadavg()}",
                        flush=True,
                    )
            finally:
                target.remove()
    finally:
        engine.dispose()
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin_engine.dispose()
    print(f"load average after: {os.getloadavg()}")


def _throughput(url: str, engine: sa.Engine, target: Target, procs: int, args: argparse.Namespace) -> None:
    sides: dict[str, Callable[[], float]] = {
        "dispatcher": lambda: dispatcher_side(url, engine, target, args.rows, procs, args.concurrency),
        "bare client": lambda: bare_side(target, args.rows, procs, args.concurrency),
        "transport alone": lambda: bare_side(target, args.rows, procs, args.concurrency, threads=True),
    }
    got: dict[str, list[float]] = {side: [] for side in sides}
    for round_no in range(args.rounds):
        names = list(sides)
        for side in names[round_no % 3 :] + names[: round_no % 3]:
            got[side].append(sides[side]())
        print(
            f"  {target.transport} x{procs} round {round_no + 1}: dispatcher "
            f"{got['dispatcher'][-1]:,.0f} rows/s, bare client {got['bare client'][-1]:,.0f} /s, transport "
            f"alone {got['transport alone'][-1]:,.0f} /s",
            flush=True,
        )
    ratios = [d / b for d, b in zip(got["dispatcher"], got["bare client"], strict=True)]
    med = {side: statistics.median(values) for side, values in got.items()}
    verdict = "OK" if statistics.median(ratios) >= GOAL else "BELOW"
    alone = [a / b for a, b in zip(got["transport alone"], got["bare client"], strict=True)]
    d, b = got["dispatcher"], got["bare client"]
    print(
        f"{target.transport}, {procs} process(es) x concurrency {args.concurrency}, {args.rows} rows: "
        f"dispatcher {med['dispatcher']:,.0f} ({min(d):,.0f}-{max(d):,.0f}) rows/s, bare client "
        f"{med['bare client']:,.0f} ({min(b):,.0f}-{max(b):,.0f}) /s, ratio {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}) >= {GOAL} {verdict}; the transport alone (threads, no "
        f"database) {statistics.median(alone):.2f} ({min(alone):.2f}-{max(alone):.2f}) of the bare client; "
        f"load average {os.getloadavg()}",
        flush=True,
    )


if __name__ == "__main__":
    main()
