"""The reference receiver over real HTTP, in its own process, on real databases."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from dagster_joblease import errors
from dagster_joblease.cli.receiver import receiver_command
from dagster_joblease.inbox import ADVISORY_LOCK_CLASS, InboxStatus
from dagster_joblease.receiver import (
    ReceiverOptions,
    ReceiverServer,
    effect_count,
    effects,
    ensure_tables,
    request_count,
    request_log,
)
from dagster_joblease.receiver.app import RequestLog
from dagster_joblease.storage import create_engine, inbox_table
from tests.conftest import wait_until
from tests.receiver_proc import start_receiver


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as c:
        yield c


@pytest.fixture
def serve_in_thread() -> Iterator[Callable[..., ReceiverServer]]:
    """Start receivers in this process, each served by uvicorn from a thread (as the testing kit runs one)."""
    started: list[ReceiverServer] = []

    def start(engine: sa.Engine, *, proxy: bool = False, **options: Any) -> ReceiverServer:
        srv = ReceiverServer(engine, options=ReceiverOptions(**options), proxy=proxy).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.close()


@pytest.fixture
def server(engine: sa.Engine, serve_in_thread: Callable[..., ReceiverServer]) -> ReceiverServer:
    ensure_tables(engine)
    return serve_in_thread(engine, proxy=True)


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(sqlite_url)
    ensure_tables(eng)
    yield eng
    eng.dispose()


def _connect(server: ReceiverServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _head(key: str, length: str | None, *extra: str) -> bytes:
    lines = ["POST /mail HTTP/1.1", "Host: receiver", f"Idempotency-Key: {key}", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer_then_close(sock: socket.socket) -> tuple[int | None, bytes]:
    """Read until the server closes the connection: the status (None if nothing came) and the bytes."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return (int(data.split(b" ", 2)[1]) if data else None), data


def _post(client: httpx.Client, url: str, payload: object, key: str | None, **headers: str) -> httpx.Response:
    sent = dict(headers)
    if key is not None:
        sent["Idempotency-Key"] = key
    return client.post(url, content=json.dumps(payload).encode(), headers=sent)


def _statuses(engine: sa.Engine) -> list[int | None]:
    return [status for _, _, status in request_log(engine)]


def _keys_in_flight(engine: sa.Engine) -> int:
    """PostgreSQL: keys whose effect's transaction is open (each holds the inbox's advisory lock)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :c"
                    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                ),
                {"c": ADVISORY_LOCK_CLASS},
            ).scalar_one()
        )


def _inbox_status(engine: sa.Engine, key: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(inbox_table.c.status).where(inbox_table.c.idempotency_key == key)
        ).scalar_one_or_none()


def test_idempotency_key_contract_over_http(db_url: str, engine: sa.Engine, client: httpx.Client) -> None:
    with start_receiver(db_url) as receiver:
        assert client.get(f"{receiver.url}/health").status_code == 200

        missing = _post(client, f"{receiver.url}/mail", {"v": 1}, None)
        assert missing.status_code == 400
        assert "Idempotency-Key" in missing.json()["detail"]

        first = _post(client, f"{receiver.url}/mail", {"v": 1, "id": 7}, "k-1")
        assert first.status_code == 200
        assert first.json() == {"applied": True, "key": "k-1", "topic": "mail"}
        assert "Idempotent-Replayed" not in first.headers

        # Same payload in another JSON spelling, key as an RFC 8941 string: a replay, not a new effect.
        replay = client.post(
            f"{receiver.url}/mail", content=b'{ "id": 7, "v": 1 }', headers={"Idempotency-Key": '"k-1"'}
        )
        assert replay.status_code == 200
        assert replay.content == first.content
        assert replay.headers["Idempotent-Replayed"] == "true"

        conflict = _post(client, f"{receiver.url}/mail", {"v": 1, "id": 8}, "k-1")
        assert conflict.status_code == 422
        assert conflict.headers["content-type"] == "application/problem+json"

        assert _post(client, f"{receiver.url}/sms", {"v": 1}, "k-2").status_code == 200

        assert effect_count(engine) == 2
        assert effect_count(engine, idempotency_key="k-1") == 1
        assert effects(engine) == [("k-1", "mail", '{"v": 1, "id": 7}'), ("k-2", "sms", '{"v": 1}')]
        # The request log is written in batches off the request path, statuses just after the answers.
        wait_until(lambda: _statuses(engine) == [400, 200, 200, 422, 200])
        assert request_count(engine) == 5
        assert request_count(engine, idempotency_key="k-1") == 2  # the quoted spelling is logged raw

        assert receiver.stop() == 0
    assert not receiver.alive()


def test_key_in_flight_answers_409_then_the_first_response(pg_url: str, pg_engine: sa.Engine) -> None:
    """While the effect's transaction is open, the same key is answered 409 (PostgreSQL: no writer lock)."""
    with start_receiver(pg_url, effect_delay_ms=1500) as receiver, httpx.Client(timeout=10.0) as client:
        answers: list[httpx.Response] = []
        first = threading.Thread(
            target=lambda: answers.append(_post(client, f"{receiver.url}/mail", {"v": 1}, "slow"))
        )
        first.start()
        wait_until(lambda: _keys_in_flight(pg_engine) == 1)
        in_flight = _post(client, f"{receiver.url}/mail", {"v": 1}, "slow")
        assert in_flight.status_code == 409
        # At most until the in-flight claim's lock (30 s by default) ends on the database clock.
        assert 1 <= int(in_flight.headers["Retry-After"]) <= 30
        assert effect_count(pg_engine) == 0
        first.join(10)
        assert [a.status_code for a in answers] == [200]
        again = _post(client, f"{receiver.url}/mail", {"v": 1}, "slow")
        assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
        assert effect_count(pg_engine) == 1
        wait_until(lambda: request_count(pg_engine) == 3)


