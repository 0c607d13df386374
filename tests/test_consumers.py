"""The consumer helpers against the real brokers: rows the dispatcher published are applied once each
through the inbox, however often the broker delivers them (a redelivery after a commit whose ack was
lost, a handler that failed once, RabbitMQ's second copy of an unconfirmed publish), and acked only after
the effect committed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("nats", reason="the nats extra is not installed")
pytest.importorskip("aio_pika", reason="the rabbitmq extra is not installed")

import aio_pika
import nats
from nats.js.api import AckPolicy, ConsumerConfig
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from dagster_joblease import errors
from dagster_joblease.consumers import Delivery, Settle, settle_after
from dagster_joblease.consumers.core import handle
from dagster_joblease.consumers.jetstream import JetStreamConsumer
from dagster_joblease.consumers.rabbitmq import RabbitMQConsumer
from dagster_joblease.dispatch import Dispatcher
from dagster_joblease.inbox import AsyncInbox, Inbox
from tests.brokers import drain, enqueue, proxy_to
from tests.conftest import wait_until
from tests.test_jetstream import Stream, nats_url, stream
from tests.test_rabbitmq import Exchange, amqp_url, exchange

__all__ = ["amqp_url", "exchange", "nats_url", "stream"]  # fixtures used here

FAST = {"backoff_base_ms": 10, "backoff_max_ms": 50}
EFFECTS = sa.table("effects", sa.column("key", sa.String()), sa.column("n", sa.Integer()))


@pytest.mark.parametrize(
    ("error", "settled"),
    [
        (None, Settle.ACK),
        (RuntimeError("effect failed"), Settle.RETRY),
        (errors.InboxInProgressError(idempotency_key="k"), Settle.RETRY),
        (errors.StorageError("database down"), Settle.RETRY),
        (errors.InboxConflictError(idempotency_key="k"), Settle.REJECT),
        (errors.InvalidInboxInputError("idempotency key", "none"), Settle.REJECT),
    ],
)
def test_how_a_message_is_settled(error: BaseException | None, settled: Settle) -> None:
    assert settle_after(error) is settled


def _effects_table(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key TEXT, n INTEGER)"))


def _effects(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT key, count(*) FROM effects GROUP BY key"))
        return {k: int(n) for k, n in rows}


class Effects:
    """An async handler writing one effect row per run, failing the first run of keys in ``fail_once``."""

    def __init__(self, fail_once: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.fail_once = set(fail_once)
        self.runs: list[str] = []

    async def __call__(self, conn: AsyncConnection, delivery: Delivery) -> tuple[int, str]:
        self.runs.append(delivery.key)
        await conn.execute(EFFECTS.insert().values(key=delivery.key, n=1))
        if delivery.key in self.fail_once:
            self.fail_once.discard(delivery.key)
            raise RuntimeError(f"the first run of {delivery.key} fails")
        return 201, delivery.payload.decode()


@pytest.fixture
def async_url(pg_url: str) -> str:
    return sa.make_url(pg_url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def test_jetstream_consumer_applies_each_message_once_under_redelivery(
    pg_engine: sa.Engine, async_url: str, stream: Stream
) -> None:
    keys = enqueue(pg_engine, 10)
    with Dispatcher(pg_engine, {"events": stream.route(stream.url)}, concurrency=4, **FAST) as dispatcher:
        drain(dispatcher, pg_engine)
    _effects_table(pg_engine)
    handler = Effects(fail_once={keys[3]})
    lost_ack = keys[5]  # its effect commits, then the consumer "dies" before the ack

    async def consume() -> list[Any]:
        engine = create_async_engine(async_url, poolclass=sa.pool.NullPool)
        nc = await nats.connect(stream.url)
        try:
            js = nc.jetstream()
            config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=1.0)
            sub = await js.pull_subscribe(
                f"{stream.prefix}.>", durable="c", stream=stream.name, config=config
            )
            consumer = JetStreamConsumer(AsyncInbox(engine), handler, retry_delay_s=0.05)
            seen: list[Any] = []
            acked: set[str] = set()
            deadline = time.monotonic() + 30
            while acked != set(keys) and time.monotonic() < deadline:
                try:
                    batch = await sub.fetch(10, timeout=0.5)
                except TimeoutError:  # nats-py raises its own, or under load a bare asyncio one
                    continue
                for msg in batch:
                    key = msg.headers["Nats-Msg-Id"]
                    if key == lost_ack and key not in handler.runs:
                        outcome = await handle(
                            consumer.inbox, Delivery(key, msg.subject, msg.data, {}, False), handler
                        )
                        assert (
                            outcome.settled is Settle.ACK
                        )  # committed; no ack sent: redelivered after ack_wait
                        continue
                    handled = await consumer(msg)
                    seen.append(
                        (
                            key,
                            handled.settled,
                            handled.result and handled.result.replayed,
                            msg.metadata.num_delivered,
                        )
                    )
                    if handled.settled is Settle.ACK:
                        acked.add(key)
            return seen
        finally:
            await nc.close()
            await engine.dispose()

    seen = asyncio.run(consume())
    assert _effects(pg_engine) == dict.fromkeys(keys, 1)  # once each, the failed run rolled back
    assert (keys[3], Settle.RETRY, None, 1) in seen
    assert (keys[3], Settle.ACK, False, 2) in seen
    assert (lost_ack, Settle.ACK, True, 2) in seen  # redelivered after its commit: replayed, handler not run
    assert handler.runs.count(lost_ack) == 1


def test_rabbitmq_consumer_applies_each_key_once_across_copies_and_redelivery(
    pg_engine: sa.Engine, async_url: str, exchange: Exchange
) -> None:
    keys = enqueue(pg_engine, 6)
    with proxy_to(exchange.url) as proxy:
        route = exchange.route(proxy.url + "/", timeout_s=1.0)
        with Dispatcher(pg_engine, {"events": route}, concurrency=3, **FAST) as dispatcher:
            proxy.stall()  # queued, unconfirmed: each is published again, a second copy
            dispatcher.dispatch()
            wait_until(lambda: exchange.count() == 6)
            proxy.unstall()
            drain(dispatcher, pg_engine)
    assert exchange.count() == 12
    _effects_table(pg_engine)
    handler = Effects(fail_once={keys[2]})

    async def consume() -> list[Any]:
        engine = create_async_engine(async_url, poolclass=sa.pool.NullPool)
        connection = await aio_pika.connect(exchange.url)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(exchange.queue, passive=True)
            consumer = RabbitMQConsumer(AsyncInbox(engine), handler, retry_delay_s=0.05)
            seen: list[Any] = []
            while (message := await queue.get(fail=False)) is not None:
                handled = await consumer(message)
                seen.append((message.message_id, handled.settled, handled.result and handled.result.replayed))
            return seen
        finally:
            await connection.close()
            await engine.dispose()

    seen = asyncio.run(consume())
    assert _effects(pg_engine) == dict.fromkeys(keys, 1)
    assert exchange.count() == 0  # every copy acked (the failed one requeued, then applied)
    assert (keys[2], Settle.RETRY, None) in seen
    assert sum(1 for k, s, _ in seen if s is Settle.ACK) == 12
    assert sorted(k for k, s, replayed in seen if s is Settle.ACK and not replayed) == keys


def test_a_sync_inbox_runs_a_plain_handler(sqlite_url: str, exchange: Exchange) -> None:
    engine = sa.create_engine(sqlite_url)
    _effects_table(engine)

    def handler(conn: sa.Connection, delivery: Delivery) -> None:
        conn.execute(EFFECTS.insert().values(key=delivery.key, n=1))

    async def run() -> list[Any]:
        connection = await aio_pika.connect(exchange.url)
        try:
            channel = await connection.channel()
            x = await channel.get_exchange(exchange.name)
            for _ in range(2):
                await x.publish(aio_pika.Message(b"{}", message_id="v2:a"), "events")
            queue = await channel.declare_queue(exchange.queue, passive=True)
            consumer = RabbitMQConsumer(Inbox(engine), handler)
            handled = []
            while (message := await queue.get(fail=False)) is not None:
                outcome = await consumer(message)
                handled.append((outcome.settled, outcome.result and outcome.result.replayed))
            return handled
        finally:
            await connection.close()

    try:
        assert asyncio.run(run()) == [(Settle.ACK, False), (Settle.ACK, True)]
        assert _effects(engine) == {"v2:a": 1}
        assert exchange.count() == 0
    finally:
        engine.dispose()


def test_a_jetstream_message_without_msg_id_is_terminated_not_applied(
    sqlite_url: str, stream: Stream
) -> None:
    engine = sa.create_engine(sqlite_url)
    runs: list[str] = []

    async def run() -> list[Settle]:
        nc = await nats.connect(stream.url)
        try:
            await nc.publish(f"{stream.prefix}.x", b"{}")  # stored without a Nats-Msg-Id
            js = nc.jetstream()
            config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=1.0)
            sub = await js.pull_subscribe(
                f"{stream.prefix}.>", durable="k", stream=stream.name, config=config
            )
            consumer = JetStreamConsumer(Inbox(engine), lambda conn, d: runs.append(d.key))
            settled = [(await consumer(msg)).settled for msg in await sub.fetch(1, timeout=5)]
            with pytest.raises(nats.errors.TimeoutError):
                await sub.fetch(1, timeout=2)  # terminated: never redelivered
            return settled
        finally:
            await nc.close()

    try:
        assert asyncio.run(run()) == [Settle.REJECT]
        assert runs == []
    finally:
        engine.dispose()
