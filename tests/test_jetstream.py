"""The JetStream transport against the real NATS server (127.0.0.1:4222, JetStream on): delivery with
Nats-Msg-Id = the idempotency key, the checks at start, the table of what is retried, and faults through
a TCP proxy (broker down at start and mid-batch, acks that never come, a stream deleted while running)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

pytest.importorskip("nats", reason="the nats extra (pip install 'dagster-joblease[nats]') is not installed")

import nats
import nats.errors
import nats.js.errors

from dagster_joblease import errors, outbox
from dagster_joblease.dispatch import Dispatcher, Route, policy
from dagster_joblease.dispatch.transports import jetstream
from dagster_joblease.storage.schema import outbox_table
from tests.brokers import DEFAULT_NATS_URL, NATS_URL_ENV, broker_url, drain, enqueue, proxy_to, rows, unique
from tests.conftest import wait_until
from tests.dispatch_workers import status_counts

T = TypeVar("T")
FAST = {"backoff_base_ms": 10, "backoff_max_ms": 50}


@pytest.fixture
def nats_url() -> str:
    return broker_url(NATS_URL_ENV, DEFAULT_NATS_URL, "NATS (JetStream)")


def js_do(url: str, body: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``body(jetstream context)`` on a connection of the test's own."""

    async def run() -> T:
        nc = await nats.connect(url)
        try:
            return await body(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(run())


class Stream:
    def __init__(self, url: str, duplicate_window: float = 120.0) -> None:
        self.url = url
        self.name = unique("JL")
        self.prefix = self.name.lower()
        self.duplicate_window = duplicate_window
        self.create()

    def create(self) -> None:
        js_do(
            self.url,
            lambda js: js.add_stream(
                name=self.name, subjects=[f"{self.prefix}.>"], duplicate_window=self.duplicate_window
            ),
        )

    def delete(self) -> None:
        async def delete(js: Any) -> None:
            try:
                await js.delete_stream(self.name)
            except nats.js.errors.NotFoundError:
                pass

        js_do(self.url, delete)

    def messages(self) -> list[Any]:
        async def read(js: Any) -> list[Any]:
            info = await js.stream_info(self.name)
            return [
                await js.get_msg(self.name, seq)
                for seq in range(info.state.first_seq, info.state.last_seq + 1)
            ]

        return js_do(self.url, read)

    def count(self) -> int:
        async def count(js: Any) -> int:
            return int((await js.stream_info(self.name)).state.messages)

        return js_do(self.url, count)

    def route(self, url: str, **kwargs: Any) -> Route:
        options: dict[str, Any] = {"subject": f"{self.prefix}.{{ordering_key}}", "stream": self.name}
        options.setdefault("dedupe_window", 60)
        options.setdefault("timeout_s", 2.0)
        return Route(url, **{**options, **kwargs})


@pytest.fixture
def stream(nats_url: str) -> Iterator[Stream]:
    s = Stream(nats_url)
    yield s
    s.delete()


def msg_ids(stream: Stream) -> list[str]:
    return sorted(m.headers["Nats-Msg-Id"] for m in stream.messages())


# -- delivery ------------------------------------------------------------------------------------------


def test_rows_are_published_once_each_with_their_key_subject_and_headers(
    engine: sa.Engine, stream: Stream
) -> None:
    keys = enqueue(engine, 12, keyed=True)
    route = stream.route(stream.url, headers={"X-Source": "joblease"})
    with Dispatcher(engine, {"events": route}, concurrency=4, **FAST) as dispatcher:
        drain(dispatcher, engine)
        # Requeued rows are sent again with the same key: JetStream drops them as duplicates.
        with engine.begin() as conn:
            conn.execute(sa.update(outbox_table).values(status="PENDING", next_attempt_at=sa.func.now()))
        drain(dispatcher, engine)
    messages = stream.messages()
    assert sorted(m.headers["Nats-Msg-Id"] for m in messages) == keys
    by_key = {m.headers["Nats-Msg-Id"]: m for m in messages}
    for i, key in enumerate(keys):
        assert by_key[key].subject == f"{stream.prefix}.acct-{i % 3}"
        assert by_key[key].headers["X-Source"] == "joblease"
        assert by_key[key].data.replace(b" ", b"") == f'{{"n":{i}}}'.encode()
    found = rows(engine)
    assert {r.status for r in found.values()} == {"SENT"}
    assert all("duplicate" in (r.last_error or "duplicate") for r in found.values())


# -- refused at start ------------------------------------------------------------------------------


def test_a_route_whose_stream_is_missing_is_refused_at_start_naming_it(
    pg_engine: sa.Engine, stream: Stream
) -> None:
    route = stream.route(stream.url, stream="JLNOSUCHSTREAM")
    with pytest.raises(errors.ConfigurationError) as info:
        Dispatcher(pg_engine, {"events": route})
    message = str(info.value)
    assert "topic 'events'" in message and "JLNOSUCHSTREAM" in message and "does not exist" in message


def test_a_stream_that_forgets_keys_sooner_than_the_route_is_refused(
    pg_engine: sa.Engine, nats_url: str
) -> None:
    short = Stream(nats_url, duplicate_window=30)
    try:
        with pytest.raises(errors.ConfigurationError) as info:
            Dispatcher(pg_engine, {"events": short.route(nats_url, dedupe_window=60)})
        assert "duplicate_window (30 s) is shorter than the route's dedupe_window (60 s)" in str(info.value)
        assert "raise the stream's duplicate_window" in str(info.value)
        with pytest.raises(errors.ConfigurationError, match="not the route's subject"):
            Dispatcher(pg_engine, {"events": short.route(nats_url, subject="elsewhere.x", dedupe_window=20)})
        with Dispatcher(pg_engine, {"events": short.route(nats_url, dedupe_window=30)}):
            pass  # equal windows are enough
    finally:
        short.delete()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"url": "kafka://127.0.0.1:9092"}, "must be http:// or https:// (an HTTP POST), nats://"),
        ({"url": "nats://127.0.0.1:4222", "stream": "S", "dedupe_window": 60}, "subject=None"),
        ({"url": "nats://127.0.0.1:4222", "subject": "a.b", "dedupe_window": 60}, "needs stream="),
        (
            {"url": "nats://127.0.0.1:4222", "subject": "a.*", "stream": "S", "dedupe_window": 60},
            "is not valid",
        ),
        ({"url": "nats://127.0.0.1:4222", "subject": "a.b", "stream": "S"}, "set dedupe_window"),
        (
            {"url": "nats://127.0.0.1:4222", "subject": "a", "stream": "S", "exchange": "x"},
            "option of rabbitmq",
        ),
        ({"url": "https://h/x", "subject": "a.b"}, "subject is an option of jetstream routes"),
        ({"url": "nats://u:p@127.0.0.1:4222", "subject": "a", "stream": "S"}, "must not embed credentials"),
    ],
)
def test_a_misconfigured_broker_route_is_refused(kwargs: dict[str, Any], fragment: str) -> None:
    url = kwargs.pop("url")
    with pytest.raises(errors.ConfigurationError) as info:
        Route(url, **kwargs)
    assert fragment in str(info.value)
    assert ":p@" not in str(info.value)