def test_fault_flags(pg_url: str, pg_engine: sa.Engine, client: httpx.Client) -> None:
    faults: dict[str, Any] = {
        "drop_first": 1,
        "hang_first": 1,
        "hang_ms": 2000,
        "fail_first": 1,
        "fail_status": 503,
        "always_status_for_topic": {"poison": 400, "gone": 410},
        "delay_after_apply_ms": 1500,
    }
    with start_receiver(pg_url, **faults) as receiver:
        url = f"{receiver.url}/mail"
        with pytest.raises(httpx.RemoteProtocolError):  # 1: dropped without a response
            _post(client, url, {"v": 1}, "a")
        with pytest.raises(httpx.ReadTimeout):  # 2: hangs past the client's timeout
            client.post(url, content=b"{}", headers={"Idempotency-Key": "a"}, timeout=0.3)
        failed = _post(client, url, {"v": 1}, "a")  # 3: fails on purpose
        assert failed.status_code == 503
        assert "--fail-first" in failed.json()["detail"]
        poison = _post(client, f"{receiver.url}/poison", {"v": 1}, "p")
        assert poison.status_code == 400 and "poison" in poison.json()["detail"]
        assert _post(client, f"{receiver.url}/gone", {"v": 1}, "g").status_code == 410
        assert effect_count(pg_engine) == 0

        # Served normally now; the effect commits before the (delayed) answer leaves.
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(_post(client, url, {"v": 1}, "a")))
        sender.start()
        wait_until(lambda: effect_count(pg_engine) == 1)
        assert sender.is_alive() and answers == []
        sender.join(10)
        assert [a.status_code for a in answers] == [200]
        # A replay applies nothing more.
        replay = _post(client, url, {"v": 1}, "a")
        assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
        assert effect_count(pg_engine) == 1
        # The hung POST answers once it wakes; each status is logged just after its answer leaves.
        wait_until(lambda: _statuses(pg_engine) == [None, 503, 503, 400, 410, 200, 200])


@pytest.mark.chaos
def test_receiver_killed_inside_the_effect_leaves_the_key_retryable(
    pg_url: str, pg_engine: sa.Engine
) -> None:
    doomed = start_receiver(pg_url, lock_ms=500, effect_delay_ms=30_000)
    with doomed, httpx.Client(timeout=30.0) as client:
        errors: list[BaseException] = []

        def send() -> None:
            try:
                _post(client, f"{doomed.url}/mail", {"v": 1}, "crash")
            except httpx.HTTPError as exc:
                errors.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        wait_until(lambda: _keys_in_flight(pg_engine) == 1)
        doomed.kill()
        sender.join(10)
        assert len(errors) == 1
    assert effect_count(pg_engine) == 0

    with start_receiver(pg_url) as healthy, httpx.Client(timeout=10.0) as client:
        # The dead receiver's claim expires on the database clock; then the key is taken over and applied.
        answers: list[int] = []

        def delivered() -> bool:
            answers.append(_post(client, f"{healthy.url}/mail", {"v": 1}, "crash").status_code)
            return answers[-1] == 200

        wait_until(delivered)
        assert set(answers) <= {409, 200}
        assert effect_count(pg_engine) == 1
        assert _inbox_status(pg_engine, "crash") == InboxStatus.DONE.value


