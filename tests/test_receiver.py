"""The reference receiver over real HTTP, in its own process, on real databases."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from dagster_joblease import errors
from dagster_joblease.inbox import InboxStatus
from dagster_joblease.receiver import (
    ReceiverServer,
    effect_count,
    effects,
    ensure_tables,
    receiver_command,
    request_count,
    request_log,
)
from dagster_joblease.storage import create_engine, inbox_table
from tests.conftest import wait_until
from tests.receiver_proc import start_receiver


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as c:
        yield c


@pytest.fixture
def server(engine: sa.Engine) -> Iterator[ReceiverServer]:
    """A receiver in this process, served from a thread (how the testing kit runs one)."""
    ensure_tables(engine)
    srv = ReceiverServer(engine, ("127.0.0.1", 0))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(10)
    assert not thread.is_alive()


def _post(client: httpx.Client, url: str, payload: object, key: str | None) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return client.post(url, content=json.dumps(payload).encode(), headers=headers)


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
        assert request_count(engine) == 5
        assert request_count(engine, idempotency_key="k-1") == 2  # the quoted spelling is logged raw
        # The receiver logs a status just after its answer leaves: wait for the last one.
        wait_until(lambda: None not in [status for _, _, status in request_log(engine)])
        assert [status for _, _, status in request_log(engine)] == [400, 200, 200, 422, 200]

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
        wait_until(lambda: _inbox_status(pg_engine, "slow") == InboxStatus.IN_PROGRESS.value)
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
        assert request_count(pg_engine) == 3


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
        wait_until(lambda: request_log(pg_engine)[1][2] == 503)  # the hung POST answers once it wakes
        wait_until(lambda: request_log(pg_engine)[-1][2] == 200)  # logged just after its answer leaves
        assert [s for _, _, s in request_log(pg_engine)] == [None, 503, 503, 400, 410, 200, 200]


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
        wait_until(lambda: _inbox_status(pg_engine, "crash") == InboxStatus.IN_PROGRESS.value)
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
    wait_until(lambda: request_log(engine)[-1][2] == 200)
    assert [s for _, _, s in request_log(engine)] == [503, 503, None, 200, 200]


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
        ((0, "fail"), {}, "n=0 must be an int >= 1"),
        ((True, "fail"), {}, "n=True"),
        ((1.0, "fail"), {}, "n=1.0"),
        ((1, "explode"), {}, "'explode' is not a known fault; use one of fail, drop_after_apply, slow"),
        ((1, "fail"), {"status": 99}, "status=99"),
        ((1, "fail"), {"status": 600}, "status=600"),
        ((1, "fail"), {"status": "500"}, "status='500'"),
        ((1, "slow"), {"seconds": -0.1}, "seconds=-0.1"),
        ((1, "slow"), {"seconds": float("nan")}, "seconds=nan"),
        ((1, "slow"), {"seconds": "1"}, "seconds='1'"),
    ],
)
def test_inject_next_refuses_bad_arguments(
    server: ReceiverServer, client: httpx.Client, args: tuple[Any, ...], kwargs: dict[str, Any], rule: str
) -> None:
    with pytest.raises(errors.InvalidFaultError, match=re.escape(rule)) as caught:
        server.inject_next(*args, **kwargs)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, errors.ConfigurationError)
    assert _post(client, f"{server.url}/mail", {"v": 1}, "k").status_code == 200  # nothing was queued
