"""Trace context on every outbox row (dagster_joblease.tracing), with OpenTelemetry's SDK and its in-memory
exporter: the create span's context written by the enqueue's INSERT, the dispatcher's send span linked to
it and the context in the request's headers, the inbox's process span continuing it, time in the outbox.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
import uvicorn
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route as Path

from dagster_joblease import tracing
from dagster_joblease.dagster.ops import LeasedRun, leased_op
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dispatch.dispatcher import Dispatcher
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.errors import OutboxConflictError
from dagster_joblease.inbox.asgi import InboxMiddleware, inbox_connection
from dagster_joblease.inbox.sync import Inbox
from dagster_joblease.outbox import OutboxItem, enqueue_many, enqueue_once
from dagster_joblease.storage.engine import create_engine
from dagster_joblease.storage.migrate import migrate
from dagster_joblease.storage.schema import outbox_table
from tests.brokers import AMQP_URL_ENV, DEFAULT_AMQP_URL, DEFAULT_NATS_URL, NATS_URL_ENV, broker_url

_SPANS = InMemorySpanExporter()
_METRICS = InMemoryMetricReader()


@pytest.fixture(scope="module", autouse=True)
def _providers() -> None:
    """The SDK's providers, set once per process (OpenTelemetry refuses a second global provider)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(_SPANS))
    if not isinstance(metrics.get_meter_provider(), MeterProvider):
        metrics.set_meter_provider(MeterProvider(metric_readers=[_METRICS]))


@pytest.fixture(autouse=True)
def _fresh_spans() -> None:
    _SPANS.clear()


def _tracer() -> trace.Tracer:
    return trace.get_tracer("tests.test_tracing")


def _row_trace(engine: sa.Engine, key: str) -> tuple[str | None, str | None]:
    t = outbox_table
    with engine.connect() as conn:
        row = conn.execute(sa.select(t.c.traceparent, t.c.tracestate).where(t.c.idempotency_key == key)).one()
    return row[0], row[1]


def _spans(name: str) -> list[ReadableSpan]:
    return [s for s in _SPANS.get_finished_spans() if s.name == name]


def _traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


# -- the columns: written by the enqueue's INSERT -------------------------------------------------------


def test_an_enqueue_inside_a_span_stores_its_create_spans_context(engine: sa.Engine) -> None:
    with _tracer().start_as_current_span("domain change") as parent, engine.begin() as conn:
        assert enqueue_once(conn, idempotency_key="k1", topic="mail", payload={"v": 1})
    (create,) = _spans("create mail")
    assert create.kind is trace.SpanKind.PRODUCER
    assert create.parent is not None and create.parent.span_id == parent.get_span_context().span_id
    assert dict(create.attributes or {}) == {
        "messaging.system": "joblease",
        "messaging.operation.type": "create",
        "messaging.operation.name": "create",
        "messaging.destination.name": "mail",
        "messaging.message.id": "k1",
    }
    assert _row_trace(engine, "k1") == (_traceparent_of(create), None)