def test_a_routes_file_names_the_topic_of_a_bad_route(tmp_path: Any) -> None:
    from dagster_joblease.dispatch import load_routes

    path = tmp_path / "routes.toml"
    path.write_text('[orders]\nurl = "kafka://broker:9092"\n')
    with pytest.raises(
        errors.ConfigurationError, match="topic 'orders': route url 'kafka://broker:9092' must be"
    ):
        load_routes(path)


# -- the table -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "outcome", "maybe_stored", "fragment"),
    [
        (TimeoutError(), policy.Outcome.RETRY, True, "no publish ack"),
        (nats.errors.TimeoutError(), policy.Outcome.RETRY, True, "same Nats-Msg-Id"),
        (nats.js.errors.NoStreamResponseError(), policy.Outcome.RETRY, False, "no stream stores the subject"),
        (nats.js.errors.ServiceUnavailableError(code=503), policy.Outcome.RETRY, False, "unavailable"),
        (nats.js.errors.ServerError(code=500), policy.Outcome.RETRY, False, "server error"),
        (nats.js.errors.BadRequestError(code=400, err_code=10060), policy.Outcome.DEAD, False, "refused"),
        (nats.errors.MaxPayloadError(), policy.Outcome.DEAD, False, "max_payload"),
        (nats.errors.BadSubjectError(), policy.Outcome.DEAD, False, "subject"),
        (nats.errors.ConnectionClosedError(), policy.Outcome.RETRY, False, "NATS: ConnectionClosedError"),
        (nats.errors.NoServersError(), policy.Outcome.RETRY, False, "NATS: NoServersError"),
        (ConnectionRefusedError(111, "refused"), policy.Outcome.RETRY, False, "cannot reach"),
        (jetstream.RouteNotReady("stream gone"), policy.Outcome.RETRY, False, "stream gone"),
        (jetstream.Unsendable("bad key"), policy.Outcome.DEAD, False, "bad key"),
        (RuntimeError("surprise"), policy.Outcome.RETRY, False, "RuntimeError: surprise"),
    ],
)
def test_what_jetstream_retries(
    exc: BaseException, outcome: policy.Outcome, maybe_stored: bool, fragment: str
) -> None:
    judged = jetstream.classify_exception(exc)
    assert (judged.outcome, judged.timed_out, judged.status_code) == (outcome, maybe_stored, None)
    assert fragment in judged.reason


@pytest.mark.parametrize(
    ("key", "subject"),
    [("acct-1", "p.acct-1.x"), (None, "p._.x"), ("a b", None), ("a.b", None), ("a*", None), (">", None)],
)
def test_the_ordering_key_fills_one_subject_token(key: str | None, subject: str | None) -> None:
    if subject is None:
        with pytest.raises(jetstream.Unsendable, match="cannot be a NATS subject token"):
            jetstream.subject_for("p.{ordering_key}.x", key)
    else:
        assert jetstream.subject_for("p.{ordering_key}.x", key) == subject


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.>", "a.b", True),
        ("a.>", "a", False),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.b", "a.b", True),
    ],
)
def test_subject_matches(pattern: str, subject: str, matches: bool) -> None:
    assert jetstream.subject_matches(pattern, subject) is matches