def test_two_receivers_share_one_database(pg_url: str, pg_engine: sa.Engine, client: httpx.Client) -> None:
    """Both create the receiver tables at once without a race, and share the inbox: a replay on the other."""
    one, two = start_receiver(pg_url), start_receiver(pg_url)
    with one, two:
        assert _post(client, f"{one.url}/mail", {"v": 1}, "shared").status_code == 200
        replay = _post(client, f"{two.url}/mail", {"v": 1}, "shared")
        assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
        assert _post(client, f"{two.url}/mail", {"v": 2}, "shared").status_code == 422
    assert effect_count(pg_engine) == 1
    assert request_count(pg_engine) == 3


def test_separate_fresh_database_is_installed_at_startup(tmp_path: Path, client: httpx.Client) -> None:
    url = f"sqlite:///{tmp_path}/receiver-only.sqlite"
    with start_receiver(url) as receiver:
        assert _post(client, f"{receiver.url}/mail", {"v": 1}, "k").status_code == 200
    engine = create_engine(url)
    try:
        assert effect_count(engine) == 1
    finally:
        engine.dispose()


def test_helpers_read_zero_before_any_receiver_ran(engine: sa.Engine) -> None:
    assert effect_count(engine) == 0
    assert effects(engine) == []
    assert request_count(engine) == 0
    assert request_log(engine) == []


def test_start_failure_reports_the_receivers_stderr() -> None:
    with pytest.raises(AssertionError, match="database error while trying to migrate") as caught:
        start_receiver("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    assert "exit code 1" in str(caught.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--always-status-for-topic", "mail"], "TOPIC=STATUS"),
        (["--always-status-for-topic", "mail=99"], "TOPIC=STATUS"),
        (["--fail-first", "-1"], "--fail-first"),
        (["--port", "70000"], "--port"),
    ],
)
def test_bad_options_are_refused_before_starting(args: list[str], message: str) -> None:
    result = CliRunner().invoke(receiver_command, ["--database-url", "sqlite:///unused.sqlite", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_help_documents_the_testing_aids() -> None:
    result = CliRunner().invoke(receiver_command, ["--help"])
    assert result.exit_code == 0
    for flag in (
        "--fail-first",
        "--hang-first",
        "--drop-first",
        "--always-status-for-topic",
        "--effect-delay-ms",
    ):
        assert flag in result.output
    assert "[testing]" in result.output


def test_injected_faults_apply_to_the_next_posts_in_order(
    server: ReceiverServer, engine: sa.Engine, client: httpx.Client
) -> None:
    url = f"{server.url}/mail"
    server.inject_next(2, "fail", status=503)
    server.inject_next(1, "drop_after_apply")
    server.inject_next(1, "slow", seconds=1.0)

    for _ in range(2):
        failed = _post(client, url, {"v": 1}, "k")
        assert failed.status_code == 503
        assert failed.headers["content-type"] == "application/problem+json"
        assert "inject_next" in failed.json()["detail"]
    assert effect_count(engine) == 0 and _inbox_status(engine, "k") is None  # nothing applied

    with pytest.raises(httpx.RemoteProtocolError):  # applied and committed, then no answer
        _post(client, url, {"v": 1}, "k")
    assert effect_count(engine, idempotency_key="k") == 1
    assert _inbox_status(engine, "k") == InboxStatus.DONE.value

    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(_post(client, url, {"v": 2}, "other")))
    sender.start()
    wait_until(lambda: effect_count(engine, idempotency_key="other") == 1)  # committed before answering
    sender.join(10)
    assert [a.status_code for a in answers] == [200]

    replay = _post(client, url, {"v": 1}, "k")  # the queue is empty: served normally
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    server.flush_log()
    assert request_count(engine, idempotency_key="k") == 4
    assert request_count(engine, idempotency_key="other") == 1
    wait_until(lambda: _statuses(engine) == [503, 503, None, 200, 200])


def test_injected_faults_are_shared_fifo_by_concurrent_senders(
    server: ReceiverServer, engine: sa.Engine
) -> None:
    server.inject_next(5, "fail", status=502)
    statuses: list[int] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        with httpx.Client(timeout=10.0) as c:
            for j in range(3):
                status = _post(c, f"{server.url}/mail", {"v": 1}, f"k-{i}-{j}").status_code
                with lock:
                    statuses.append(status)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(30)
    assert sorted(statuses) == [200] * 7 + [502] * 5
    assert effect_count(engine) == 7


@pytest.mark.parametrize(
    ("args", "kwargs", "rule"),
    [
        ((0, "fail"), {}, "n must be an int >= 1, got 0"),
        ((True, "fail"), {}, "n must be an int >= 1, got True"),
        ((1.0, "fail"), {}, "n must be an int >= 1, got 1.0"),
        ((1, "explode"), {}, "'explode' is not a known fault; use one of fail, drop_after_apply, slow"),
        ((1, "fail"), {"status": 99}, "status must be an int from 100 to 599, got 99"),
        ((1, "fail"), {"status": 600}, "status must be an int from 100 to 599, got 600"),
        ((1, "fail"), {"status": "500"}, "status must be an int from 100 to 599, got '500'"),
        ((1, "slow"), {"seconds": -0.1}, "seconds must be a finite number of seconds >= 0, got -0.1"),
        ((1, "slow"), {"seconds": float("nan")}, "seconds must be a finite number of seconds >= 0, got nan"),
        ((1, "slow"), {"seconds": "1"}, "seconds must be a finite number of seconds >= 0, got '1'"),
    ],
)
def test_inject_next_refuses_bad_arguments(
    server: ReceiverServer, client: httpx.Client, args: tuple[Any, ...], kwargs: dict[str, Any], rule: str
) -> None:
    with pytest.raises(errors.InvalidFaultError, match=re.escape(rule)) as caught:
        server.inject_next(*args, **kwargs)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, errors.ConfigurationError)
    assert _post(client, f"{server.url}/mail", {"v": 1}, "k").status_code == 200  # nothing was queued