def test_a_tracestate_no_header_can_carry_is_not_stored_and_the_row_is(engine: sa.Engine) -> None:
    """A row's only headers are its trace context, checked where it is captured: a tracestate past the
    column's 512 characters (W3C lets a hop drop it) is left out, the row and its traceparent are kept."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    long_state = TraceState([(f"v{i}", "x" * 200) for i in range(8)])  # valid, 1,638 characters as a header
    remote = SpanContext(0x1F, 0x2F, is_remote=True, trace_flags=TraceFlags(1), trace_state=long_state)
    short_state = TraceState([("vendor", "a")])
    remote_short = SpanContext(0x1F, 0x3F, is_remote=True, trace_flags=TraceFlags(1), trace_state=short_state)
    with trace.use_span(NonRecordingSpan(remote)), engine.begin() as conn:
        assert enqueue_once(conn, idempotency_key="long", topic="mail", payload={})
        assert enqueue_many(conn, [OutboxItem("long-set", "mail", {})]) == (True,)
    with trace.use_span(NonRecordingSpan(remote_short)), engine.begin() as conn:
        assert enqueue_once(conn, idempotency_key="short", topic="mail", payload={})
    by_key = {(s.attributes or {})["messaging.message.id"]: s for s in _spans("create mail")}
    for key in ("long", "long-set"):
        assert by_key[key].context.trace_state.to_header() == long_state.to_header()  # the span keeps it
        assert _row_trace(engine, key) == (_traceparent_of(by_key[key]), None)
    assert _row_trace(engine, "short") == (_traceparent_of(by_key["short"]), "vendor=a")


def test_an_enqueue_outside_any_span_stores_none_and_starts_no_trace(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert enqueue_once(conn, idempotency_key="k2", topic="mail", payload={"v": 1}, ordering_key="c-1")
        assert enqueue_many(conn, [OutboxItem("k3", "mail", {"v": 2})]) == (True,)
    assert _SPANS.get_finished_spans() == ()
    assert _row_trace(engine, "k2") == (None, None)
    assert _row_trace(engine, "k3") == (None, None)


def test_a_set_has_one_create_span_per_row_and_a_rollback_keeps_nothing(engine: sa.Engine) -> None:
    # OpenTelemetry's messaging conventions: a create span accounts for one message and gives it a unique
    # creation context, which that message's send span links to; so each row stores its own.
    items = [
        OutboxItem("c", "mail", {"n": 3}),
        OutboxItem("a", "mail", {"n": 1}),
        OutboxItem("b", "sms", {"n": 2}, "c-1"),
        OutboxItem("d", "sms", {"n": 4}, "c-1"),
    ]
    with _tracer().start_as_current_span("bill") as bill, engine.begin() as conn:
        assert enqueue_many(conn, items) == (True, True, True, True)
    creates = {
        (s.attributes or {})["messaging.message.id"]: s
        for s in _SPANS.get_finished_spans()
        if s.name != "bill"
    }
    assert sorted((s.name, key) for key, s in creates.items()) == [
        ("create mail", "a"),
        ("create mail", "c"),
        ("create sms", "b"),
        ("create sms", "d"),
    ]
    for key, create in creates.items():
        assert create.kind is trace.SpanKind.PRODUCER
        assert create.parent is not None and create.parent.span_id == bill.get_span_context().span_id
        assert "messaging.batch.message_count" not in (create.attributes or {})
        assert _row_trace(engine, key) == (_traceparent_of(create), None)
    assert len({_row_trace(engine, key) for key in "abcd"}) == 4

    # A repeat stores nothing new; a set refused by a conflict keeps none of its rows, its spans say so.
    _SPANS.clear()
    with pytest.raises(OutboxConflictError), _tracer().start_as_current_span("bill"):
        with engine.begin() as conn:
            enqueue_many(conn, [OutboxItem("e", "mail", {"n": 5}), OutboxItem("a", "mail", {"n": 9})])
    refused = [s for s in _SPANS.get_finished_spans() if s.name == "create mail"]
    assert len(refused) == 2 and all(s.status.status_code is trace.StatusCode.ERROR for s in refused)
    with engine.connect() as conn:
        left = conn.execute(sa.select(outbox_table.c.id).where(outbox_table.c.idempotency_key == "e"))
        assert left.first() is None

    with pytest.raises(RuntimeError), _tracer().start_as_current_span("bill"), engine.begin() as conn:
        enqueue_once(conn, idempotency_key="gone", topic="mail", payload={})
        raise RuntimeError("the domain change failed")
    with engine.connect() as conn:
        left = conn.execute(sa.select(outbox_table.c.id).where(outbox_table.c.idempotency_key == "gone"))
        assert left.first() is None


@pytest.mark.parametrize(
    ("traceparent", "tracestate", "headers"),
    [
        (None, None, {}),
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            None,
            {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        ),
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "vendor=a,other=b",
            {
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "tracestate": "vendor=a,other=b",
            },
        ),
        # version ff is invalid; a short or upper-case id is not W3C's form: nothing is propagated
        ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None, {}),
        ("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", None, {}),
        ("00-0af7651916cd43dd-b7ad6b7169203331-01", "vendor=a", {}),
        # a tracestate that is not a header value, or too long, is dropped; the traceparent stays
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "vendor=\u00e9",
            {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        ),
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "v=" + "a" * 600,
            {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        ),
    ],
)
def test_message_headers(traceparent: str | None, tracestate: str | None, headers: dict[str, str]) -> None:
    assert tracing.message_headers(tracing.TraceContext(traceparent, tracestate)) == headers


# -- one trace: a leased Dagster step, the outbox, the dispatcher, the inbox's effect ---------------------


def _shop(inbox: Inbox) -> Starlette:
    """A consumer: the inbox's middleware, and an effect written through the inbox's transaction inside a
    span of its own."""

    def apply(request: Request) -> JSONResponse:
        with _tracer().start_as_current_span("apply invoice"):
            conn = inbox_connection(request)
            conn.execute(sa.text("INSERT INTO shop_effect (trace) VALUES (:t)"), {"t": request.url.path})
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Path("/invoices", apply, methods=["POST"])])
    app.add_middleware(InboxMiddleware, inbox=inbox, paths=["/invoices"])
    return app


@pytest.fixture
def shop_url(engine: sa.Engine) -> Iterator[str]:
    """The consumer served by uvicorn from a thread of this process (its spans reach the same exporter)."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE shop_effect (trace VARCHAR(200))"))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(_shop(Inbox(engine)), log_config=None, access_log=False, lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        threading.Event().wait(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/invoices"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@leased_op(code="traced-billing", name="bill_day")
def bill_day(run: LeasedRun) -> None:
    with _tracer().start_as_current_span("bill day"), run.transaction() as conn:
        run.enqueue_once(conn, topic="invoices", payload={"day": run.partition_key})


def test_one_trace_from_a_leased_step_through_the_dispatcher_to_the_inbox_effect(
    db_url: str, engine: sa.Engine, shop_url: str
) -> None:
    job = dg.GraphDefinition(name="billing", node_defs=[bill_day]).to_job(
        partitions_def=dg.StaticPartitionsDefinition(["2024-03-01"]),
        resource_defs={"joblease": JobLeaseResource(database_url=db_url)},
    )
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    with dg.instance_for_test() as instance:
        assert job.execute_in_process(instance=instance, run_config=quiet, partition_key="2024-03-01").success
    with Dispatcher(engine, {"invoices": Route(shop_url)}) as dispatcher:
        assert dispatcher.dispatch().sent == 1

    (step,) = _spans("bill day")
    (create,) = _spans("create invoices")
    (send,) = _spans("send invoices")
    (process,) = _spans("process /invoices")
    (effect,) = _spans("apply invoice")
    trace_id = step.context.trace_id
    # The producer's trace: the step, the create span, the consumer's process span and its effect.
    assert create.parent is not None and create.parent.span_id == step.context.span_id
    assert process.context.trace_id == trace_id == effect.context.trace_id
    assert process.parent is not None and process.parent.span_id == create.context.span_id
    assert effect.parent is not None and effect.parent.span_id == process.context.span_id
    assert process.kind is trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in process.links] == [create.context.span_id]
    # The dispatcher's send span is its own trace, linked (not parented) to the row's creation context.
    assert send.context.trace_id != trace_id and send.parent is None
    assert [(link.context.trace_id, link.context.span_id) for link in send.links] == [
        (trace_id, create.context.span_id)
    ]
    assert send.kind is trace.SpanKind.PRODUCER
    key = (create.attributes or {})["messaging.message.id"]
    assert (
        (send.attributes or {})["messaging.message.id"]
        == key
        == (process.attributes or {})["messaging.message.id"]
    )
    assert (send.attributes or {})["joblease.outcome"] == "sent"
    assert (send.attributes or {})["messaging.system"] == "http"  # the route's transport
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM shop_effect")).scalar_one() == 1

    points = _time_in_outbox_points()
    assert points and points[-1]["count"] >= 1 and points[-1]["min"] >= 0


def test_each_row_of_a_set_is_sent_linked_to_its_own_creation_and_processed_in_it(
    engine: sa.Engine, shop_url: str
) -> None:
    keys = ["v2:set-a", "v2:set-b", "v2:set-c"]
    with _tracer().start_as_current_span("bill range") as step, engine.begin() as conn:
        enqueue_many(conn, [OutboxItem(key, "invoices", {"key": key}) for key in keys])
    with Dispatcher(engine, {"invoices": Route(shop_url)}) as dispatcher:
        assert dispatcher.dispatch().sent == 3

    def by_key(name: str) -> dict[str, ReadableSpan]:
        found = {(s.attributes or {})["messaging.message.id"]: s for s in _spans(name)}
        assert sorted(found) == keys
        return found  # type: ignore[return-value]

    creates, sends, processes = (
        by_key("create invoices"),
        by_key("send invoices"),
        by_key("process /invoices"),
    )
    for key in keys:
        create = creates[key]
        assert create.context.trace_id == step.get_span_context().trace_id
        assert [link.context.span_id for link in sends[key].links] == [create.context.span_id]
        assert processes[key].parent is not None and processes[key].parent.span_id == create.context.span_id
    assert len({c.context.span_id for c in creates.values()}) == 3


def _time_in_outbox_points() -> list[dict[str, Any]]:
    data = _METRICS.get_metrics_data()
    found = []
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == tracing.TIME_IN_OUTBOX:
                    assert metric.unit == "s"
                    found += [
                        {"count": p.count, "min": p.min, "topic": p.attributes["messaging.destination.name"]}
                        for p in metric.data.data_points
                    ]
    return found


# -- without OpenTelemetry ----------------------------------------------------------------------------


def test_without_opentelemetry_rows_carry_none_and_headers_still_propagate(tmp_path: Any) -> None:
    """A process where ``import opentelemetry`` fails: enqueue works and stores no trace, and a row that
    has one (written by a traced producer) still has it in its headers."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["opentelemetry"] = None  # the optional dependency is absent
        from dagster_joblease import tracing
        from dagster_joblease.outbox import enqueue_once
        from dagster_joblease.storage.engine import create_engine
        from dagster_joblease.storage.migrate import migrate
        assert not tracing.enabled()
        engine = create_engine("sqlite:///{tmp_path / "no-otel.sqlite"}")
        migrate(engine)
        with engine.begin() as conn:
            assert enqueue_once(conn, idempotency_key="k", topic="t", payload={{}})
        with tracing.sending("t", "k", tracing.TraceContext()) as span:
            span.outcome("sent", None)
        with tracing.processing("/t", [(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]):
            pass
        tracing.record_time_in_outbox(1.0, "t")
        parent = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        assert tracing.message_headers(tracing.TraceContext(parent, "a=b")) == {{
            "traceparent": parent, "tracestate": "a=b"}}
        print(engine.connect().exec_driver_sql("SELECT traceparent FROM joblease_outbox").scalar_one())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_migration_adds_and_drops_the_columns_with_rows_in_place(tmp_path: Any) -> None:
    from alembic import command

    from dagster_joblease.storage.migrate import _config

    engine = create_engine(f"sqlite:///{tmp_path / 'm.sqlite'}")
    try:
        migrate(engine, "0009")
        with engine.begin() as conn:
            enqueue_once(conn, idempotency_key="old", topic="t", payload={"n": 1})
        migrate(engine)
        assert _row_trace(engine, "old") == (None, None)
        with _tracer().start_as_current_span("new"), engine.begin() as conn:
            enqueue_once(conn, idempotency_key="new", topic="t", payload={"n": 2})
        assert _row_trace(engine, "new")[0] is not None
        with engine.begin() as conn:
            command.downgrade(_config(conn), "0009")
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM joblease_outbox").scalar_one() == 2
            names = {c["name"] for c in sa.inspect(conn).get_columns("joblease_outbox")}
        assert not names & {"traceparent", "tracestate"}
        migrate(engine)
        assert _row_trace(engine, "new") == (None, None)
    finally:
        engine.dispose()


# -- a broker: the context travels in JetStream's headers, the consumer helper continues it ---------------


def test_a_jetstream_consumer_continues_the_trace_of_the_enqueuing_span(engine: sa.Engine) -> None:
    nats_url = broker_url(NATS_URL_ENV, DEFAULT_NATS_URL, "NATS (JetStream)")
    pytest.importorskip("nats", reason="the nats extra is not installed")
    import asyncio

    import nats

    from dagster_joblease.consumers.jetstream import JetStreamConsumer
    from tests.test_jetstream import Stream

    stream = Stream(nats_url)
    try:
        with _tracer().start_as_current_span("bill") as step, engine.begin() as conn:
            enqueue_once(
                conn, idempotency_key="v2:js-1", topic="events", payload={"n": 1}, ordering_key="c-1"
            )
        with Dispatcher(engine, {"events": stream.route(stream.url)}) as dispatcher:
            assert dispatcher.dispatch().sent == 1

        def handler(conn: sa.Connection, delivery: Any) -> None:
            with _tracer().start_as_current_span("apply event"):
                conn.execute(sa.text("SELECT 1"))

        async def consume() -> Any:
            nc = await nats.connect(stream.url)
            try:
                sub = await nc.jetstream().pull_subscribe(
                    f"{stream.prefix}.>", durable="c", stream=stream.name
                )
                (msg,) = await sub.fetch(1, timeout=10)
                return await JetStreamConsumer(Inbox(engine), handler)(msg)
            finally:
                await nc.close()

        assert asyncio.run(consume()).result is not None
    finally:
        stream.delete()
    (create,) = _spans("create events")
    # NATS's conventions: the destination is the subject; a templated one names the span by its template
    # and the filled subject is messaging.destination.name (the process span's, too).
    (send,) = _spans(f"send {stream.prefix}.{{ordering_key}}")
    (process,) = _spans(f"process {stream.prefix}.c-1")
    (effect,) = _spans("apply event")
    assert (send.attributes or {})["messaging.destination.template"] == f"{stream.prefix}.{{ordering_key}}"
    assert (send.attributes or {})["messaging.destination.name"] == f"{stream.prefix}.c-1"
    assert (process.attributes or {})["messaging.destination.name"] == f"{stream.prefix}.c-1"
    # NATS's conventions: messaging.system is "nats" (JetStream included), on both ends of the message.
    assert (send.attributes or {})["messaging.system"] == "nats"
    assert (process.attributes or {})["messaging.system"] == "nats"
    assert [link.context.span_id for link in send.links] == [create.context.span_id]
    assert process.context.trace_id == step.get_span_context().trace_id == effect.context.trace_id
    assert process.parent is not None and process.parent.span_id == create.context.span_id
    assert effect.parent is not None and effect.parent.span_id == process.context.span_id


def test_a_rabbitmq_consumer_continues_the_trace_of_the_enqueuing_span(engine: sa.Engine) -> None:
    amqp_url = broker_url(AMQP_URL_ENV, DEFAULT_AMQP_URL, "RabbitMQ")
    pytest.importorskip("aio_pika", reason="the rabbitmq extra is not installed")
    import asyncio

    import aio_pika

    from dagster_joblease.consumers.rabbitmq import RabbitMQConsumer
    from tests.test_rabbitmq import Exchange

    exchange = Exchange(amqp_url)
    try:
        with _tracer().start_as_current_span("bill") as step, engine.begin() as conn:
            enqueue_once(conn, idempotency_key="v2:mq-1", topic="events", payload={"n": 1})
        with Dispatcher(engine, {"events": exchange.route(amqp_url)}) as dispatcher:
            assert dispatcher.dispatch().sent == 1

        def handler(conn: sa.Connection, delivery: Any) -> None:
            with _tracer().start_as_current_span("apply event"):
                conn.execute(sa.text("SELECT 1"))

        async def consume() -> tuple[Any, Any]:
            connection = await aio_pika.connect(amqp_url)
            try:
                channel = await connection.channel()
                queue = await channel.declare_queue(exchange.queue, passive=True)
                message = await queue.get(timeout=10)
                assert message is not None
                return message.headers, await RabbitMQConsumer(Inbox(engine), handler)(message)
            finally:
                await connection.close()

        headers, handled = asyncio.run(consume())
        assert handled.result is not None
    finally:
        exchange.delete()
    (create,) = _spans("create events")
    # RabbitMQ's conventions: the destination is the exchange, the routing key an attribute of its own,
    # on both ends of the message.
    (send,) = _spans(f"send {exchange.name}")
    (process,) = _spans(f"process {exchange.name}")
    (effect,) = _spans("apply event")
    for span in (send, process):
        assert (span.attributes or {})["messaging.destination.name"] == exchange.name
        assert (span.attributes or {})["messaging.rabbitmq.destination.routing_key"] == "events"
    # The row's creation context travels in the AMQP headers, as the row's columns hold it.
    assert headers == {"traceparent": _traceparent_of(create)}
    assert send.kind is trace.SpanKind.PRODUCER and (send.attributes or {})["messaging.system"] == "rabbitmq"
    assert [link.context.span_id for link in send.links] == [create.context.span_id]
    assert send.parent is None or send.parent.trace_id != create.context.trace_id  # a link, not a parent
    assert process.kind is trace.SpanKind.CONSUMER
    assert (process.attributes or {})["messaging.system"] == "rabbitmq"
    assert (process.attributes or {})["messaging.operation.type"] == "process"
    assert (process.attributes or {})["messaging.message.id"] == "v2:mq-1"
    assert [link.context.span_id for link in process.links] == [create.context.span_id]
    assert process.context.trace_id == step.get_span_context().trace_id == effect.context.trace_id
    assert process.parent is not None and process.parent.span_id == create.context.span_id
    assert effect.parent is not None and effect.parent.span_id == process.context.span_id
