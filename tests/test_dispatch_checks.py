"""Checks the dispatcher makes where they matter, against real PostgreSQL and a downstream that records each
request's start and end (tests/limit_server.py): the dedupe window at the moment of sending, the window
not started by a claim given back undelivered. Assertions are bounds on what the downstream saw."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from dagster_joblease import cli
from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.errors import ConfigurationError, StorageError
from dagster_joblease.storage import create_engine, migrate, route_groups
from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.storage.schema import outbox_table, route_group_table
from tests.conftest import wait_until
from tests.dispatch_workers import enqueue_many
from tests.limit_server import serve


def _rows(engine: sa.Engine) -> dict[str, sa.Row[tuple[object, ...]]]:
    t = outbox_table
    with engine.connect() as conn:
        return {r.idempotency_key: r for r in conn.execute(sa.select(t).order_by(t.c.id))}


def test_the_dedupe_window_is_checked_when_a_request_starts_not_only_at_claim(engine: sa.Engine) -> None:
    # Ten retried rows whose first attempt was 4 s ago, a 12 s window and a 2.5 s timeout: all may be
    # claimed (4 + 2.5 < 12), but two workers take them two at a time and the downstream holds each request
    # 2 s, so the pairs would start 4, 6, 8, 10 and 12 s after their first attempt. A request may start
    # only while its whole timeout fits in the window (age < 9.5 s): the last pairs go DEAD unsent.
    keys = enqueue_many(engine, 10, topic="w")
    with engine.begin() as conn:
        conn.execute(
            sa.update(outbox_table).values(
                first_attempt_at=db_now_plus_ms(sa.literal(-4_000, sa.BigInteger())), attempts=1
            )
        )
    window_s, timeout_s = 12.0, 2.5
    with serve(latency_s=2.0) as server:
        route = Route(server.url + "/w", dedupe_window=window_s, timeout_s=timeout_s)
        with Dispatcher(engine, {"w": route}, concurrency=2, backoff_base_ms=10) as dispatcher:
            report = dispatcher.dispatch(limit=100)
    rows = _rows(engine)
    first = {key: r.first_attempt_at.timestamp() for key, r in rows.items()}
    started = {key: start for start, _end, _path, key in server.spans}
    late = {key: round(start - first[key], 2) for key, start in started.items() if start - first[key] >= 10.5}
    assert not late, f"requests started this long after their first attempt (window {window_s} s): {late}"
    dead = [key for key, r in rows.items() if r.status == "DEAD"]
    assert dead, "the last rows cannot start inside their window and must be dead-lettered"
    assert all(rows[key].status == "SENT" for key in started)
    assert set(dead) | set(started) == set(keys) and not set(dead) & set(started)  # dead ones never sent
    for key in dead:
        assert "dedupe_window" in rows[key].last_error and "forgotten the key" in rows[key].last_error
        assert rows[key].attempts == 1  # the claim's count is undone: nothing was sent
    assert report.dead == report.expired == len(dead) and report.sent == len(started)


def test_a_claim_given_back_undelivered_does_not_start_the_dedupe_window(
    db_url: str, engine: sa.Engine, tmp_path: Path
) -> None:
    # One limit group, two topics: the first row sent (topic a) is answered 429 with Retry-After, which
    # pauses the group, so the four rows of topic w waiting behind it (concurrency 1) are given back
    # unsent. Their window (2 s) must not have started: after it, `dispatch --once` sends them, exit 0.
    enqueue_many(engine, 1, topic="a", prefix="v2:a")
    keys = enqueue_many(engine, 4, topic="w", prefix="v2:w")

    def respond(path: str, number: int) -> tuple[int, dict[str, str]]:
        return (429, {"Retry-After": "1"}) if path == "/a" and number == 1 else (200, {})

    with serve(latency_s=0.0, respond=respond) as server:
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f'[a]\nurl = "{server.url}/a"\nlimit_group = "g"\n'
            f'[w]\nurl = "{server.url}/w"\nlimit_group = "g"\ndedupe_window = 2\ntimeout_s = 1\n'
        )
        first = _cli(db_url, "dispatch", "--once", "--concurrency", "1", "--routes", str(routes))
        assert first.exit_code == 0, first.output
        assert server.per_path == {"/a": 1}  # the rows of w never reached the downstream
        rows = _rows(engine)
        assert [rows[k].status for k in keys] == ["PENDING"] * 4
        assert [rows[k].first_attempt_at for k in keys] == [None] * 4
        assert [rows[k].attempts for k in keys] == [0] * 4
        time.sleep(2.5)  # past the window (and the 1 s pause) had a give-back started it
        second = _cli(db_url, "dispatch", "--once", "--concurrency", "1", "--routes", str(routes))
        assert second.exit_code == 0, second.output
        assert server.per_path == {"/a": 2, "/w": 4}
    rows = _rows(engine)
    assert {r.status for r in rows.values()} == {"SENT"}
    assert all(rows[k].first_attempt_at is not None for k in keys)  # stamped by the claim that sent them


def _cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(cli.main, ["--database-url", url, *args], catch_exceptions=False)


def test_max_deferrals_2_dead_letters_after_two_deferrals_not_one(pg_engine: sa.Engine) -> None:
    (key,) = enqueue_many(pg_engine, 1, topic="busy")
    with serve(latency_s=0.0, respond=lambda path, n: (429, {"Retry-After": "0"})) as server:
        route = Route(server.url + "/busy", max_pause_s=1)
        with Dispatcher(pg_engine, {"busy": route}, max_deferrals=2, backoff_base_ms=10) as dispatcher:
            outcomes = []
            for _ in range(10):
                report = dispatcher.dispatch()
                outcomes += [r.outcome for r in report.rows]
                if report.dead:
                    break
                time.sleep(0.01)  # past the 1 ms pause and deferral
    row = _rows(pg_engine)[key]
    assert outcomes == ["retry", "retry", "dead"], outcomes
    assert row.status == "DEAD" and row.deferrals == 2
    assert "gave up after 2 Retry-After deferrals" in row.last_error
    assert server.per_path == {"/busy": 3}


def test_a_retry_after_of_unicode_digits_is_an_http_429_not_a_connection_failure(
    pg_engine: sa.Engine,
) -> None:
    # "²" passes str.isdigit(); the old parser's int() raised, and the dispatcher judged the exception as a
    # failure to get any answer (status None: what pause_after_failures counts).
    (key,) = enqueue_many(pg_engine, 1, topic="odd")
    with serve(latency_s=0.0, respond=lambda path, n: (429, {"Retry-After": "²"})) as server:
        route = Route(server.url + "/odd", pause_after_failures=1)
        with Dispatcher(pg_engine, {"odd": route}, backoff_base_ms=10) as dispatcher:
            report = dispatcher.dispatch()
    (outcome,) = report.rows
    assert (outcome.outcome, outcome.status_code) == ("retry", 429)
    row = _rows(pg_engine)[key]
    assert row.last_status == 429 and row.last_error.startswith("HTTP 429") and row.deferrals == 0
    with pg_engine.connect() as conn:
        group = conn.execute(sa.select(route_group_table)).first()
    assert group is None or (group.failures == 0 and group.paused_until is None)  # not a connection failure


def test_outbox_resume_ends_a_pause_early_even_for_a_dispatcher_that_knows_of_it(
    pg_url: str, pg_engine: sa.Engine
) -> None:
    keys = enqueue_many(pg_engine, 3, topic="mail")
    with serve(latency_s=0.0) as server:
        route = Route(server.url + "/mail", limit_group="mailer")
        with Dispatcher(pg_engine, {"mail": route}) as dispatcher:
            with pg_engine.begin() as conn:
                route_groups.record_pause(
                    conn, "mailer", 600_000, "HTTP 429 with Retry-After from topic mail"
                )
            held = dispatcher.dispatch()
            assert held.claimed == 0 and "mailer" in held.paused  # the dispatcher knows of the pause now
            resumed = _cli(pg_url, "outbox", "resume", "mailer")
            assert resumed.exit_code == 0, resumed.output
            assert "limit group mailer: pause ended" in resumed.output and "HTTP 429" in resumed.output
            report = dispatcher.dispatch()
            assert report.sent == 3 and not report.paused
        assert server.per_path == {"/mail": 3}
    assert {_rows(pg_engine)[k].status for k in keys} == {"SENT"}
    again = _cli(pg_url, "outbox", "resume", "mailer")
    assert again.exit_code == 1 and "limit group 'mailer' is not paused" in again.output
    assert "no limit group is paused now" in again.output


def test_a_timed_out_request_keeps_its_slot_so_the_downstream_never_sees_more_than_max_in_flight(
    pg_engine: sa.Engine,
) -> None:
    # Cap 3, timeout 0.5 s, a downstream that holds every request 1.0 s: each request times out while the
    # downstream is still working on it. Freeing its slot at the timeout let the next requests start on
    # top of it (the downstream saw 6 at once); with a grace of 2 s (timeout + grace > 1.0 s) it sees 3.
    enqueue_many(pg_engine, 12, topic="slow")
    with serve(latency_s=1.0) as server:
        route = Route(server.url + "/slow", max_in_flight=3, timeout_s=0.5, timeout_grace_s=2.0)
        with Dispatcher(pg_engine, {"slow": route}, concurrency=8, backoff_base_ms=10) as dispatcher:
            stop_at = time.monotonic() + 6.0
            while time.monotonic() < stop_at:
                dispatcher.dispatch()
                time.sleep(0.01)
        wait_until(lambda: server.in_flight == 0, timeout=10)
        assert len(server.spans) >= 6  # the cap was exercised: several rounds of requests
        assert server.most_at_once("/slow") <= 3, server.most_at_once("/slow")


def test_timeout_grace_defaults_to_the_timeout_and_is_validated() -> None:
    assert Route("http://h/x", timeout_s=4).slot_grace_s == 4.0
    assert Route("http://h/x", timeout_s=4, timeout_grace_s=0).slot_grace_s == 0.0
    for bad in (-1, "1s", True, 601):
        with pytest.raises(ConfigurationError, match="timeout_grace_s"):
            Route("http://h/x", timeout_grace_s=bad)  # type: ignore[arg-type]


def test_a_slow_limited_route_never_holds_back_an_unlimited_rows_enqueued_mid_batch(
    pg_engine: sa.Engine,
) -> None:
    # 30 rows of a max_in_flight=1 route answered in 0.4 s each keep one batch busy for 12 s; a row of an
    # unlimited route enqueued once that batch runs must not wait for it to end (the old refills claimed
    # only limited topics: it arrived after all 30).
    enqueue_many(pg_engine, 30, topic="slow", prefix="v2:slow")
    with serve(latency_s=0.4) as server:
        routes = {
            "slow": Route(server.url + "/slow", max_in_flight=1, limit_group="slow"),
            "fast": Route(server.url + "/fast"),  # its own group (the URL's origin), no limits
        }
        stop = threading.Event()
        with Dispatcher(pg_engine, routes, concurrency=4) as dispatcher:
            worker = threading.Thread(target=dispatcher.run, kwargs={"stop": stop, "poll_interval_s": 0.05})
            worker.start()
            try:
                wait_until(lambda: len(server.arrivals("/slow")) >= 3, timeout=60)
                (fast,) = enqueue_many(pg_engine, 1, topic="fast", prefix="v2:fast")
                wait_until(lambda: server.per_path.get("/fast", 0) == 1, timeout=60)
                slow_before = len(server.arrivals("/slow"))
            finally:
                stop.set()
                worker.join(60)
    assert slow_before <= 15, f"the unlimited row waited for {slow_before} of the limited route's 30 requests"
    assert _rows(pg_engine)[fast].status == "SENT"


def test_a_running_dispatcher_survives_the_retyping_upgrade(url_at_0005: str) -> None:
    # Migration 0006 retypes outbox.attempts to a domain; the claim returns it. A statement psycopg had
    # prepared (after five runs on the pooled connection) then failed once: "cached plan must not change
    # result type", a dispatch() that raised StorageError mid-upgrade.
    engine = create_engine(url_at_0005)
    with engine.begin() as conn:  # 0008's and 0010's columns, added ahead: this code's claim reads them
        conn.exec_driver_sql("ALTER TABLE joblease_outbox ADD COLUMN ordering_key VARCHAR(128)")
        conn.exec_driver_sql("ALTER TABLE joblease_outbox ADD COLUMN traceparent VARCHAR(128)")
        conn.exec_driver_sql("ALTER TABLE joblease_outbox ADD COLUMN tracestate VARCHAR(512)")
    errors_seen: list[str] = []
    sent: list[int] = []
    with serve(latency_s=0.0) as server, Dispatcher(engine, {"w": Route(server.url + "/w")}) as dispatcher:

        def rounds(count: int, prefix: str) -> None:
            for i in range(count):
                enqueue_many(engine, 2, topic="w", prefix=f"v2:{prefix}{i}")
                try:
                    sent.append(dispatcher.dispatch().sent)
                except StorageError as exc:
                    errors_seen.append(str(exc))

        rounds(8, "before")
        admin = create_engine(url_at_0005, poolclass=sa.pool.NullPool)
        try:
            migrate(admin, "0006")
        finally:
            admin.dispose()
        rounds(8, "after")
    engine.dispose()
    assert errors_seen == []
    assert sent == [2] * 16  # each round's rows, in its own round
