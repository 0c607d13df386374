"""The transport seam (dagster_joblease.dispatch.transports): one message per claimed row, the route's
transport chosen by its URL's scheme, and HTTP carrying the message's own headers on both of its paths."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from dagster_joblease import outbox
from dagster_joblease.dispatch import policy
from dagster_joblease.dispatch.claims import from_row
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.dispatch.transports import OutboxMessage, TooLate, message_of, open_transports
from dagster_joblease.dispatch.transports.http import HttpTransport
from dagster_joblease.storage import outbox as store
from tests.test_dispatch import Recorder


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    yield rec
    rec.close()


def test_a_claimed_row_is_one_message_with_its_ordering_key(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v2:k1", topic="t", payload={"a": 1}, ordering_key="acct-7")
        outbox.enqueue_once(conn, idempotency_key="v2:k2", topic="t", payload=[1, 2])
    with engine.begin() as conn:
        rows = store.claim_due(conn, token="tok", limit=10, claim_ms=60_000)
        messages = sorted((message_of(from_row(r)) for r in rows), key=lambda m: m.idempotency_key)
    assert [(m.idempotency_key, m.topic, m.ordering_key, dict(m.headers)) for m in messages] == [
        ("v2:k1", "t", "acct-7", {}),
        ("v2:k2", "t", None, {}),
    ]
    assert [m.payload.replace(b" ", b"") for m in messages] == [b'{"a":1}', b"[1,2]"]


def test_the_route_scheme_picks_the_transport(recorder: Recorder) -> None:
    routes = {"a": Route(recorder.url + "/a"), "b": Route("https://example.invalid/b")}
    assert {r.transport for r in routes.values()} == {"http"}
    opened = open_transports(routes, {"a": {}, "b": {}}, 2, None)
    try:
        assert opened["a"] is opened["b"]  # one transport per kind, shared by its topics
        assert isinstance(opened["a"], HttpTransport)
    finally:
        opened["a"].close()


@pytest.mark.parametrize("own_client", [True, False], ids=["own-client", "callers-client"])
def test_http_carries_the_message_headers_after_the_routes(recorder: Recorder, own_client: bool) -> None:
    route = Route(recorder.url + "/hook", headers={"X-Source": "joblease"})
    client = None if own_client else httpx.Client()
    transport = HttpTransport({"t": route}, {"t": {"X-Source": "joblease"}}, 1, client)
    message = OutboxMessage(
        "v2:h1",
        "t",
        "acct-1",
        b'{"x":1}',
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )
    try:
        outcome = transport.send(message, route, time.monotonic() + 5, None)
        with pytest.raises(TooLate):
            transport.send(message, route, time.monotonic() + 5, time.monotonic() - 1)
    finally:
        transport.close()
        if client is not None:
            client.close()
    assert outcome.outcome is policy.Outcome.SENT
    assert len(recorder.requests) == 1  # the late one never left
    headers = {k.lower(): v for k, v in recorder.requests[0]["headers"].items()}
    assert headers["traceparent"] == message.headers["traceparent"]
    assert (headers["x-source"], headers["idempotency-key"]) == ("joblease", "v2:h1")
    assert headers["content-type"] == "application/json"
    assert recorder.requests[0]["body"] == b'{"x":1}'


def test_the_core_imports_without_the_broker_extras_and_a_broker_route_names_its_extra(
    tmp_path: Path,
) -> None:
    """Without nats-py and aio-pika (hidden from the import system), every core module but the two broker
    transports and their consumer helpers imports, an HTTP dispatcher starts, and a broker route is
    refused at start naming the extra to install."""
    program = f"""
import importlib, json, sys
for hidden in ("nats", "aio_pika", "aiormq", "pamqp"):
    sys.modules[hidden] = None
import sqlalchemy as sa
from dagster_joblease import errors, migrate
from dagster_joblease.dispatch import Dispatcher, Route
from tests.test_import_boundary import core_modules
needs_extra = ("transports.jetstream", "transports.rabbitmq", "consumers.jetstream", "consumers.rabbitmq")
for name in core_modules():
    if not name.endswith(needs_extra):
        importlib.import_module(name)
engine = sa.create_engine("sqlite:///{tmp_path}/db.sqlite")
migrate(engine)
Dispatcher(engine, {{"a": Route("http://127.0.0.1:9/x")}}).close()
refusals = []
for route in (
    Route("nats://127.0.0.1:4222", subject="a.b", stream="S", dedupe_window=60),
    Route("amqp://127.0.0.1:5672/", exchange="x"),
):
    try:
        Dispatcher(engine, {{"a": route}})
    except errors.ConfigurationError as exc:
        refusals.append(str(exc))
print(json.dumps(refusals))
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [
        "a nats:// route needs nats-py: pip install 'dagster-joblease[nats]'",
        "an amqp:// route needs aio-pika: pip install 'dagster-joblease[rabbitmq]'",
    ]


@pytest.mark.parametrize(
    ("route", "ordering_key", "expected"),
    [
        (Route("http://127.0.0.1:1/x"), "k", ("events", {})),
        (
            Route("nats://127.0.0.1:4222", subject="orders.all", stream="S", dedupe_window=60),
            "k",
            ("orders.all", {}),
        ),
        (
            Route("nats://127.0.0.1:4222", subject="orders.{ordering_key}", stream="S", dedupe_window=60),
            "acct-7",
            (
                "orders.{ordering_key}",
                {
                    "messaging.destination.template": "orders.{ordering_key}",
                    "messaging.destination.name": "orders.acct-7",
                },
            ),
        ),
        (
            Route("nats://127.0.0.1:4222", subject="orders.{ordering_key}", stream="S", dedupe_window=60),
            None,
            (
                "orders.{ordering_key}",
                {
                    "messaging.destination.template": "orders.{ordering_key}",
                    "messaging.destination.name": "orders._",
                },
            ),
        ),
        (
            Route("amqp://127.0.0.1:5672/", exchange="billing"),
            None,
            ("billing", {"messaging.rabbitmq.destination.routing_key": "events"}),
        ),
        (
            Route("amqp://127.0.0.1:5672/", exchange="", routing_key="q.{ordering_key}"),
            "k1",
            ("", {"messaging.rabbitmq.destination.routing_key": "q.k1"}),
        ),
    ],
)
def test_a_routes_span_destination_is_what_its_systems_conventions_name(
    route: Route, ordering_key: str | None, expected: tuple[str, dict[str, str]]
) -> None:
    assert route.span_destination("events", ordering_key) == expected
