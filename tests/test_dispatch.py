"""Dispatcher behaviour against real HTTP servers: the reference receiver in its own process, and small
recording servers in a thread where the test must see exact headers or a redirect."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors, outbox
from dagster_joblease.dispatch import Dispatcher, DispatchReport, Route, load_routes
from dagster_joblease.receiver import effect_count, effects, request_count
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until
from tests.dispatch_workers import enqueue_many, status_counts
from tests.receiver_proc import start_receiver

FAST = {"backoff_base_ms": 10, "backoff_max_ms": 100}


def _pending(engine: sa.Engine) -> int:
    return status_counts(engine).get("PENDING", 0)


def drain(
    dispatcher: Dispatcher, engine: sa.Engine, timeout: float = 30.0, limit: int = 500
) -> DispatchReport:
    """Dispatch until no row is PENDING; fail after ``timeout`` seconds."""
    totals = DispatchReport()
    deadline = time.monotonic() + timeout
    while _pending(engine):
        assert time.monotonic() < deadline, f"rows still pending after {timeout} s: {status_counts(engine)}"
        report = dispatcher.dispatch(limit)
        totals = totals.merge(report)
        if report.claimed == 0:
            time.sleep(0.01)  # rows are waiting out a backoff of a few ms
    return totals


def _row(engine: sa.Engine, key: str) -> Any:
    t = outbox_table
    with engine.connect() as conn:
        return conn.execute(sa.select(t).where(t.c.idempotency_key == key)).one()


# -- a recording server in a thread ----------------------------------------------------------------


class Recorder:
    """A tiny HTTP server that records each request; ``respond(path)`` gives (status, headers)."""

    def __init__(self, respond: Callable[[str], tuple[int, dict[str, str]]] | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                recorder.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                status, headers = respond(self.path) if respond else (200, {})
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    yield rec
    rec.close()


# -- configuration -----------------------------------------------------------------------------------


_NATS = {"url": "nats://h:4222", "subject": "a.b", "stream": "S", "dedupe_window": "2m"}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"url": "ftp://host/x"}, "http:// or https://"),
        ({"url": "https:///nohost"}, "with a host"),
        ({"url": "https://user:pw@host/x"}, "must not embed credentials"),
        ({"url": "https://h/x", "headers": {"Idempotency-Key": "k"}}, "set by the dispatcher"),
        ({"url": "https://h/x", "headers": {"Bad Name": "v"}}, "not a valid HTTP header name"),
        ({"url": "https://h/x", "headers": {"X-A": "line\nbreak"}}, "printable ASCII"),
        # Each row's own trace context travels in these: a route's would name one fixed trace for every row.
        (
            {"url": "https://h/x", "headers": {"TraceParent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}},
            "set by",
        ),
        ({"url": "amqp://h/", "exchange": "x", "headers": {"tracestate": "a=b"}}, "set by the dispatcher"),
        ({"url": "https://h/x", "secret_headers": {"traceparent": "TRACE"}}, "set by the dispatcher"),
        # JetStream's control headers would apply to every message of the route.
        ({**_NATS, "headers": {"Nats-Msg-Id": "fixed"}}, "JetStream control header"),
        ({**_NATS, "headers": {"nats-rollup": "all"}}, "JetStream control header"),
        # What every transport carries: an AMQP field-table key is at most 255 bytes; values of 8 KiB.
        ({"url": "amqp://h/", "exchange": "x", "headers": {"X" * 256: "v"}}, "at most 255 characters"),
        ({"url": "https://h/x", "headers": {"X-A": "v" * 8_193}}, "at most 8192 characters; got 8193"),
        ({"url": "https://h/x", "headers": {"X-A": 5}}, "printable ASCII string (no CR, LF"),
        ({"url": "https://h/x", "headers": {"X-A": "caf\u00e9"}}, "printable ASCII"),
        ({"url": "https://h/x", "secret_headers": {"Authorization": "not-a-var!"}}, "environment variable"),
        ({"url": "https://h/x", "timeout_s": 0}, "timeout_s"),
        ({"url": "https://h/x", "headers": {"X-A": "1"}, "secret_headers": {"x-a": "A"}}, "both static"),
    ],
)
def test_route_validation(kwargs: dict[str, Any], fragment: str) -> None:
    kwargs = dict(kwargs)
    url = kwargs.pop("url")
    with pytest.raises(errors.ConfigurationError) as info:
        Route(url, **kwargs)
    assert fragment in str(info.value)
    assert "pw" not in str(info.value)


def test_route_headers_the_transports_carry_are_kept() -> None:
    longest = {"X" * 255: "v" * 8_192}
    assert dict(Route("amqp://h/", exchange="x", headers=longest).headers) == longest
    # Nats-… is JetStream's own only on a JetStream route; elsewhere it is an ordinary header.
    assert dict(Route("https://h/x", headers={"Nats-Note": "1"}).headers) == {"Nats-Note": "1"}
    assert dict(Route(**{**_NATS, "headers": {"X-Source": "joblease"}}).headers) == {"X-Source": "joblease"}


def test_load_routes_from_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "routes.toml"
    toml.write_text(
        '[billing]\nurl = "https://billing.internal/hook"\nheaders = { "X-Source" = "joblease" }\n'
        'secret_headers = { "Authorization" = "BILLING_TOKEN" }\ntimeout_s = 5\n'
        '[mail]\nurl = "http://mail.internal/send"\n'
    )
    routes = load_routes(toml)
    assert routes["billing"] == Route(
        "https://billing.internal/hook",
        headers={"X-Source": "joblease"},
        secret_headers={"Authorization": "BILLING_TOKEN"},
        timeout_s=5.0,
    )
    assert routes["mail"].timeout_s == 10.0
    js = tmp_path / "routes.json"
    js.write_text(json.dumps({"mail": {"url": "http://mail.internal/send", "timeout_s": 2}}))
    assert load_routes(js) == {"mail": Route("http://mail.internal/send", timeout_s=2)}
    js.write_text(json.dumps({"mail": {"url": "http://m/x", "destination": "x"}}))
    with pytest.raises(errors.ConfigurationError, match="unknown keys"):
        load_routes(js)
    with pytest.raises(errors.ConfigurationError, match="cannot be read"):
        load_routes(tmp_path / "missing.toml")


def test_missing_secret_variable_is_named_at_construction(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dagster_joblease.storage import create_engine

    engine = create_engine(sqlite_url)
    route = Route("https://h/x", secret_headers={"Authorization": "JOBLEASE_TEST_TOKEN"})
    monkeypatch.delenv("JOBLEASE_TEST_TOKEN", raising=False)
    with pytest.raises(errors.ConfigurationError, match="JOBLEASE_TEST_TOKEN"):
        Dispatcher(engine, {"t": route})
    with pytest.raises(errors.ConfigurationError, match="claim_ms=1000 must exceed"):
        Dispatcher(engine, {"t": Route("https://h/x", timeout_s=1.0)}, claim_ms=1_000)
    with pytest.raises(errors.ConfigurationError, match="concurrency must be an int >= 1, got 0"):
        Dispatcher(engine, {}, concurrency=0)
    # The seed's JavaScript bound lands past year 9999: refused before any claim is stamped with it.
    for option in ("claim_ms", "backoff_base_ms", "backoff_max_ms"):
        with pytest.raises(
            errors.ConfigurationError,
            match=f"{option} must be an int number of milliseconds from .* to 3153600000000, got {2**53 - 1}",
        ):
            Dispatcher(engine, {}, **{option: 2**53 - 1})
    engine.dispose()


# -- delivery ------------------------------------------------------------------------------------------


def test_headers_body_and_destination_come_from_the_route(
    engine: sa.Engine, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBLEASE_TEST_TOKEN", "Bearer s3cret")
    payload = {"v": 1, "url": "http://attacker.example/", "text": "é ü", "n": [1, 2.5, None]}
    with engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v2:hdr", topic="billing", payload=payload)
    route = Route(
        recorder.url + "/hooks/billing",
        headers={"X-Source": "joblease"},
        secret_headers={"Authorization": "JOBLEASE_TEST_TOKEN"},
    )
    with Dispatcher(engine, {"billing": route}) as dispatcher:
        report = dispatcher.dispatch()
    assert (report.claimed, report.sent) == (1, 1)
    assert report.rows[0].outcome == "sent" and report.rows[0].status_code == 200
    (request,) = recorder.requests
    headers = {k.lower(): v for k, v in request["headers"].items()}
    assert request["path"] == "/hooks/billing"
    assert headers["idempotency-key"] == "v2:hdr"
    assert headers["content-type"] == "application/json"
    assert headers["x-source"] == "joblease"
    assert headers["authorization"] == "Bearer s3cret"
    assert json.loads(request["body"]) == payload
    row = _row(engine, "v2:hdr")
    assert (row.status, row.attempts, row.last_status, row.claim_token) == ("SENT", 1, 200, None)
    assert row.sent_at is not None


def test_own_client_sends_its_default_headers_and_never_replays_a_cookie(engine: sa.Engine) -> None:
    """The dispatcher's own client sends straight through its transport: the headers an httpx.Client
    would send (Host, Content-Length, User-Agent, Accept...), the key in the route's format, and no
    Cookie a downstream set while answering another row."""
    cookies = Recorder(lambda path: (200, {"Set-Cookie": "session=from-row-1; Path=/"}))
    seen: list[str] = []
    try:
        with engine.begin() as conn:
            for i in range(3):
                outbox.enqueue_once(conn, idempotency_key=f"v2:ck-{i}", topic="t", payload={"i": i})
        route = Route(cookies.url + "/hook", key_format="sf-string")
        with Dispatcher(engine, {"t": route}, concurrency=1) as dispatcher:
            assert dispatcher.dispatch(limit=2).sent == 2
            # Event hooks added to the own client see every request (the full httpx.Client path).
            dispatcher._client.event_hooks["request"].append(lambda request: seen.append(request.url.path))
            assert dispatcher.dispatch().sent == 1
    finally:
        cookies.close()
    assert seen == ["/hook"]
    sent = [{k.lower(): v for k, v in r["headers"].items()} for r in cookies.requests]
    assert [h["idempotency-key"] for h in sent] == ['"v2:ck-0"', '"v2:ck-1"', '"v2:ck-2"']
    for headers, request in zip(sent, cookies.requests, strict=True):
        assert "cookie" not in headers
        assert headers["host"] == cookies.url.removeprefix("http://")
        assert headers["content-length"] == str(len(request["body"]))
        assert headers["content-type"] == "application/json"
        assert headers["user-agent"].startswith("python-httpx/")
        assert headers["accept"] == "*/*"


def test_redirects_are_not_followed_and_secrets_stay_home(
    engine: sa.Engine, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBLEASE_TEST_TOKEN", "s3cret")
    redirector = Recorder(lambda path: (307, {"Location": recorder.url + "/stolen"}))
    try:
        with engine.begin() as conn:
            outbox.enqueue_once(conn, idempotency_key="v2:redir", topic="t", payload={"v": 1})
        route = Route(redirector.url + "/hook", secret_headers={"X-Api-Key": "JOBLEASE_TEST_TOKEN"})
        with Dispatcher(engine, {"t": route}) as dispatcher:
            report = dispatcher.dispatch()
    finally:
        redirector.close()
    assert report.dead == 1
    assert len(redirector.requests) == 1 and recorder.requests == []
    row = _row(engine, "v2:redir")
    assert row.status == "DEAD" and row.last_status == 307
    assert "redirects are not followed" in row.last_error


def test_delivers_through_the_receiver_and_leaves_unrouted_topics_untouched(
    engine: sa.Engine, db_url: str
) -> None:
    keys = enqueue_many(engine, 40, topic="work")
    with engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v2:orphan", topic="nowhere", payload={"v": 1})
    before = _row(engine, "v2:orphan")
    with (
        start_receiver(db_url) as receiver,
        Dispatcher(engine, {"work": Route(receiver.url + "/work")}, concurrency=8) as dispatcher,
    ):
        report = dispatcher.dispatch(limit=100)
        assert dispatcher.dispatch(limit=100).claimed == 0
    assert (report.claimed, report.sent, report.dead, report.retried) == (40, 40, 0, 0)
    assert status_counts(engine) == {"SENT": 40, "PENDING": 1}
    applied = effects(engine)
    assert sorted(k for k, _, _ in applied) == keys
    assert all(json.loads(body)["v"] == 1 and topic == "work" for _, topic, body in applied)
    # A topic this dispatcher does not route is someone else's: not claimed, not dead-lettered, not touched.
    assert _row(engine, "v2:orphan") == before
    assert outbox.due_summary(engine).due == 1
    assert outbox.due_summary(engine, topics=["work"]).due == 0
    assert outbox.due_summary(engine, topics={"nowhere"}).due == 1


def test_two_dispatchers_with_disjoint_routes_share_one_database(pg_engine: sa.Engine, pg_url: str) -> None:
    """Two code locations, one joblease database: each delivers only its own topics, in any order."""
    billing = enqueue_many(pg_engine, 15, topic="billing", prefix="v2:bill")
    mail = enqueue_many(pg_engine, 10, topic="mail", prefix="v2:mail")
    with (
        start_receiver(pg_url) as receiver,
        Dispatcher(pg_engine, {"billing": Route(receiver.url + "/billing")}, concurrency=4) as first,
        Dispatcher(pg_engine, {"mail": Route(receiver.url + "/mail")}, concurrency=1) as second,
    ):
        assert outbox.due_summary(pg_engine, topics=["billing"]).due == 15
        assert outbox.due_summary(pg_engine, topics=["mail"]).due == 10
        one = first.dispatch(limit=100)
        assert (one.claimed, one.sent) == (15, 15)
        assert {r.topic for r in one.rows} == {"billing"}
        assert status_counts(pg_engine) == {"SENT": 15, "PENDING": 10}
        t = outbox_table
        with pg_engine.connect() as conn:
            untouched = conn.execute(
                sa.select(t.c.attempts, t.c.claim_token, t.c.last_error).where(t.c.topic == "mail")
            ).all()
        assert set(untouched) == {(0, None, None)}
        assert first.dispatch(limit=100).claimed == 0
        two = second.dispatch(limit=100)
        assert (two.claimed, two.sent) == (10, 10)
    assert status_counts(pg_engine) == {"SENT": 25}
    applied = {key: topic for key, topic, _ in effects(pg_engine)}
    assert applied == {**dict.fromkeys(billing, "billing"), **dict.fromkeys(mail, "mail")}
    assert outbox.due_summary(pg_engine) == outbox.DueSummary(due=0, oldest_due_age_ms=None, retrying=0)


def test_transient_failures_retry_and_land_while_a_400_goes_dead_at_once(
    pg_engine: sa.Engine, pg_url: str
) -> None:
    keys = enqueue_many(pg_engine, 30, topic="work")
    with pg_engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v2:poison", topic="bad", payload={"v": 1})
    faults = {
        "drop_first": 3,
        "hang_first": 2,
        "hang_ms": 1_500,
        "fail_first": 4,
        "fail_status": 503,
        "always_status_for_topic": {"bad": 400},
    }
    with start_receiver(pg_url, **faults) as receiver:
        routes = {
            "work": Route(receiver.url + "/work", timeout_s=0.5),
            "bad": Route(receiver.url + "/bad", timeout_s=0.5),
        }
        with Dispatcher(pg_engine, routes, concurrency=8, **FAST) as dispatcher:
            first = dispatcher.dispatch(limit=100)
            # The poison row is judged in the first batch, alongside the others, and never retried.
            assert first.claimed == 31 and first.dead == 1
            totals = first.merge(drain(dispatcher, pg_engine))
    assert status_counts(pg_engine) == {"SENT": 30, "DEAD": 1}
    assert totals.retried >= 9 and totals.sent == 30 and totals.lost_claims == 0
    assert effect_count(pg_engine) == 30
    # Every retry follows a failed attempt; a few may never reach the receiver's log (a keep-alive connection
    # it closed after dropping a request), so the log holds at most one POST per attempt.
    assert 31 + 9 <= request_count(pg_engine) <= 31 + totals.retried
    poison = _row(pg_engine, "v2:poison")
    assert (poison.attempts, poison.last_status) == (1, 400)
    assert poison.last_error.startswith("HTTP 400: ") and "always answers 400" in poison.last_error
    assert len(poison.last_error) <= 500
    retried = [_row(pg_engine, k) for k in keys]
    assert sum(r.attempts > 1 for r in retried) >= 9
    assert all(r.last_error is None and r.last_status == 200 for r in retried)

    # A deliberate requeue brings the dead row back with its original key.
    t = outbox_table
    with pg_engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.idempotency_key == "v2:poison")
            .values(status="PENDING", attempts=0, next_attempt_at=sa.func.now())
        )
    with (
        start_receiver(pg_url) as receiver,
        Dispatcher(pg_engine, {"bad": Route(receiver.url + "/bad")}) as dispatcher,
    ):
        assert dispatcher.dispatch().sent == 1
    assert _row(pg_engine, "v2:poison").status == "SENT"
    assert effect_count(pg_engine, idempotency_key="v2:poison") == 1


def test_exhausted_attempts_go_dead(pg_engine: sa.Engine, pg_url: str) -> None:
    enqueue_many(pg_engine, 5, topic="work")
    with (
        start_receiver(pg_url, fail_first=1_000, fail_status=500) as receiver,
        Dispatcher(pg_engine, {"work": Route(receiver.url + "/work")}, max_attempts=3, **FAST) as dispatcher,
    ):
        totals = drain(dispatcher, pg_engine)
    assert (totals.sent, totals.retried, totals.dead) == (0, 10, 5)
    assert status_counts(pg_engine) == {"DEAD": 5}
    t = outbox_table
    with pg_engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.attempts, t.c.last_status, t.c.last_error)).all()
    assert all(r.attempts == 3 and r.last_status == 500 for r in rows)
    assert all(r.last_error.startswith("gave up after 3 attempts; last: HTTP 500") for r in rows)
    assert request_count(pg_engine) == 15 and effect_count(pg_engine) == 0


def test_a_stale_dispatcher_cannot_record_over_a_new_claim(pg_engine: sa.Engine, pg_url: str) -> None:
    """Fencing: the row was re-claimed while its first delivery was in flight; that one records nothing."""
    enqueue_many(pg_engine, 1, topic="work", prefix="v2:fence")
    t = outbox_table
    with (
        start_receiver(pg_url, delay_after_apply_ms=600) as receiver,
        Dispatcher(pg_engine, {"work": Route(receiver.url + "/work")}) as dispatcher,
    ):
        result: list[DispatchReport] = []
        thread = threading.Thread(target=lambda: result.append(dispatcher.dispatch()))
        thread.start()
        wait_until(lambda: effect_count(pg_engine) == 1)
        # What another dispatcher does once this claim has expired: take the row over with its own token.
        with pg_engine.begin() as conn:
            conn.execute(sa.update(t).values(claim_token="another-dispatcher"))
        thread.join(10)
    (report,) = result
    assert (report.claimed, report.sent, report.lost_claims) == (1, 0, 1)
    row = _row(pg_engine, "v2:fence-00000")
    assert (row.status, row.claim_token, row.sent_at) == ("PENDING", "another-dispatcher", None)


def test_run_stops_on_its_event_and_returns_totals(engine: sa.Engine, db_url: str) -> None:
    enqueue_many(engine, 12, topic="work")
    stop = threading.Event()
    reports: list[DispatchReport] = []
    with (
        start_receiver(db_url) as receiver,
        Dispatcher(engine, {"work": Route(receiver.url + "/work")}, concurrency=4) as dispatcher,
    ):

        def on_report(report: DispatchReport) -> None:
            reports.append(report)
            if sum(r.sent for r in reports) == 12:
                stop.set()

        totals = dispatcher.run(poll_interval_s=0.01, stop=stop, limit=5, on_report=on_report)
    assert (totals.claimed, totals.sent) == (12, 12)
    assert [r.claimed for r in reports] == [5, 5, 2]
    assert len(totals.rows) == 12
    assert status_counts(engine) == {"SENT": 12}


# -- a total deadline per request, and recording without waiting on the pool ---------------------------


class Dribbler:
    """A raw TCP downstream that reads a request, then answers one byte every ``interval_s`` and records
    how many bytes it got out before the client hung up."""

    def __init__(self, head: bytes, response: bytes, interval_s: float = 0.1) -> None:
        self.head = head
        self.response = response
        self.interval_s = interval_s
        self.sent = 0
        self.finished = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/slow"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(
                next(
                    v
                    for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                    if k.lower() == b"content-length"
                )
            )
            while len(body) < length:
                body += conn.recv(65536)
            try:
                conn.sendall(self.head)
                for i in range(len(self.response)):
                    conn.sendall(self.response[i : i + 1])
                    self.sent += 1
                    time.sleep(self.interval_s)
            except OSError:
                pass  # the client hung up: what a total deadline does
        self.finished.set()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(15)


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_dribbling_downstream_cannot_keep_a_request_past_its_total_deadline(
    pg_engine: sa.Engine, phase: str
) -> None:
    """httpx's timeouts are per socket read: a byte every 0.1 s never trips a 1 s read timeout. The request
    must end at its total deadline (route timeout_s, itself inside the claim), long before the answer is
    complete, and count as a retryable timeout rather than a success."""
    enqueue_many(pg_engine, 1, topic="slow", prefix="v2:dribble")
    padding = b"x" * 50
    if phase == "headers":  # the status line and headers themselves arrive a byte at a time
        head, response = b"", b"HTTP/1.1 200 OK\r\nX-Pad: " + padding + b"\r\nContent-Length: 2\r\n\r\nok"
    else:  # prompt headers, then a body a byte at a time
        head, response = b"HTTP/1.1 200 OK\r\nContent-Length: 52\r\n\r\n", padding + b"ok"
    dribbler = Dribbler(head, response)
    try:
        with Dispatcher(
            pg_engine, {"slow": Route(dribbler.url, timeout_s=1.0)}, claim_ms=3_000, **FAST
        ) as dispatcher:
            report = dispatcher.dispatch()
        dribbler.finished.wait(15)
    finally:
        dribbler.close()
    assert (report.claimed, report.sent, report.retried) == (1, 0, 1)
    assert dribbler.sent < len(response), "the whole dribbled answer was read: no total deadline"
    row = _row(pg_engine, "v2:dribble-00000")
    assert (row.status, row.attempts, row.sent_at) == ("PENDING", 1, None)
    assert "timeout" in row.last_error.lower()


def test_recording_outcomes_never_needs_more_than_one_pooled_connection(pg_url: str) -> None:
    """At any concurrency the deliveries' outcomes are recorded by the dispatching thread, a group per
    statement, so the dispatcher holds at most one connection of its engine's pool at a time and can never
    wait on the pool (it used to open one transaction per row from every delivery thread at once)."""
    from dagster_joblease.storage import create_engine

    concurrency = 12
    engine = create_engine(pg_url, pool_size=1, max_overflow=concurrency, pool_timeout=30)
    in_use = 0
    most = 0
    lock = threading.Lock()

    @sa.event.listens_for(engine, "checkout")
    def _checkout(*_: Any) -> None:
        nonlocal in_use, most
        with lock:
            in_use += 1
            most = max(most, in_use)

    @sa.event.listens_for(engine, "checkin")
    def _checkin(*_: Any) -> None:
        nonlocal in_use
        with lock:
            in_use -= 1

    gate = threading.Barrier(concurrency, timeout=20)

    def respond(_path: str) -> tuple[int, dict[str, str]]:
        gate.wait()  # every delivery of the batch answers at the same moment
        return 200, {}

    rec = Recorder(respond)
    try:
        enqueue_many(engine, concurrency * 3, topic="work", prefix="v2:pool")
        with Dispatcher(engine, {"work": Route(rec.url + "/work")}, concurrency=concurrency) as dispatcher:
            totals = DispatchReport()
            for _ in range(3):
                totals = totals.merge(dispatcher.dispatch(limit=concurrency))
    finally:
        rec.close()
    assert (totals.claimed, totals.sent, totals.unrecorded, totals.lost_claims) == (36, 36, 0, 0)
    assert status_counts(engine) == {"SENT": 36}
    assert most == 1, f"the dispatcher held {most} pooled connections at once"
    engine.dispose()