def test_a_key_that_cannot_be_a_subject_token_is_dead_with_the_reason(
    pg_engine: sa.Engine, stream: Stream
) -> None:
    with pg_engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v2:sp", topic="events", payload={}, ordering_key="a b")
    with Dispatcher(pg_engine, {"events": stream.route(stream.url)}, **FAST) as dispatcher:
        assert dispatcher.dispatch().dead == 1
    assert "cannot be a NATS subject token" in rows(pg_engine)["v2:sp"].last_error


# -- faults ----------------------------------------------------------------------------------------


def test_broker_down_at_start_rows_retry_then_all_are_published_once(
    pg_engine: sa.Engine, stream: Stream
) -> None:
    keys = enqueue(pg_engine, 8)
    with proxy_to(stream.url) as proxy:
        proxy.down()
        with Dispatcher(pg_engine, {"events": stream.route(proxy.url)}, concurrency=4, **FAST) as dispatcher:
            report = dispatcher.dispatch()
            assert (report.claimed, report.retried, report.sent) == (8, 8, 0)
            assert all(r.status == "PENDING" and r.last_error for r in rows(pg_engine).values())
            proxy.up()
            drain(dispatcher, pg_engine)
    assert msg_ids(stream) == keys
    assert {r.status for r in rows(pg_engine).values()} == {"SENT"}


def test_acks_that_never_come_are_retried_with_the_same_message_id(
    pg_engine: sa.Engine, stream: Stream
) -> None:
    keys = enqueue(pg_engine, 6)
    with proxy_to(stream.url) as proxy:
        route = stream.route(proxy.url, timeout_s=1.0)
        with Dispatcher(pg_engine, {"events": route}, concurrency=3, **FAST) as dispatcher:
            proxy.stall()  # the publishes reach the server; their acks are held
            report = dispatcher.dispatch()
            assert (report.claimed, report.retried) == (6, 6)
            found = rows(pg_engine)
            assert all("no publish ack" in r.last_error for r in found.values())
            wait_until(lambda: stream.count() == 6)  # stored, though unacknowledged
            proxy.unstall()
            drain(dispatcher, pg_engine)
    assert msg_ids(stream) == keys  # the resends were dropped as duplicates of the same Nats-Msg-Id
    found = rows(pg_engine)
    assert {(r.status, r.attempts) for r in found.values()} == {("SENT", 2)}


def test_broker_down_mid_batch_nothing_lost_nothing_stored_twice(
    pg_engine: sa.Engine, stream: Stream
) -> None:
    keys = enqueue(pg_engine, 40)
    with proxy_to(stream.url) as proxy:
        route = stream.route(proxy.url, timeout_s=2.0)
        with Dispatcher(pg_engine, {"events": route}, concurrency=4, **FAST) as dispatcher:
            proxy.stall()  # publishes stored, acks held: the batch is in flight when the broker goes
            batch = threading.Thread(target=dispatcher.dispatch, args=(40,))
            batch.start()
            wait_until(lambda: stream.count() >= 2)
            proxy.down()
            proxy.unstall()
            batch.join(60)
            assert status_counts(pg_engine).get("PENDING", 0) > 0
            proxy.up()
            drain(dispatcher, pg_engine)
    assert msg_ids(stream) == keys
    assert {r.status for r in rows(pg_engine).values()} == {"SENT"}


def test_a_stream_deleted_while_running_retries_its_rows_until_it_is_back(
    pg_engine: sa.Engine, stream: Stream
) -> None:
    first = enqueue(pg_engine, 3, prefix="v2:before")
    with Dispatcher(pg_engine, {"events": stream.route(stream.url)}, **FAST) as dispatcher:
        drain(dispatcher, pg_engine)
        stream.delete()
        later = enqueue(pg_engine, 3, prefix="v2:after")
        report = dispatcher.dispatch()
        assert (report.claimed, report.retried, report.sent, report.dead) == (3, 3, 0, 0)
        # Each row's reason names the stream: a publish that met no stream ("no stream stores the subject
        # now"), or, for a row sent after the transport's re-check, "the stream ... does not exist".
        reasons = [rows(pg_engine)[k].last_error or "" for k in later]
        assert all("stream" in r for r in reasons), reasons
        time.sleep(0.1)
        report = dispatcher.dispatch()  # checked again: still missing, named
        assert report.retried == 3
        assert all("does not exist" in rows(pg_engine)[k].last_error for k in later)
        stream.create()
        drain(dispatcher, pg_engine)
    assert msg_ids(stream) == later  # the recreated stream holds what was sent after it came back
    assert {r.status for r in rows(pg_engine).values()} == {"SENT"}
    assert first
