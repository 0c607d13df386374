"""Per-key ordering, the delivery side, with a real downstream that records each request's start and the
moment right before its answer is written (tests/limit_server.py ``answers``): rows of one ordering key
reach it one at a time and in enqueue order, across several dispatcher processes and SIGKILLs of them;
rows of other keys flow past a stuck key; a retrying row holds its key back; a DEAD row blocks its key,
visibly, until it is requeued or skipped.

Nothing here measures time: "one at a time" is "row n+1 of a key started after row n's last answer was
about to be written", which no client can reach earlier, and every wait polls a condition with a generous
deadline.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from dagster_joblease import admin, cli, outbox
from dagster_joblease.dispatch.dispatcher import Dispatcher
from dagster_joblease.dispatch.routes import Route
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import outbox_table
from tests import dispatch_workers
from tests.conftest import wait_until
from tests.dispatch_workers import status_counts
from tests.limit_server import LimitServer, serve

FAST = {"backoff_base_ms": 10, "backoff_max_ms": 100}


def _items(keys: list[str], rows: int, topic: str = "work") -> list[outbox.OutboxItem]:
    """``rows`` rows per ordering key, enqueued round-robin (key a's row 0, key b's row 0, …); each row's
    idempotency key is ``<ordering key>/<seq>``."""
    return [
        outbox.OutboxItem(f"{key}/{seq:03d}", topic, {"key": key, "seq": seq}, key)
        for seq in range(rows)
        for key in keys
    ]


def _enqueue(engine: sa.Engine, items: list[Any]) -> None:
    with engine.begin() as conn:
        outbox.enqueue_many(conn, items)


def _expected(items: list[Any]) -> dict[str, list[str]]:
    """Ordering key → its rows' idempotency keys in enqueue order."""
    order: dict[str, list[str]] = {}
    for item in items:
        if len(item) > 3 and item[3] is not None:
            order.setdefault(item[3], []).append(item[0])
    return order


def assert_one_at_a_time_in_order(server: LimitServer, expected: dict[str, list[str]]) -> None:
    """For each ordering key: every row reached the downstream, and each row's first request started after
    the previous row's last answer (a request cut off by a SIGKILL included)."""
    with server.lock:
        answers = list(server.answers)
        starts = [(t, key) for t, _, key, _ in server.requests]
    by_row: dict[str, list[tuple[float, float]]] = {}
    for start, answered, _, key in answers:
        by_row.setdefault(key, []).append((start, answered))
    first_start = {}
    for start, key in sorted(starts):
        first_start.setdefault(key, start)
    for ordering_key, rows in expected.items():
        missing = [r for r in rows if r not in by_row]
        assert not missing, f"ordering key {ordering_key}: never answered: {missing}"
        for before, after in itertools.pairwise(rows):
            last_answer = max(answered for _, answered in by_row[before])
            assert last_answer <= first_start[after], (
                f"ordering key {ordering_key}: {after} started {last_answer - first_start[after]:.3f} s "
                f"before {before} was answered"
            )


def _statuses(engine: sa.Engine) -> dict[str, tuple[str, int, bool]]:
    """Idempotency key → (status, attempts, claimed now)."""
    t = outbox_table
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.idempotency_key, t.c.status, t.c.attempts, t.c.claim_token))
        return {k: (s, int(a), token is not None) for k, s, a, token in rows}


def _ids(engine: sa.Engine) -> dict[str, int]:
    t = outbox_table
    with engine.connect() as conn:
        return {k: int(i) for k, i in conn.execute(sa.select(t.c.idempotency_key, t.c.id))}


