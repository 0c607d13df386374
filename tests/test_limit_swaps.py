"""Slots of a max_in_flight group handed on by a swap (a finished row recorded and a due row claimed in one
transaction, without the group's row lock): never more requests in flight than the limit, across real
processes, and a finished row whose claim was lost, expired or about to expire hands on nothing.
Assertions are about bounds, never about throughput (the machine is shared and loaded)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.dispatch import Dispatcher, Route, policy
from dagster_joblease.dispatch.dispatcher import DispatchReport
from dagster_joblease.dispatch.groups import locked as locked_module
from dagster_joblease.dispatch.groups.kinds import Refill, Room
from dagster_joblease.dispatch.groups.locked import LockedGroup
from dagster_joblease.dispatch.groups.swapping import SwappingGroup
from dagster_joblease.storage import create_engine, route_groups
from dagster_joblease.storage import outbox as outbox_store
from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.storage.schema import outbox_table, route_group_table
from tests.dispatch_workers import _pending, _routes, enqueue_many, status_counts
from tests.limit_server import serve

CTX = multiprocessing.get_context("spawn")
FAST = {"backoff_base_ms": 10, "backoff_max_ms": 50}
GROUP = "swap-group"


def swap_drain(
    url: str, routes: dict[str, dict[str, Any]], result_path: str, options: dict[str, Any] | None = None
) -> None:
    """A dispatcher process draining the outbox; writes how many slots it handed on by a swap, how many
    times it took a group's row lock, and its totals."""
    locks = 0
    original_lock = route_groups.lock_group

    def counting_lock(conn: sa.Connection, group: str) -> route_groups.GroupState:
        nonlocal locks
        locks += 1
        return original_lock(conn, group)

    locked_module.route_groups.lock_group = counting_lock  # type: ignore[attr-defined]
    handed = {"alone": 0, "merged": 0}
    original_alone = SwappingGroup._swap_alone
    original_merged = SwappingGroup._swap_with_outcomes

    def counting_alone(self: SwappingGroup, *args: Any) -> Any:
        result = original_alone(self, *args)
        handed["alone"] += int(result is not None)
        return result

    def counting_merged(self: SwappingGroup, *args: Any) -> Any:
        handed["merged"] += 1
        return original_merged(self, *args)

    SwappingGroup._swap_alone = counting_alone  # type: ignore[method-assign]
    SwappingGroup._swap_with_outcomes = counting_merged  # type: ignore[method-assign]

    retries: list[str] = []

    class Retries(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "action", None) in ("outbox_record_retry", "outbox_swap_retry"):
                retries.append(record.getMessage())

    logging.getLogger("dagster_joblease").addHandler(Retries())
    logging.getLogger("dagster_joblease").setLevel(logging.INFO)
    engine = create_engine(url)
    totals = DispatchReport()
    ends = time.monotonic() + 150
    with Dispatcher(engine, _routes(routes), concurrency=8, **FAST, **(options or {})) as dispatcher:
        while time.monotonic() < ends:
            report = dispatcher.dispatch(50)
            totals = totals.merge(report)
            if report.claimed == 0:
                if _pending(engine) == 0:
                    break
                time.sleep(0.01)
    engine.dispose()
    data = {
        "sent": totals.sent,
        "lost_claims": totals.lost_claims,
        "locks": locks,
        "retries": retries,
        **handed,
    }
    Path(result_path).write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("failing", "async_commit"),
    [(False, False), (True, False), (False, True)],
    ids=["all-sent", "every-3rd-fails", "all-sent-async-commit"],
)
def test_swaps_across_processes_never_exceed_max_in_flight(
    failing: bool, async_commit: bool, pg_url: str, tmp_path: Path, processes: Callable[..., BaseProcess]
) -> None:
    """Four processes at concurrency 8 on one group with max_in_flight=2 and a fast downstream: most
    completions hand their slot on by a swap (one statement when all were sent, in the outcomes'
    transaction when some must be retried), and the downstream never sees a third request at once."""
    engine = create_engine(pg_url)
    keys = enqueue_many(engine, 160, topic="work")

    def respond(path: str, number: int) -> tuple[int, dict[str, str]]:
        return (500, {}) if failing and number % 3 == 0 else (200, {})

    with serve(latency_s=0.01, respond=respond) as server:
        routes = {"work": {"url": server.url + "/work", "limit_group": GROUP, "max_in_flight": 2}}
        paths = [tmp_path / f"d{i}.json" for i in range(4)]
        options = {"async_swap_commit": async_commit}
        workers = [processes(swap_drain, pg_url, routes, str(p), options) for p in paths]
        for worker in workers:
            worker.join(180)
            assert worker.exitcode == 0
        assert server.max_in_flight <= 2, f"{server.max_in_flight} requests were in flight at once"
        delivered = {k for _, _, k, status in server.requests if status == 200}
    results = [json.loads(p.read_text()) for p in paths]
    assert status_counts(engine) == {"SENT": 160}
    assert delivered == set(keys)
    assert sum(r["sent"] for r in results) == 160
    assert sum(r["alone"] for r in results) > 0  # the swaps ran (and the lock was the exception)
    if failing:
        assert sum(r["merged"] for r in results) > 0
    # No write failed (a swap holding the group row FOR SHARE never upgrades it: no deadlock between two).
    assert [m for r in results for m in r["retries"]] == []
    with engine.connect() as conn:
        assert outbox_store.count_in_flight(conn, GROUP) == 0
    engine.dispose()


