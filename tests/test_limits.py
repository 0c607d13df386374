"""Global delivery limits across real dispatcher processes: max_in_flight, rate, route pauses, the key's
retention window, slots freed by expiry after a SIGKILL. Assertions are about bounds ("never above the
cap"), never about throughput: the machine is shared and loaded."""

from __future__ import annotations

import bisect
import datetime as dt
import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import limits
from dagster_joblease.dispatch import Dispatcher, Route
from dagster_joblease.storage import create_engine, route_groups
from dagster_joblease.storage import outbox as outbox_store
from dagster_joblease.storage.clock import db_now, db_now_plus_ms
from dagster_joblease.storage.schema import outbox_table, route_group_table
from tests import dispatch_workers
from tests.conftest import wait_until
from tests.dispatch_workers import enqueue_many, status_counts
from tests.limit_server import serve

CTX = multiprocessing.get_context("spawn")
FAST = {"backoff_base_ms": 10, "backoff_max_ms": 100}


def _join(process: BaseProcess, timeout: float = 180) -> None:
    process.join(timeout)
    assert not process.is_alive(), f"dispatcher process {process.pid} did not finish within {timeout} s"
    assert process.exitcode == 0


def _results(paths: list[Path]) -> list[dict[str, Any]]:
    return [dict(json.loads(p.read_text())) for p in paths]