def _join(process: BaseProcess, timeout: float = 240) -> None:
    process.join(timeout)
    assert not process.is_alive(), "a dispatcher did not finish"
    assert process.exitcode == 0


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_three_dispatchers_keep_each_keys_order_and_other_keys_flow_past_a_stuck_key(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    url = str(request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url"))
    engine = create_engine(url)
    stuck = _items(["stuck"], 4, topic="slow")
    flowing = _items([f"customer-{i}" for i in range(6)], 8)
    plain = [(f"plain/{i:03d}", "work", {"i": i}) for i in range(12)]
    items = [*stuck, *flowing, *plain]
    _enqueue(engine, items)
    gate = threading.Event()

    def hold(path: str, number: int) -> float:
        if path == "/slow":
            gate.wait(180)  # the stuck key's head is held until the rest went
        return 0.01

    with serve() as server:
        server.holds = hold
        routes = {
            "work": {"url": server.url + "/work"},
            "slow": {"url": server.url + "/slow", "timeout_s": 30.0},
        }
        workers = [
            processes(dispatch_workers.drain, url, routes, {"concurrency": 4, **FAST}, str(tmp_path / f"{i}"))
            for i in range(3)
        ]
        flowing_keys = {item[0] for item in [*flowing, *plain]}

        def others_sent() -> bool:
            statuses = _statuses(engine)
            return all(statuses[k][0] == "SENT" for k in flowing_keys)

        wait_until(others_sent, timeout=180, interval=0.1)
        # Every other row went while the stuck key's head was in flight; none of its later rows moved.
        statuses = _statuses(engine)
        assert statuses["stuck/000"][0] == "PENDING" and statuses["stuck/000"][2]
        assert [statuses[f"stuck/{i:03d}"] for i in (1, 2, 3)] == [("PENDING", 0, False)] * 3
        assert [key for _, path, key, _ in server.requests if path == "/slow"] == []
        gate.set()
        for worker in workers:
            _join(worker)
        assert status_counts(engine) == {"SENT": len(items)}
        assert_one_at_a_time_in_order(server, _expected(items))
        requested = sorted(key for _, _, key, _ in server.requests)
        assert requested == sorted(item[0] for item in items)  # each row once
    engine.dispose()


def test_order_holds_when_dispatchers_are_sigkilled_at_random_moments(
    pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    engine = create_engine(pg_url)
    items: list[Any] = _items([f"k{i:02d}" for i in range(10)], 12)
    items += [(f"plain/{i:03d}", "work", {"i": i}) for i in range(20)]
    _enqueue(engine, items)
    total = len(items)
    rng = random.Random(28)
    options = {"concurrency": 4, "claim_ms": 1_500, **FAST}
    with serve(latency_s=0.02) as server:
        routes = {"work": {"url": server.url + "/work", "timeout_s": 1.0}}

        def start(n: int) -> BaseProcess:
            return processes(
                dispatch_workers.run_loop, pg_url, routes, options, str(tmp_path / f"{n}.json"), 20
            )

        alive = [start(n) for n in range(3)]
        started = 3
        kills = 0

        def sent() -> int:
            return status_counts(engine).get("SENT", 0)

        for step in range(1, 7):
            wait_until(lambda s=step: sent() >= s * total // 8, timeout=180, interval=0.05)  # type: ignore[misc]
            time.sleep(rng.uniform(0, 0.2))  # a moment somewhere in the dispatchers' work
            victim = alive.pop(rng.randrange(len(alive)))
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(30)
            kills += 1
            alive.append(start(started))
            started += 1
        wait_until(lambda: sent() == total, timeout=240, interval=0.1)
        for worker in alive:  # a replacement may still be starting: SIGTERM can find it before run()
            assert worker.pid is not None
            os.kill(worker.pid, signal.SIGTERM)
        for worker in alive:
            worker.join(60)
        assert kills == 6 and status_counts(engine) == {"SENT": total}
        assert_one_at_a_time_in_order(server, _expected(items))
    engine.dispose()


def test_a_retrying_row_holds_its_key_back_while_other_keys_flow(engine: sa.Engine) -> None:
    """The key's head is answered 503 until the downstream recovers: the key's later rows (of another
    topic: ordering keys span topics) wait, another key's rows go."""
    items = [
        outbox.OutboxItem("k/000", "flaky", {}, "k"),
        outbox.OutboxItem("k/001", "work", {}, "k"),
        outbox.OutboxItem("k/002", "work", {}, "k"),
        *_items(["other"], 3),
    ]
    _enqueue(engine, items)
    recovered = threading.Event()

    def respond(path: str, number: int) -> tuple[int, dict[str, str]]:
        return (503, {}) if path == "/flaky" and not recovered.is_set() else (200, {})

    with serve(latency_s=0.0, respond=respond) as server:
        routes = {"flaky": dispatch_workers._routes({"f": {"url": server.url + "/flaky"}})["f"]}
        routes["work"] = dispatch_workers._routes({"w": {"url": server.url + "/work"}})["w"]
        with Dispatcher(engine, routes, max_attempts=10_000, **FAST) as dispatcher:

            def held_back() -> bool:
                dispatcher.dispatch()
                s = _statuses(engine)
                others = all(s[f"other/{i:03d}"][0] == "SENT" for i in range(3))
                return others and s["k/000"][1] >= 3

            wait_until(held_back, timeout=120, interval=0.01)
            s = _statuses(engine)
            assert s["k/000"][0] == "PENDING" and (s["k/001"], s["k/002"]) == (("PENDING", 0, False),) * 2
            recovered.set()
            wait_until(
                lambda: dispatcher.dispatch() is not None and status_counts(engine) == {"SENT": 6}, 120
            )
        assert_one_at_a_time_in_order(server, _expected(items))
        assert [key for _, _, key, status in server.requests if status == 503][:3] == ["k/000"] * 3


def _cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(cli.main, ["--database-url", url, *args], catch_exceptions=False)


def test_a_dead_row_blocks_its_key_visibly_until_requeued_or_skipped(db_url: str, engine: sa.Engine) -> None:
    from dagster_joblease.dagster.jobs import dead_rows_evaluation

    items = [
        outbox.OutboxItem("r/000", "reject", {}, "r"),
        outbox.OutboxItem("r/001", "work", {}, "r"),
        outbox.OutboxItem("r/002", "work", {}, "r"),
        outbox.OutboxItem("s/000", "refuse", {}, "s"),
        outbox.OutboxItem("s/001", "work", {}, "s"),
        ("n/000", "refuse", {}),  # DEAD without an ordering key: blocks nothing
        *_items(["other"], 2),
    ]
    _enqueue(engine, items)
    ids = _ids(engine)

    def respond(path: str, number: int) -> tuple[int, dict[str, str]]:
        if path == "/refuse" or (path == "/reject" and number == 1):
            return 400, {}
        return 200, {}

    with serve(latency_s=0.0, respond=respond) as server:
        routes = {t: {"url": f"{server.url}/{t}"} for t in ("reject", "refuse", "work")}
        with Dispatcher(engine, dispatch_workers._routes(routes), **FAST) as dispatcher:

            def settled() -> bool:
                dispatcher.dispatch()
                s = _statuses(engine)
                return (
                    all(s[k][0] == "DEAD" for k in ("r/000", "s/000", "n/000"))
                    and s["other/001"][0] == "SENT"
                )

            wait_until(settled, timeout=120, interval=0.01)
            assert dispatcher.dispatch().claimed == 0  # the blocked rows are due, yet not claimed
            s = _statuses(engine)
            assert [s[k] for k in ("r/001", "r/002", "s/001")] == [("PENDING", 0, False)] * 3

            # Visible: `outbox status`, `outbox list` and the no_dead_rows check name the blocked keys.
            status = _cli(db_url, "outbox", "status")
            assert status.exit_code == 0, status.output
            assert "2 ordering key(s) blocked by a DEAD row" in status.output
            assert (
                f"ordering key 'r' is blocked by DEAD row {ids['r/000']} (2 later row(s) held)"
                in status.output
            )
            assert (
                f"ordering key 's' is blocked by DEAD row {ids['s/000']} (1 later row(s) held)"
                in status.output
            )
            doc = json.loads(_cli(db_url, "outbox", "status", "--json").stdout)
            assert doc["blocked_key_count"] == 2
            assert doc["blocked_keys"][0] == {
                "ordering_key": "r",
                "blocking_id": ids["r/000"],
                "topic": "reject",
                "held": 2,
            }
            listed = _cli(db_url, "outbox", "list")
            assert "ORDERING KEY" in listed.output and "2 ordering key(s) blocked" in listed.output
            check = dead_rows_evaluation(engine)
            assert not check.passed and check.metadata["blocked_ordering_keys"].value == 2
            assert f"ordering key 'r' is blocked by DEAD row {ids['r/000']}" in (check.description or "")

            # Skip: refused for a row that is not DEAD (SENT here) or missing; a DEAD row with or without a
            # key becomes SKIPPED, never sent, and a keyed one's key flows on.
            refused = _cli(db_url, "outbox", "skip", str(ids["other/000"]))
            assert refused.exit_code == 1 and f"outbox row {ids['other/000']} is SENT" in refused.output
            assert "only a DEAD row is skipped" in refused.output
            refused = _cli(db_url, "outbox", "skip", "999999")
            assert refused.exit_code == 1 and "no outbox row with id 999999" in refused.output
            skipped = _cli(db_url, "outbox", "skip", str(ids["n/000"]))
            assert skipped.exit_code == 0 and "SKIPPED, never sent" in skipped.output, skipped.output
            skipped = _cli(db_url, "outbox", "skip", str(ids["s/000"]))
            assert skipped.exit_code == 0 and "ordering key 's' released" in skipped.output
            again = _cli(db_url, "outbox", "skip", str(ids["s/000"]))
            assert again.exit_code == 1 and f"outbox row {ids['s/000']} is SKIPPED" in again.output
            # requeue --all-dead leaves SKIPPED rows alone (r/000 is the only DEAD row left).
            assert _cli(db_url, "outbox", "requeue", "--all-dead").output.startswith("requeued 1 row(s)")
            assert _statuses(engine)["s/000"][0] == _statuses(engine)["n/000"][0] == "SKIPPED"
            # The requeued blocking row goes first, then the rest of its key; the skipped key flows too.

            def drained() -> bool:
                dispatcher.dispatch()
                s = _statuses(engine)
                return all(s[k][0] == "SENT" for k in ("r/000", "r/001", "r/002", "s/001"))

            wait_until(drained, timeout=120, interval=0.01)
            assert dispatcher.dispatch().claimed == 0  # the skipped rows are never claimed
        assert_one_at_a_time_in_order(server, {"r": ["r/000", "r/001", "r/002"]})
        # Never sent: the skipped rows reached the downstream only while they failed, before the skip.
        sent_before_skip = [key for _, _, key, _ in server.requests if key in ("s/000", "n/000")]
        assert all(status == 400 for _, _, key, status in server.requests if key in ("s/000", "n/000"))
    t = outbox_table
    with engine.connect() as conn:
        rows = {
            r.idempotency_key: r
            for r in conn.execute(sa.select(t).where(t.c.id.in_([ids["s/000"], ids["n/000"]])))
        }
    assert rows["s/000"].status == "SKIPPED" and rows["s/000"].ordering_key == "s"  # it keeps its key
    assert rows["s/000"].last_error.startswith("skipped by an operator at ")
    assert "never sent; its ordering key 's' flows on (last error: " in rows["s/000"].last_error
    assert rows["n/000"].status == "SKIPPED" and rows["n/000"].ordering_key is None
    assert rows["n/000"].last_error.startswith("skipped by an operator at ")
    assert len(sent_before_skip) == 2  # one failed attempt each (400 is permanent), none after
    assert "ordering key(s) blocked" not in _cli(db_url, "outbox", "status").output
    # Counted apart from dead: `outbox status`, `stats --json`, `list --status skipped`, the check passes.
    doc = json.loads(_cli(db_url, "outbox", "status", "--json").stdout)
    assert doc["blocked_key_count"] == 0
    by_topic = {x["topic"]: (x["dead"], x["skipped"]) for x in doc["topics"]}
    assert by_topic["refuse"] == (0, 2)
    assert "SKIPPED" in _cli(db_url, "outbox", "status").output
    stats = json.loads(_cli(db_url, "outbox", "stats", "--json").stdout)
    assert stats["by_status"]["SKIPPED"] == 2 and stats["by_status"]["DEAD"] == 0
    listed = _cli(db_url, "outbox", "list", "--status", "skipped", "--json")
    assert sorted(r["id"] for r in json.loads(listed.stdout)) == sorted([ids["s/000"], ids["n/000"]])
    check = dead_rows_evaluation(engine)
    assert check.passed, check.description
    assert check.metadata["dead_rows"].value == 0 and check.metadata["skipped_rows"].value == 2
    assert check.metadata["blocked_ordering_keys"].value == 0
    # A SKIPPED row requeued is PENDING again (and sent, after its key's earlier live rows: none here).
    requeued = _cli(db_url, "outbox", "requeue", str(ids["s/000"]))
    assert requeued.exit_code == 0 and requeued.output.startswith("requeued 1 row(s)"), requeued.output
    assert _statuses(engine)["s/000"] == ("PENDING", 0, False)


def test_limited_routes_keep_each_keys_order_through_their_claims_and_swaps(
    pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    """A max_in_flight route (its claims hand slots on by the swap) and a rate route, keys spanning both:
    every claim path of a limited group keeps the rule."""
    engine = create_engine(pg_url)
    # Fewer keys than the cap, and a rate's spacing below the downstream's latency: without the rule, a
    # key's next rows would be claimed beside its head.
    items: list[Any] = [*_items(["c0", "c1"], 10, topic="capped"), *_items(["r0"], 8, topic="rated")]
    items += [
        outbox.OutboxItem(f"both/{i:03d}", "capped" if i % 2 else "rated", {}, "both") for i in range(6)
    ]
    _enqueue(engine, items)
    with serve(latency_s=0.05) as server:
        server.holds = lambda path, number: 0.1 if path == "/rated" else 0.05
        routes = {
            "capped": {"url": server.url + "/capped", "max_in_flight": 3},
            "rated": {"url": server.url + "/rated", "rate": 40},
        }
        workers = [
            processes(
                dispatch_workers.drain, pg_url, routes, {"concurrency": 4, **FAST}, str(tmp_path / f"{i}")
            )
            for i in range(3)
        ]
        for worker in workers:
            _join(worker)
        assert status_counts(engine) == {"SENT": len(items)}
        assert server.most_at_once("/capped") <= 3
        assert_one_at_a_time_in_order(server, _expected(items))
    engine.dispose()


def test_skip_refusals_requeue_and_purge_of_skipped_rows(db_url: str, engine: sa.Engine) -> None:
    """`outbox skip` refuses a PENDING row; a skipped row is purged by the time it was skipped (its
    updated_at, which the skip sets to the database clock) like a SENT row by its sent_at: an old one
    goes, a young one stays, a DEAD row always stays."""
    import datetime as dt

    t = outbox_table
    _enqueue(
        engine,
        [("old", "t", {}), ("young", "t", {}), ("dead", "t", {}), ("sent", "t", {}), ("pending", "t", {})],
    )
    ids = _ids(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.update(t).where(t.c.idempotency_key.in_(["old", "young", "dead"])).values(status="DEAD")
        )
        long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
        conn.execute(
            sa.update(t).where(t.c.idempotency_key == "sent").values(status="SENT", sent_at=long_ago)
        )

    refused = _cli(db_url, "outbox", "skip", str(ids["pending"]))
    assert refused.exit_code == 1 and f"outbox row {ids['pending']} is PENDING" in refused.output
    assert "only a DEAD row is skipped" in refused.output
    for name in ("old", "young"):
        assert _cli(db_url, "outbox", "skip", str(ids[name])).exit_code == 0
    with engine.begin() as conn:
        conn.execute(sa.update(t).where(t.c.idempotency_key == "old").values(updated_at=long_ago))

    dry = _cli(db_url, "outbox", "purge", "--sent-before", "7d", "--dry-run")
    assert "would delete 2 SENT or SKIPPED outbox row(s)" in dry.output, dry.output
    purged = _cli(db_url, "outbox", "purge", "--sent-before", "7d")
    assert purged.exit_code == 0 and "deleted 2 SENT or SKIPPED outbox row(s)" in purged.output
    assert {k: s for k, (s, _, _) in _statuses(engine).items()} == {
        "young": "SKIPPED",
        "dead": "DEAD",
        "pending": "PENDING",
    }
    # A skipped row requeued is PENDING again, due now, attempts from 0; the dispatcher may send it.
    assert _cli(db_url, "outbox", "requeue", str(ids["young"])).exit_code == 0
    assert _statuses(engine)["young"] == ("PENDING", 0, False)


def test_a_timed_out_keyed_row_on_an_unlimited_route_overlaps_neither_itself_nor_its_successor(
    engine: sa.Engine,
) -> None:
    """Scenario 1 of issue 36: k/000 times out after 1 s while the downstream works on it 2.5 s. Its retry
    started ~0.1 s later (the grace that keeps a timed-out request in flight was a limited group's
    only), succeeded, and k/001 went out while k/000's first request was still being processed. With the
    grace on every route (timeout 1 s + grace 2 s > 2.5 s) nothing of the key overlaps."""
    items = [outbox.OutboxItem(f"k/{seq:03d}", "work", {"seq": seq}, "k") for seq in range(2)]
    _enqueue(engine, items)
    with serve(latency_s=0.0) as server:
        server.holds = lambda path, number: 2.5 if number == 1 else 0.0
        route = Route(server.url + "/work", timeout_s=1.0, timeout_grace_s=2.0)
        with Dispatcher(engine, {"work": route}, concurrency=4, claim_ms=5_000, **FAST) as dispatcher:
            wait_until(
                lambda: dispatcher.dispatch() is not None and status_counts(engine) == {"SENT": 2},
                timeout=60,
                interval=0.02,
            )
        wait_until(lambda: server.in_flight == 0, timeout=10)
        assert server.most_at_once("/work") == 1, server.spans
        with server.lock:
            spans = sorted(server.spans)
        for (_, first_end, _, _), (second_start, _, _, key) in itertools.pairwise(spans):
            assert second_start >= first_end, f"{key} started while an earlier request of k was open"


def test_a_skipped_row_requeued_while_a_later_row_of_its_key_is_in_flight_waits_for_it(
    engine: sa.Engine,
) -> None:
    """Scenario 2 of issue 36: k/000 DEAD, then skipped; k/001 goes out and the downstream holds it. An
    ``outbox requeue`` of k/000 meanwhile was accepted and a second dispatcher sent k/000 during k/001's
    request. The head-of-key rule counts a row of the key in flight, whatever its id: the requeued row
    waits for k/001's request to end."""
    items = [outbox.OutboxItem(f"k/{seq:03d}", "work", {"seq": seq}, "k") for seq in range(2)]
    _enqueue(engine, items)
    ids = _ids(engine)
    with engine.begin() as conn:
        conn.execute(sa.update(outbox_table).where(outbox_table.c.id == ids["k/000"]).values(status="DEAD"))
    admin.skip(engine, ids["k/000"])
    with serve(latency_s=0.0) as server:
        server.hold.set()
        routes = {"work": Route(server.url + "/work", timeout_s=5.0)}
        with (
            Dispatcher(engine, routes, claim_ms=20_000, **FAST) as first,
            Dispatcher(engine, routes, claim_ms=20_000, **FAST) as second,
        ):
            sending = threading.Thread(target=first.dispatch)
            sending.start()
            try:
                wait_until(lambda: server.in_flight == 1, timeout=30)
                assert admin.requeue(engine, row_id=ids["k/000"]) == 1
                assert second.dispatch().claimed == 0  # k/001 is in flight: k/000 waits
            finally:
                server.released.set()
                sending.join(30)
            wait_until(
                lambda: second.dispatch() is not None and status_counts(engine) == {"SENT": 2}, timeout=60
            )
        assert server.most_at_once("/work") == 1, server.spans
        assert [key for _, _, key, _ in server.requests] == ["k/001", "k/000"]