def test_a_truncated_body_never_reaches_the_effect(sqlite_engine: sa.Engine, serve_in_thread: Any) -> None:
    """The client's connection ends mid-body: nothing applied, no answer; the full redelivery applies."""
    server = serve_in_thread(sqlite_engine)
    body = json.dumps({"v": 1, "pad": "x" * 80}).encode()
    sock = _connect(server)
    sock.sendall(_head("cut", str(len(body))) + body[:50])
    sock.shutdown(socket.SHUT_WR)
    status, _ = _answer_then_close(sock)
    assert status in (None, 400)  # h11 may answer the broken request 400 before closing
    assert effect_count(sqlite_engine) == 0 and _inbox_status(sqlite_engine, "cut") is None

    with httpx.Client(timeout=10.0) as client:
        full = client.post(f"{server.url}/mail", content=body, headers={"Idempotency-Key": "cut"})
    assert full.status_code == 200  # not 422: the short body was never recorded under the key
    assert effects(sqlite_engine) == [("cut", "mail", body.decode())]


def test_a_body_that_never_comes_times_out(sqlite_engine: sa.Engine, serve_in_thread: Any) -> None:
    server = serve_in_thread(sqlite_engine, read_timeout_s=0.3)
    sock = _connect(server)
    sock.sendall(_head("never", "100"))
    status, data = _answer_then_close(sock)  # answered and closed; the test socket waits up to 10 s
    assert status == 408, data
    assert effect_count(sqlite_engine) == 0


def test_a_body_trickling_in_is_cut_off_while_others_are_served(
    sqlite_engine: sa.Engine, serve_in_thread: Any
) -> None:
    """One byte per 0.1 s: the body's total deadline ends it; meanwhile other clients are answered."""
    server = serve_in_thread(sqlite_engine, read_timeout_s=1.0)
    sock = _connect(server)
    sock.sendall(_head("slow", "100"))
    answered = False
    served: list[int] = []
    with httpx.Client(timeout=10.0) as client:
        for n in range(100):  # 10 s of trickling, far past the deadline
            sock.settimeout(0.1)
            try:
                answered = bool(sock.recv(1, socket.MSG_PEEK))
            except TimeoutError:
                pass
            if answered:
                break
            try:
                sock.sendall(b"x")
            except OSError:
                break
            if n < 3:  # while the drip goes on, others are served
                served.append(_post(client, f"{server.url}/mail", {"n": n}, f"other-{n}").status_code)
    sock.settimeout(10)
    status, _ = _answer_then_close(sock)
    assert status == 408
    assert served == [200, 200, 200]
    assert effect_count(sqlite_engine, idempotency_key="slow") == 0