def _swapping(dispatcher: Dispatcher) -> SwappingGroup:
    """The dispatcher's implementation of the one group (swapping: max_in_flight alone, PostgreSQL)."""
    group = dispatcher._groups.kinds[GROUP]
    assert isinstance(group, SwappingGroup)
    return group


def _set_claim(engine: sa.Engine, row_id: int, **values: Any) -> None:
    t = outbox_table
    with engine.begin() as conn:
        conn.execute(sa.update(t).where(t.c.id == row_id).values(**values))


@pytest.mark.parametrize("path", ["alone", "merged"])
@pytest.mark.parametrize("case", ["live", "fenced", "expired", "expiring"])
def test_a_lost_expired_or_expiring_claim_hands_on_no_slot(
    case: str, path: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot (max_in_flight=1), held by this dispatcher's claim. ``fenced``: another dispatcher owns
    the row now (its claim holds the slot); ``expired``: the claim ran out on the database clock (the slot
    is free for any locked claim); ``expiring``: less than half a claim is left. Only a live claim hands
    its slot on, to exactly one row; the others record the outcome (or lose it) and claim nothing."""
    engine = create_engine(pg_url)
    enqueue_many(engine, 4, topic="work")
    route = Route("http://127.0.0.1:9/work", limit_group=GROUP, max_in_flight=1)
    with Dispatcher(engine, {"work": route}, concurrency=4) as dispatcher:
        token = "a" * 32
        (row,) = dispatcher._groups.claim(token, Room(10, 4), DispatchReport(), limited_only=False).rows
        if case == "fenced":
            _set_claim(engine, row.id, claim_token="b" * 32)
        elif case == "expired":
            _set_claim(engine, row.id, claim_expires_at=db_now_plus_ms(sa.literal(-1000, sa.BigInteger())))
        elif case == "expiring":
            _set_claim(engine, row.id, claim_expires_at=db_now_plus_ms(sa.literal(5000, sa.BigInteger())))
        # Only what the swap itself claims: the locked claim after it (growth) is switched off.
        monkeypatch.setattr(LockedGroup, "claim_alone", lambda *args, **kwargs: Refill())
        group = _swapping(dispatcher)
        report = DispatchReport()
        if path == "alone":
            finished = [(row, policy.Decision(policy.Outcome.SENT, 200, "HTTP 200"))]
            result = group._swap_alone(token, finished, [row.id], (200,), Room(10, 4), report, set())
            assert result is not None
            taken = result.rows
        else:
            finished = [(row, policy.Decision(policy.Outcome.RETRY, 500, "HTTP 500", delay_ms=60_000))]
            taken = group._swap_with_outcomes(token, finished, [row.id], Room(10, 4), report, set()).rows
    with engine.connect() as conn:
        in_flight = outbox_store.count_in_flight(conn, GROUP)
    if case == "live":
        assert len(taken) == 1 and taken[0].id != row.id and taken[0].group == GROUP
        assert in_flight == 1
    else:
        assert taken == []
        assert in_flight == (1 if case == "fenced" else 0)  # the other dispatcher's claim
    assert report.lost_claims == (1 if case == "fenced" else 0)
    assert report.sent + report.retried == (0 if case == "fenced" else 1)
    engine.dispose()


def test_a_swap_never_raises_the_count_above_a_lowered_limit(pg_url: str) -> None:
    """Another dispatcher registered max_in_flight=1 while this one holds two slots under its own 2: a
    swap hands on only what the smaller limit leaves (none of the two finished slots, then one)."""
    engine = create_engine(pg_url)
    enqueue_many(engine, 6, topic="work")
    route = Route("http://127.0.0.1:9/work", limit_group=GROUP, max_in_flight=2)
    with Dispatcher(engine, {"work": route}, concurrency=4) as dispatcher:
        token = "a" * 32
        first, second = dispatcher._groups.claim(
            token, Room(10, 4), DispatchReport(), limited_only=False
        ).rows
        g = route_group_table
        with engine.begin() as conn:
            conn.execute(sa.update(g).where(g.c.limit_group == GROUP).values(max_in_flight=1))
        sent = policy.Decision(policy.Outcome.SENT, 200, "HTTP 200")
        group = _swapping(dispatcher)
        group.locked.claim_alone = lambda *args, **kwargs: Refill()  # type: ignore[method-assign]
        result = group._swap_alone(
            token, [(first, sent)], [first.id], (200,), Room(10, 4), DispatchReport(), set()
        )
        assert result is not None and result.rows == []  # 1 other in flight: the lower limit is reached
        result = group._swap_alone(
            token, [(second, sent)], [second.id], (200,), Room(10, 4), DispatchReport(), set()
        )
        assert result is not None and len(result.rows) == 1
    with engine.connect() as conn:
        assert outbox_store.count_in_flight(conn, GROUP) == 1
    engine.dispose()


def test_async_swap_commit_is_a_bool_and_stays_in_the_swaps_own_transaction(pg_url: str) -> None:
    """``async_swap_commit`` turns synchronous_commit off for the swap statement's transaction only: the
    pooled connection it ran on is back to the server's setting, and the swap itself is unchanged."""
    engine = create_engine(pg_url)
    route = Route("http://127.0.0.1:9/work", limit_group=GROUP, max_in_flight=1)
    with pytest.raises(errors.ConfigurationError, match="async_swap_commit"):
        Dispatcher(engine, {"work": route}, async_swap_commit="yes")  # type: ignore[arg-type]
    enqueue_many(engine, 3, topic="work")
    engine.dispose()
    engine = create_engine(pg_url, pool_size=1, max_overflow=0)
    with Dispatcher(engine, {"work": route}, concurrency=4, async_swap_commit=True) as dispatcher:
        token = "a" * 32
        (row,) = dispatcher._groups.claim(token, Room(10, 4), DispatchReport(), limited_only=False).rows
        group = _swapping(dispatcher)
        group.locked.claim_alone = lambda *args, **kwargs: Refill()  # type: ignore[method-assign]
        sent = policy.Decision(policy.Outcome.SENT, 200, "HTTP 200")
        result = group._swap_alone(
            token, [(row, sent)], [row.id], (200,), Room(10, 4), DispatchReport(), set()
        )
        assert result is not None and len(result.rows) == 1
        with engine.connect() as conn:  # the one pooled connection, the swap's
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar_one() == "on"
            assert outbox_store.count_in_flight(conn, GROUP) == 1
    assert status_counts(engine) == {"SENT": 1, "PENDING": 2}
    engine.dispose()