def _group(engine: sa.Engine, name: str) -> Any:
    g = route_group_table
    with engine.connect() as conn:
        return conn.execute(sa.select(g).where(g.c.limit_group == name)).first()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_max_in_flight_holds_across_dispatcher_processes(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    url = str(request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url"))
    engine = create_engine(url)
    keys = enqueue_many(engine, 60, topic="work")
    with serve(latency_s=0.05) as server:
        routes = {"work": {"url": server.url + "/work", "max_in_flight": 3}}
        paths = [tmp_path / f"d{i}.json" for i in range(3)]
        workers = [
            processes(dispatch_workers.drain, url, routes, {"concurrency": 8, **FAST}, str(p), 100)
            for p in paths
        ]
        for worker in workers:
            _join(worker)
        assert server.max_in_flight <= 3, f"{server.max_in_flight} requests were in flight at once"
        assert sorted(k for _, _, k, _ in server.requests) == keys  # each key once
    assert status_counts(engine) == {"SENT": 60}
    assert sum(r["sent"] for r in _results(paths)) == 60
    group = _group(engine, server.url)
    assert group is not None and group.max_in_flight == 3
    with engine.connect() as conn:  # every slot was given back: no claim holds the group any more
        assert outbox_store.count_in_flight(conn, server.url) == 0
    engine.dispose()


def test_slots_of_a_sigkilled_dispatcher_free_by_expiry_on_the_database_clock(
    pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(pg_url)
    enqueue_many(engine, 6, topic="work")
    with serve() as server:
        server.hold.set()  # the downstream holds every request: the dispatcher keeps its slots
        routes = {"work": {"url": server.url + "/work", "max_in_flight": 2}}
        victim = processes(
            dispatch_workers.drain, pg_url, routes, {"concurrency": 8}, str(tmp_path / "v.json")
        )
        wait_until(lambda: server.in_flight == 2, timeout=60)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
        server.hold.clear()
        server.released.set()
        with engine.connect() as conn:
            assert outbox_store.count_in_flight(conn, server.url) == 2  # the dead dispatcher's claims
        with Dispatcher(engine, dispatch_workers._routes(routes), concurrency=8) as survivor:
            report = survivor.dispatch()
            assert report.claimed == 0 and server.url in report.limited  # no slot while the claims live
            # The claims expire (written in the past on the database clock, as if claim_ms had passed).
            t = outbox_table
            with engine.begin() as conn:
                conn.execute(
                    sa.update(t)
                    .where(t.c.claim_token.is_not(None))
                    .values(claim_expires_at=db_now_plus_ms(sa.literal(-1000, sa.BigInteger())))
                )
            deadline = time.monotonic() + 60
            while status_counts(engine).get("PENDING", 0) and time.monotonic() < deadline:
                survivor.dispatch()
        assert status_counts(engine) == {"SENT": 6}
        assert server.max_in_flight <= 2
    engine.dispose()


def test_rate_never_exceeds_the_limit_in_any_second_across_processes(
    pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(pg_url)
    enqueue_many(engine, 45, topic="work")
    with serve(latency_s=0.01) as server:
        routes = {"work": {"url": server.url + "/work", "rate": 15}}
        paths = [tmp_path / f"r{i}.json" for i in range(3)]
        workers = [
            processes(dispatch_workers.drain, pg_url, routes, {"concurrency": 8, **FAST}, str(p), 100)
            for p in paths
        ]
        for worker in workers:
            _join(worker)
        assert len(server.requests) == 45
    # What the dispatchers control is when each request starts: at most 15 in any one second across the
    # three processes (one monotonic clock for the machine). When requests *arrive* also depends on how
    # the network and a loaded machine delay them, which no test controls (limits.RATE_SLACK leaves room).
    sent_at = sorted(t for r in _results(paths) for t in r["sent_at"])
    assert len(sent_at) == 45
    busiest = max(bisect.bisect_left(sent_at, t + 1.0) - i for i, t in enumerate(sent_at))
    assert busiest <= 15, f"{busiest} requests started within one second"
    assert status_counts(engine) == {"SENT": 45}
    engine.dispose()


def test_retry_after_pauses_the_group_for_every_dispatcher_and_other_groups_flow(
    pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(pg_url)
    enqueue_many(engine, 5, topic="slow", prefix="v2:slow")
    enqueue_many(engine, 20, topic="fast", prefix="v2:fast")

    def respond(path: str, number: int) -> tuple[int, dict[str, str]]:
        return (429, {"Retry-After": "3600"}) if path == "/slow" and number == 1 else (200, {})

    with serve(latency_s=0.01, respond=respond) as server:
        # max_in_flight=1: the 429's slot is freed in the transaction that records the pause, so no other
        # request of the group can start in between; the other route has its own group (limit_group).
        routes = {
            "slow": {"url": server.url + "/slow", "max_in_flight": 1, "max_pause_s": 3600},
            "fast": {"url": server.url + "/fast", "limit_group": "fast"},
        }
        dispatchers = [
            Dispatcher(engine, dispatch_workers._routes(routes), concurrency=4, **FAST) for _ in range(2)
        ]
        try:
            deadline = time.monotonic() + 60
            while status_counts(engine).get("SENT", 0) < 20 and time.monotonic() < deadline:
                for d in dispatchers:
                    d.dispatch()
            t = outbox_table
            with engine.connect() as conn:
                slow = conn.execute(sa.select(t).where(t.c.topic == "slow").order_by(t.c.id)).all()
                fast_sent = conn.execute(
                    sa.select(sa.func.count()).where(t.c.topic == "fast", t.c.status == "SENT")
                ).scalar_one()
            assert fast_sent == 20  # the other group kept flowing
            assert [r.status for r in slow] == ["PENDING"] * 5
            assert len(server.arrivals("/slow")) == 1  # only the 429'd request: every dispatcher held off
            hit = next(r for r in slow if r.last_status == 429)
            assert hit.attempts == 0 and hit.deferrals == 1  # not counted against max_attempts
            group = _group(engine, server.url)
            assert group.paused_until is not None and "429" in group.pause_reason
            report = dispatchers[1].dispatch()
            assert report.claimed == 0 and server.url in report.paused
            # The pause ends (written in the past on the database clock): the group flows again.
            with engine.begin() as conn:
                conn.execute(
                    sa.update(route_group_table).values(
                        paused_until=db_now_plus_ms(sa.literal(-1000, sa.BigInteger()))
                    )
                )
                conn.execute(sa.update(t).where(t.c.topic == "slow").values(next_attempt_at=db_now()))
            while status_counts(engine).get("PENDING", 0) and time.monotonic() < deadline:
                dispatchers[0].dispatch()
            assert status_counts(engine) == {"SENT": 25}
        finally:
            for d in dispatchers:
                d.close()
    engine.dispose()


def _one(engine: sa.Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(outbox_table)).one()


def test_retention_window_dead_letters_instead_of_resending_and_requeue_restarts_it(
    engine: sa.Engine,
) -> None:
    from dagster_joblease import admin

    enqueue_many(engine, 1, topic="work")
    with serve(latency_s=0.0, respond=lambda path, n: (500, {}) if n == 1 else (200, {})) as server:
        route = Route(server.url + "/work", dedupe_window="1h", timeout_s=5)
        with Dispatcher(engine, {"work": route}, **FAST) as dispatcher:
            first = dispatcher.dispatch()
            assert first.retried == 1
            row = _one(engine)
            assert row.first_attempt_at is not None  # recorded by the first claim
            # The first attempt was 2 hours ago (written on the database clock).
            with engine.begin() as conn:
                conn.execute(
                    sa.update(outbox_table).values(
                        first_attempt_at=db_now_plus_ms(sa.literal(-2 * 3_600_000, sa.BigInteger())),
                        next_attempt_at=db_now(),
                    )
                )
            report = dispatcher.dispatch()
            assert report.dead == 1 and report.expired == 1 and report.claimed == 0
            assert len(server.requests) == 1  # not sent again
            row = _one(engine)
            assert row.status == "DEAD" and "dedupe_window" in row.last_error
            assert "forgotten the key" in row.last_error
            assert admin.requeue(engine, row_id=row.id) == 1
            assert _one(engine).first_attempt_at is None  # a person's requeue restarts the window
            assert dispatcher.dispatch().sent == 1
    assert _one(engine).status == "SENT"


def test_sf_string_key_format_quotes_the_key_and_bare_is_the_default(engine: sa.Engine) -> None:
    keys = enqueue_many(engine, 1, topic="sf") + enqueue_many(engine, 1, topic="bare", prefix="v2:b")
    with serve(latency_s=0.0) as server:
        routes = {
            "sf": Route(server.url + "/sf", key_format="sf-string"),
            "bare": Route(server.url + "/bare"),
        }
        with Dispatcher(engine, routes) as dispatcher:
            assert dispatcher.dispatch().sent == 2
        headers = {path: key for _, path, key, _ in server.requests}
    assert headers == {"/sf": f'"{keys[0]}"', "/bare": keys[1]}


def test_the_smallest_configured_limit_applies_and_the_mismatch_is_logged(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue_many(engine, 4, topic="work")
    with serve(latency_s=0.0) as server:
        small = Dispatcher(engine, {"work": Route(server.url + "/work", limit_group="g", max_in_flight=2)})
        large = Dispatcher(engine, {"work": Route(server.url + "/work", limit_group="g", max_in_flight=9)})
        with small, large:
            small.dispatch(limit=1)
            with caplog.at_level("WARNING", logger="dagster_joblease"):
                large.dispatch(limit=1)
            assert _group(engine, "g").max_in_flight == 2
            assert any(getattr(r, "action", None) == "limit_mismatch" for r in caplog.records)
            # Once the small registration lapses, the larger value takes over.
            with engine.begin() as conn:
                conn.execute(
                    sa.update(route_group_table).values(
                        max_in_flight_until=db_now_plus_ms(sa.literal(-1000, sa.BigInteger()))
                    )
                )
            large.dispatch(limit=1)
            assert _group(engine, "g").max_in_flight == 9


def test_rate_admissions_are_spaced_and_never_burst() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    first = limits.admit_rate(100, None, now, want=8)
    assert first.count == 8 and first.offsets_ms[0] == 0
    gaps = {round(b - a, 6) for a, b in zip(first.offsets_ms, first.offsets_ms[1:], strict=False)}
    assert gaps == {round(limits.rate_spacing_ms(100), 6)}
    # An idle group does not bank admissions: a next_at long past starts at now, not in a burst.
    idle = limits.admit_rate(100, now - dt.timedelta(hours=1), now, want=3)
    assert idle.offsets_ms[0] == 0 and idle.count == 3
    # Admissions are handed out at most RATE_HORIZON_MS ahead.
    far = limits.admit_rate(1, now + dt.timedelta(seconds=5), now, want=3)
    assert far.count == 0 and far.wait_ms > 0
    # In any window of one second there are never more admissions than the rate.
    assert 1000 / limits.rate_spacing_ms(100) <= 100


def test_applied_limit_keeps_the_smallest_live_value() -> None:
    assert limits.applied_limit(4, None, False) == limits.Applied(4, register=True)
    assert limits.applied_limit(4, 8, True) == limits.Applied(4, register=True)
    assert limits.applied_limit(8, 4, True) == limits.Applied(4, register=False, mismatch=True)
    assert limits.applied_limit(8, 4, False) == limits.Applied(8, register=True)
    assert limits.applied_limit(None, 4, True) == limits.Applied(4, register=False)
    assert limits.applied_limit(None, 4, False) == limits.Applied(None, register=False)


def test_nothing_of_a_group_is_claimed_once_its_pause_is_known(pg_url: str) -> None:
    """A 429 answered while another request of the group is in flight: the pause is in the database
    before that request's answer comes back, and the slot it frees is not refilled (no row of the group
    is claimed after the pause: a claim stamps first_attempt_at, which a give-back does not clear)."""
    engine = create_engine(pg_url)
    enqueue_many(engine, 8, topic="slow", prefix="v2:slow")
    group = "slow-group"

    def paused() -> bool:
        row = _group(engine, group)
        return row is not None and row.paused_until is not None

    def respond(path: str, number: int) -> tuple[int, dict[str, str]]:
        if number == 1:
            return 429, {"Retry-After": "3600"}
        wait_until(paused, timeout=60)  # the second request is answered only once the pause committed
        return 200, {}

    with serve(latency_s=0.01, respond=respond) as server:
        route = Route(server.url + "/slow", limit_group=group, max_in_flight=2, max_pause_s=3600)
        with Dispatcher(engine, {"slow": route}, concurrency=4, **FAST) as dispatcher:
            report = dispatcher.dispatch()
        assert len(server.arrivals("/slow")) == 2  # the two requests that held the slots
    assert report.sent == 1 and report.deferred == 1 and report.claimed == 2
    t = outbox_table
    with engine.connect() as conn:
        never = conn.execute(
            sa.select(sa.func.count()).where(t.c.topic == "slow", t.c.first_attempt_at.is_(None))
        ).scalar_one()
    assert never == 6  # the slots the 429 and the 200 freed were not refilled during the pause
    engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_a_pause_another_dispatcher_opens_stops_rows_waiting_to_start(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Rows claimed before the pause existed and still waiting for a worker are given back, not sent, once
    the dispatcher's periodic re-read of pauses sees a pause that another dispatcher wrote meanwhile."""
    url = str(request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url"))
    engine = create_engine(url)
    enqueue_many(engine, 10, topic="work")
    with serve(latency_s=0.0) as server:
        server.hold.set()  # every request waits for server.released
        with Dispatcher(engine, {"work": Route(server.url + "/work")}, concurrency=2, **FAST) as dispatcher:
            reports: list[Any] = []
            worker = threading.Thread(target=lambda: reports.append(dispatcher.dispatch(limit=10)))
            worker.start()
            try:
                wait_until(lambda: server.in_flight == 2, timeout=30)  # both workers busy, 8 waiting
                with engine.begin() as conn:  # as another dispatcher's 429 would write it
                    route_groups.record_pause(conn, server.url, 3_600_000, "429 elsewhere")
                wait_until(lambda: dispatcher._shared.pauses.holds(server.url, time.monotonic()), timeout=30)
            finally:
                server.released.set()
                worker.join(60)
            assert not worker.is_alive()
    (report,) = reports
    assert len(server.arrivals()) == 2  # the 8 waiting rows were not sent
    assert report.claimed == 10 and report.sent == 2 and report.released == 8, report
    assert status_counts(engine) == {"SENT": 2, "PENDING": 8}
    engine.dispose()