def test_idle_keep_alive_connections_are_closed(sqlite_engine: sa.Engine, serve_in_thread: Any) -> None:
    server = serve_in_thread(sqlite_engine, idle_timeout_s=0.3)
    kept_alive = _connect(server)
    kept_alive.sendall(_head("ka", "2") + b"{}")
    status, data = _answer_then_close(kept_alive)  # answered, then closed once idle
    assert status == 200 and data.count(b"HTTP/1.1") == 1


def test_connections_beyond_the_bound_get_503(sqlite_engine: sa.Engine, serve_in_thread: Any) -> None:
    server = serve_in_thread(sqlite_engine, max_connections=2)
    held = [_connect(server), _connect(server)]
    with httpx.Client(timeout=10.0) as client:

        def refused() -> bool:
            return client.get(f"{server.url}/health").status_code == 503

        wait_until(refused)  # the two idle connections fill the bound
        for sock in held:
            sock.close()

        def served() -> bool:
            return client.get(f"{server.url}/health").status_code == 200

        wait_until(served)  # slots free up once the server sees the connections end


@pytest.mark.parametrize(
    ("headers", "statuses"),
    [
        (["Content-Length: \u00b2"], {400}),
        (["Content-Length: " + "9" * 5000], {400, 413}),
        (["Content-Length: -1"], {400}),
        (["Content-Length: 1e3"], {400}),
        (["Content-Length: 0x10"], {400}),
        (["Content-Length: 2", "Content-Length: 3"], {400}),
        (["Content-Length: 99999999999"], {413}),
        (["Content-Length: " + "0" * 50 + "2"], {400}),
        (["Transfer-Encoding: gzip"], {400, 501}),
    ],
)
def test_bad_content_length_is_answered_not_crashed_on(
    sqlite_engine: sa.Engine, serve_in_thread: Any, headers: list[str], statuses: set[int]
) -> None:
    """h11 refuses a malformed Content-Length (400); the inbox refuses an absurd one unread (413)."""
    server = serve_in_thread(sqlite_engine)
    sock = _connect(server)
    raw = ["POST /mail HTTP/1.1", "Host: receiver", "Idempotency-Key: cl", *headers]
    sock.sendall(("\r\n".join(raw) + "\r\n\r\n").encode("latin-1"))
    answered, data = _answer_then_close(sock)  # answered, then closed: the body was never read
    assert answered in statuses, data
    assert effect_count(sqlite_engine) == 0
    with httpx.Client(timeout=10.0) as client:  # the server is fine
        assert client.get(f"{server.url}/health").status_code == 200


def test_a_chunked_body_is_read_in_full(sqlite_engine: sa.Engine, serve_in_thread: Any) -> None:
    server = serve_in_thread(sqlite_engine)
    sock = _connect(server)
    sock.sendall(
        _head("chunked", None, "Transfer-Encoding: chunked", "Connection: close") + b"2\r\n{}\r\n0\r\n\r\n"
    )
    answered, _ = _answer_then_close(sock)
    assert answered == 200
    assert effects(sqlite_engine) == [("chunked", "mail", "{}")]


def test_content_length_with_leading_zeros_is_read_as_a_number(
    sqlite_engine: sa.Engine, serve_in_thread: Any
) -> None:
    server = serve_in_thread(sqlite_engine)
    sock = _connect(server)
    sock.sendall(_head("zeros", "0" * 18 + "2", "Connection: close") + b"{}")  # h11 takes 20 digits
    answered, _ = _answer_then_close(sock)
    assert answered == 200
    assert effect_count(sqlite_engine, idempotency_key="zeros") == 1


def test_database_errors_reach_the_log_not_the_client(
    serve_in_thread: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver's text names the host, port and user: clients get a generic problem document."""
    dead = create_engine("postgresql+psycopg://joblease_user@127.0.0.1:1/nowhere")
    try:
        server = serve_in_thread(dead)
        with caplog.at_level(logging.WARNING), httpx.Client(timeout=30.0) as client:
            answer = client.post(f"{server.url}/mail", content=b"{}", headers={"Idempotency-Key": "k"})
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
        assert answer.json()["detail"] == "the inbox cannot reach its database; retry later"
        for secret in ("127.0.0.1", "port 1", "joblease_user", "nowhere", "connection"):
            assert secret not in answer.text
        assert "inbox" in caplog.text  # the detail is in the log, for the operator
    finally:
        dead.dispose()


@pytest.mark.postgres_only
def test_a_burst_on_one_new_key_applies_it_once_over_http(
    pg_url: str, pg_engine: sa.Engine, serve_in_thread: Any
) -> None:
    """16 POSTs at once on one new key: one applies, the other 15 are answered 409 while it runs.

    The first one's effect is held on the database (this test holds a lock on the effect table, so the
    receiver's INSERT waits), never by a sleep.
    """
    ensure_tables(pg_engine)
    server = serve_in_thread(pg_engine)
    blocker = pg_engine.connect()
    blocker.execute(sa.text("LOCK TABLE joblease_receiver_effect IN SHARE MODE"))  # held until rollback
    answers: list[int] = []

    def send() -> None:
        with httpx.Client(timeout=30.0) as client:
            answers.append(_post(client, f"{server.url}/mail", {"v": 1}, "burst").status_code)

    senders = [threading.Thread(target=send) for _ in range(16)]
    for t in senders:
        t.start()
    try:
        wait_until(lambda: len(answers) == 15, timeout=30)
        assert _keys_in_flight(pg_engine) == 1
    finally:
        blocker.rollback()
        blocker.close()
    for t in senders:
        t.join(30)
    assert sorted(answers) == [200] + [409] * 15
    assert effect_count(pg_engine, idempotency_key="burst") == 1


def test_fencing_tokens_over_http(db_url: str, engine: sa.Engine, client: httpx.Client) -> None:
    with start_receiver(db_url) as receiver:
        url = f"{receiver.url}/mail"
        assert _post(client, url, {"v": 1}, "f", **{"Fencing-Token": "2"}).status_code == 200
        stale = _post(client, url, {"v": 1}, "f", **{"Fencing-Token": "1"})
        assert stale.status_code == 409 and stale.json()["title"] == "Stale fencing token"
        assert "taken over by a newer holder" in stale.json()["detail"]
        replay = _post(client, url, {"v": 1}, "f", **{"Fencing-Token": "3"})
        assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert effect_count(engine, idempotency_key="f") == 1


def test_retention_forgets_answered_keys(db_url: str, engine: sa.Engine, client: httpx.Client) -> None:
    """--retention: a key answered longer ago is new again (so keep it past every sender's dedupe_window)."""
    with start_receiver(db_url, "--retention", "1s") as receiver:
        url = f"{receiver.url}/mail"
        assert _post(client, url, {"v": 1}, "old").status_code == 200

        def applied_again() -> bool:
            answer = _post(client, url, {"v": 1}, "old")
            return answer.status_code == 200 and "Idempotent-Replayed" not in answer.headers

        wait_until(applied_again, timeout=30, interval=0.2)
    assert effect_count(engine, idempotency_key="old") == 2


@pytest.mark.postgres_only
def test_claims_of_the_older_two_step_consumer_are_honoured(
    pg_engine: sa.Engine, serve_in_thread: Any, client: httpx.Client
) -> None:
    """An IN_PROGRESS row: live, 409 (its lock as Retry-After) or 422; expired, it is taken over."""
    from dagster_joblease.inbox import fingerprint_request
    from dagster_joblease.inbox.asgi import RequestParts

    ensure_tables(pg_engine)
    server = serve_in_thread(pg_engine)
    url = f"{server.url}/mail"
    body = json.dumps({"v": 1}).encode()
    claim = {
        "payload_sha256": fingerprint_request(RequestParts("POST", "/mail", b"", [], body)),
        "status": InboxStatus.IN_PROGRESS.value,
        "lock_token": "t",
        "created_at": sa.func.clock_timestamp(),
    }
    with pg_engine.begin() as conn:
        for key, lock_s in (("live", 20), ("gone", -1)):
            until = sa.func.clock_timestamp() + sa.text(f"interval '{lock_s} s'")
            conn.execute(inbox_table.insert().values(idempotency_key=key, locked_until=until, **claim))
    live = _post(client, url, {"v": 1}, "live")
    assert live.status_code == 409 and 1 < int(live.headers["Retry-After"]) <= 20
    assert _post(client, url, {"v": 2}, "live").status_code == 422
    taken = _post(client, url, {"v": 2}, "gone")  # its holder is gone and left no effect
    assert taken.status_code == 200 and "Idempotent-Replayed" not in taken.headers
    assert effects(pg_engine) == [("gone", "mail", '{"v": 2}')]
    assert _inbox_status(pg_engine, "live") == InboxStatus.IN_PROGRESS.value
    assert _inbox_status(pg_engine, "gone") == InboxStatus.DONE.value


@pytest.mark.postgres_only
def test_an_effect_never_commits_without_its_stored_answer(
    pg_engine: sa.Engine, serve_in_thread: Any, client: httpx.Client
) -> None:
    """The record fails after the effect row went in: both roll back; the client sees no SQL text."""
    ensure_tables(pg_engine)
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.idempotency_key = 'boom' THEN RAISE EXCEPTION 'secret detail'; END IF; RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER refuse_boom BEFORE INSERT ON joblease_inbox"
            " FOR EACH ROW EXECUTE FUNCTION refuse_boom()"
        )
    server = serve_in_thread(pg_engine)
    answer = _post(client, f"{server.url}/mail", {"v": 1}, "boom")
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
    assert "secret" not in answer.text and "joblease" not in answer.text
    assert effect_count(pg_engine, idempotency_key="boom") == 0 and _inbox_status(pg_engine, "boom") is None
    assert _post(client, f"{server.url}/mail", {"v": 1}, "fine").status_code == 200  # the pool recovered


def test_the_log_writer_holds_back_posts_in_flight_and_keeps_arrival_order(
    sqlite_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch stops at the first young unanswered POST (its status then goes in with its row, no
    UPDATE); an unanswered one older than SETTLE_S is written with status None; flush() writes all."""
    monkeypatch.setattr(RequestLog, "LINGER_S", 3600.0)  # no background batch during the test
    log = RequestLog(sqlite_engine)
    try:
        first, second, third = (log.received(f"k{n}", "t") for n in (1, 2, 3))
        log.answered(first, 200)
        log.answered(third, 200)
        log.flush(settled_only=True)
        assert request_log(sqlite_engine) == [("k1", "t", 200)]
        second.received_at -= RequestLog.SETTLE_S  # unanswered for long (hung or dropped)
        log.flush(settled_only=True)
        assert request_log(sqlite_engine) == [("k1", "t", 200), ("k2", "t", None), ("k3", "t", 200)]
        log.answered(second, 503)
        fourth = log.received("k4", "t")
        log.flush()
        assert fourth.written
        assert request_log(sqlite_engine)[1:] == [("k2", "t", 503), ("k3", "t", 200), ("k4", "t", None)]
    finally:
        log.close()


def test_the_receiver_has_no_http_parser_of_its_own() -> None:
    """HTTP is uvicorn's and h11's: nothing under receiver/ reaches into http.server or http.client."""
    import dagster_joblease.receiver as receiver

    folder = Path(receiver.__file__).parent
    for source in folder.glob("*.py"):
        text = source.read_text()
        for banned in ("http.server", "http.client", "BaseHTTPRequestHandler", "_read_headers"):
            assert banned not in text, f"{source.name} uses {banned}"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_connections": 0}, "receiver max_connections must be an int >= 1, got 0"),
        ({"max_connections": True}, "receiver max_connections must be an int >= 1, got True"),
        ({"max_connections": 2.0}, "receiver max_connections must be an int >= 1, got 2.0"),
        (
            {"idle_timeout_s": 0},
            "receiver idle_timeout_s must be a finite number of seconds above 0 and at most 3600, got 0",
        ),
        ({"read_timeout_s": 3600.5}, "receiver read_timeout_s must be a finite number of seconds above 0"),
        ({"read_timeout_s": False}, "receiver read_timeout_s must be a finite number of seconds above 0"),
        ({"read_timeout_s": "10"}, "got '10'"),
        (
            {"retention_s": 0},
            "receiver retention_s must be None (no purge) or a finite number of seconds above 0, got 0",
        ),
        ({"http": "h2"}, "receiver http='h2' is not one of h11, httptools"),
        ({"effect_delay_ms": -1}, "effect_delay_ms must be an int number of milliseconds from 0 to"),
        ({"effect_delay_ms": True}, "got True"),
    ],
)
def test_receiver_options_refuse_what_they_cannot_serve_with(options: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.ConfigurationError) as raised:
        ReceiverOptions(**options)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_connections": 1, "idle_timeout_s": 3600, "read_timeout_s": 0.5, "effect_delay_ms": 0},
        {"retention_s": 0.1, "http": "httptools"},
    ],
)
def test_receiver_options_take_their_bounds(options: dict[str, Any]) -> None:
    assert ReceiverOptions(**options) == dataclasses.replace(ReceiverOptions(), **options)


def test_kept_alive_connections_answer_without_nagle(
    engine: sa.Engine, serve_in_thread: Callable[..., ReceiverServer]
) -> None:
    """Issue 38, scenario 0: each answer on a kept-alive connection took ~45 ms. uvicorn writes an answer's
    head and body apart; the receiver's listening socket came from ``socket.create_server`` (protocol 0),
    so asyncio never set TCP_NODELAY on what it accepted, and the body waited for the client's delayed ACK
    of the head. The connections the receiver serves must have TCP_NODELAY (read on the server's side of
    the very connection the requests came through)."""
    ensure_tables(engine)
    server = serve_in_thread(engine)
    with httpx.Client(timeout=10.0) as kept:
        for n in range(3):
            assert _post(kept, server.url + "/mail", {"n": n}, f"nagle-{n}").status_code == 200
        uvicorn_server = server._runtime.server
        assert uvicorn_server is not None
        sockets = [
            protocol.transport.get_extra_info("socket")
            for protocol in uvicorn_server.server_state.connections
        ]
        assert len(sockets) == 1  # the one kept-alive connection
        assert sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_the_receiver_on_postgresql_needs_no_greenlet(pg_url: str) -> None:
    """Issue 38, scenario 5: SQLAlchemy 2.1 no longer installs greenlet, and `joblease receiver` on
    PostgreSQL failed at start in a clean `[receiver]` install: AsyncInbox imported SQLAlchemy's asyncio
    layer (which needs greenlet) even for a psycopg pool. Here, in a process where greenlet cannot be
    imported, the receiver's inbox is built on its pool and applies a key. (.ci/smoke-extras installs each
    extra in a clean venv; `[receiver]` now also names sqlalchemy[asyncio].)"""
    script = """
import sys
sys.modules["greenlet"] = None  # importing it raises ImportError, as in a venv without it
import anyio
from psycopg_pool import AsyncConnectionPool
from dagster_joblease.inbox.aio import AsyncInbox

async def main():
    async with AsyncConnectionPool(sys.argv[1], min_size=1, max_size=1) as pool:
        inbox = AsyncInbox(pool.connection)
        async def effect(conn):
            return 200, "applied"
        print((await inbox.process("no-greenlet", b"{}", effect)).body)

anyio.run(main)
"""
    conninfo = "postgresql://" + pg_url.split("://", 1)[1]
    done = subprocess.run(
        [sys.executable, "-c", script, conninfo], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "applied"


def test_a_topic_with_a_nul_is_refused_and_the_request_log_goes_on(
    db_url: str, engine: sa.Engine, server: ReceiverServer, client: httpx.Client
) -> None:
    """A hostile path (``%00`` decodes to a NUL, which PostgreSQL's text refuses) is answered 400 and
    never reaches the effect; its request-log row is written with the NUL shown as U+FFFD, so the log's
    batches keep being written for everyone else (a failing row used to be retried forever with the rest
    of its batch, and no later POST reached the log)."""
    bad = _post(client, f"{server.url}/a%00b", {"v": 1}, "nul-topic")
    assert bad.status_code == 400, bad.text
    assert "control character" in bad.json()["detail"]
    assert _post(client, f"{server.url}/mail", {"v": 1}, "after-nul").status_code == 200
    assert effect_count(engine) == 1
    wait_until(lambda: len(request_log(engine)) == 2, timeout=10)
    assert request_log(engine) == [("nul-topic", "a\ufffdb", 400), ("after-nul", "mail", 200)]
