"""The wait-and-take-over engine (dagster_joblease.waiting): its decisions, table by table, and every key's
outcome on every exit path, on PostgreSQL and SQLite with real leases (no Dagster)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors, options, waiting
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import Lease, LeaseService
from dagster_joblease.storage import schema
from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.waiting import Next, WaitOutcome

# ---- decisions ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "took_over", "past_deadline", "expected"),
    [
        ("SUCCESS", False, False, Next.SKIP),  # another holder did it: a recorded skip, even mid-wait
        ("SUCCESS", False, True, Next.SKIP),  # ... and after the wait (a freed key is looked at once more)
        ("RUNNING", True, False, Next.RETRY),  # its holder is dead and was failed: claim again at once
        ("RUNNING", True, True, Next.RETRY),  # ... even when the wait is over
        ("RUNNING", False, False, Next.WAIT),  # a live holder, time left
        ("RUNNING", False, True, Next.HELD),  # a live holder, the wait is over
        ("FAIL", False, False, Next.WAIT),  # freed, but another claimer won the race: claim again
        ("FAIL", False, True, Next.HELD),
        (None, False, False, Next.WAIT),  # no row (deleted under us), or batch keys still held: again
        (None, False, True, Next.HELD),  # batch: a round that began after the wait ended was the last
        (None, True, True, Next.RETRY),  # batch: a dead holder failed in that round: one more round
    ],
)
def test_after_refusal(status: str | None, took_over: bool, past_deadline: bool, expected: Next) -> None:
    assert waiting.after_refusal(status, took_over=took_over, past_deadline=past_deadline) is expected


@pytest.mark.parametrize(
    ("status", "age_ms", "stale_ms", "expected"),
    [
        ("RUNNING", 5_000, 2_000, True),  # a holder two intervals late: ask whether it is gone
        ("RUNNING", 2_000, 2_000, False),  # exactly at the threshold: not yet
        ("RUNNING", 100, 2_000, False),  # heartbeating
        ("RUNNING", 10**9, None, False),  # a holder that never heartbeats: only expiry frees it
        ("FAIL", 5_000, 2_000, False),  # not running: nothing to take over
        ("SUCCESS", 5_000, 2_000, False),
        (None, 5_000, 2_000, False),  # no row
    ],
)
def test_stale_running(status: str | None, age_ms: int, stale_ms: int | None, expected: bool) -> None:
    assert waiting.stale_running(status, age_ms, stale_ms) is expected


@pytest.mark.parametrize(
    ("held", "completed", "expected"),
    [
        (False, False, WaitOutcome.NOT_ATTEMPTED),  # claiming or waiting for another holder: never this run's
        (True, True, None),  # the interrupt came after the completion: done (won)
        (True, False, WaitOutcome.FAILED),  # this run's lease, released (or left to expire): retryable
    ],
)
def test_cut_short(held: bool, completed: bool, expected: WaitOutcome | None) -> None:
    assert waiting.cut_short(held=held, completed=completed) is expected


@pytest.mark.parametrize(
    ("in_a_row", "limit", "expected"),
    [(0, 3, True), (2, 3, True), (3, 3, False), (1, 1, False), (0, 1, True)],
)
def test_range_goes_on(in_a_row: int, limit: int, expected: bool) -> None:
    assert waiting.range_goes_on(in_a_row, limit) is expected


@pytest.mark.parametrize(
    ("delay", "expected"), [(waiting.FIRST_POLL_S, 0.1), (0.4, 0.8), (0.6, waiting.MAX_POLL_S), (1.0, 1.0)]
)
def test_next_delay(delay: float, expected: float) -> None:
    assert waiting.next_delay(delay) == pytest.approx(expected)


# ---- the engine on real leases --------------------------------------------------------------------------


class _Log:
    """The step's log; ``on_wait`` runs when the engine announces it waits for a live holder (the moment a
    run termination or a database outage is injected, inside the wait)."""

    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self.lines: list[str] = []
        self.on_wait = on_wait

    def info(self, msg: str) -> None:
        self.lines.append(msg)
        if "waiting up to" in msg and self.on_wait is not None:
            self.on_wait()

    def warning(self, msg: str) -> None:
        self.lines.append(msg)

    def error(self, msg: str) -> None:
        self.lines.append(msg)


class _Watcher:
    def __init__(self, log: _Log, dead: set[str] | None = None) -> None:
        self.log = log
        self.dead = dead or set()
        self.taken: list[str] = []

    def dead_because(self, holder: str | None) -> str | None:
        return "its process is gone" if holder in self.dead else None

    def took_over(self, job: JobIdentity, row: waiting.Row, reason: str) -> None:
        self.taken.append(job.run_key or "")


def _wait(engine: sa.Engine, watcher: _Watcher, held_wait_ms: int = 60_000) -> waiting.Wait:
    timing = options.resolve_timing(60_000, 1_000)
    service = LeaseService(engine, lease_ms=timing.lease_ms, heartbeat_ms=timing.heartbeat_ms, holder="me")
    return waiting.Wait(service, timing, held_wait_ms, taker="me", watcher=watcher)


def _jobs(code: str, n: int = 3) -> list[JobIdentity]:
    return [JobIdentity.schedule(code, f"2026-01-0{d}") for d in range(1, n + 1)]


def _outcomes(report: waiting.Report) -> list[str]:
    return [o.outcome.value for o in report.outcomes]


def _statuses(engine: sa.Engine, jobs: Sequence[JobIdentity]) -> list[str | None]:
    rows = [waiting.read_row(engine, j.idempotency_key) for j in jobs]
    return [None if r is None else r.status for r in rows]


def _each(wait: waiting.Wait, jobs: Sequence[JobIdentity]) -> waiting.Report:
    return waiting.settle_each(wait, jobs, lambda lease: lease.identity.run_key)


def _batch(wait: waiting.Wait, jobs: Sequence[JobIdentity]) -> waiting.Report:
    return waiting.settle_batch(wait, jobs, lambda leases: len(leases))


MODES: dict[str, Callable[[waiting.Wait, Sequence[JobIdentity]], waiting.Report]] = {
    "per-key": _each,
    "batch": _batch,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("stop", "kind"),
    [(KeyboardInterrupt, "interrupt"), (errors.StorageError("lease database gone"), "error")],
    ids=["terminated", "outage"],
)
def test_stopped_while_waiting_for_a_live_holder_the_key_is_not_attempted_and_stays_the_holders(
    engine: sa.Engine, rival: LeaseService, mode: str, stop: BaseException | type[BaseException], kind: str
) -> None:
    """Finding 8 and its siblings: a run terminated (or its lease database gone) while it waits for a key a
    live worker holds never held that key: ``not-attempted``, not ``failed``; the worker keeps its lease;
    the keys done stay done."""
    jobs = _jobs(f"stop-{mode}-{kind}")
    assert rival.acquire(jobs[1], heartbeat_ms=0) is not None

    def stop_now() -> None:
        raise stop

    wait = _wait(engine, _Watcher(_Log(on_wait=stop_now)))
    report = MODES[mode](wait, jobs)

    assert _outcomes(report) == ["won", "not-attempted", "won"]
    assert report.outcomes[1].holder is None and report.outcomes[1].lease is None
    if kind == "interrupt":
        assert isinstance(report.interrupt, KeyboardInterrupt) and report.error is None
        assert report.outcomes[1].error == "interrupted by KeyboardInterrupt before this run held the key"
    else:
        assert report.interrupt is None and report.error is stop
        assert report.outcomes[1].error == "StorageError: lease database gone"
    assert _statuses(engine, jobs) == ["SUCCESS", "RUNNING", "SUCCESS"]


@pytest.mark.parametrize("mode", MODES)
def test_a_key_freed_while_waiting_is_a_skip(engine: sa.Engine, rival: LeaseService, mode: str) -> None:
    jobs = _jobs(f"freed-{mode}")
    freed = rival.acquire(jobs[0], heartbeat_ms=0)
    assert freed is not None

    def finish_it() -> None:
        rival.complete(freed)

    report = MODES[mode](_wait(engine, _Watcher(_Log(on_wait=finish_it))), jobs)

    assert _outcomes(report) == ["skipped-succeeded", "won", "won"]
    assert report.outcomes[0].holder is not None  # the winner
    assert report.error is None and report.interrupt is None


@pytest.mark.parametrize("mode", MODES)
def test_a_key_still_held_when_the_wait_ends_is_held(
    engine: sa.Engine, rival: LeaseService, mode: str
) -> None:
    jobs = _jobs(f"held-{mode}")
    assert rival.acquire(jobs[2], heartbeat_ms=0) is not None

    report = MODES[mode](_wait(engine, _Watcher(_Log()), held_wait_ms=0), jobs)

    assert _outcomes(report) == ["won", "won", "held"]
    assert "is still held by" in (report.outcomes[2].error or "")
    assert report.error is None and report.interrupt is None
    assert _statuses(engine, jobs) == ["SUCCESS", "SUCCESS", "RUNNING"]


def _heartbeat_ago(engine: sa.Engine, job: JobIdentity, ms: int) -> None:
    """As if the holder of ``job`` last heartbeated ``ms`` ago (database clock)."""
    t = schema.lease_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t).where(t.c.lock_key == job.idempotency_key).values(heartbeat_at=db_now_plus_ms(-ms))
        )


# The liveness rule (staleness.holder_death) as the engine applies it, on real leases: the holder's
# interval is 1 s; its run's end (the watcher) is proof only with a stale heartbeat (> 2 intervals);
# without it, 4 missed intervals (the failover tolerance) are; anything short of that waits.
TAKEOVER = [
    ("its run is gone and its heartbeat stale", {"gone"}, 3_000, "reclaimed", "its process is gone and"),
    ("its heartbeat missing 4 intervals, its run said alive", set(), 4_500, "reclaimed", "4 of its own"),
    ("stale but its run alive: a failover blip", set(), 3_500, "held", None),
    ("its run gone but it heartbeats: a surviving step process", {"gone"}, 0, "held", None),
]


@pytest.mark.parametrize(
    ("case", "dead", "ago_ms", "outcome", "said"), TAKEOVER, ids=[c[0] for c in TAKEOVER]
)
@pytest.mark.parametrize("mode", MODES)
def test_a_dead_holder_is_taken_over_at_once_a_live_one_never(
    engine: sa.Engine, mode: str, case: str, dead: set[str], ago_ms: int, outcome: str, said: str | None
) -> None:
    jobs = _jobs(f"dead-{mode}-{ago_ms}-{len(dead)}", 1)
    holder = LeaseService(engine, lease_ms=600_000, heartbeat_ms=1_000, holder="gone")
    assert holder.acquire(jobs[0]) is not None
    _heartbeat_ago(engine, jobs[0], ago_ms)
    watcher = _Watcher(_Log(), dead=dead)

    report = MODES[mode](_wait(engine, watcher, held_wait_ms=0), jobs)

    assert _outcomes(report) == [outcome], case
    assert watcher.taken == ([jobs[0].run_key] if said else [])
    if said:
        assert any("holder gone is dead (" in line and said in line for line in watcher.log.lines)


def test_per_key_interrupted_in_the_body_releases_its_lease_and_the_rest_are_not_attempted(
    engine: sa.Engine,
) -> None:
    jobs = _jobs("interrupt-body")

    def body(lease: Lease) -> Any:
        if lease.identity == jobs[1]:
            raise KeyboardInterrupt
        return None

    report = waiting.settle_each(_wait(engine, _Watcher(_Log())), jobs, body)

    assert _outcomes(report) == ["won", "failed", "not-attempted"]
    assert report.outcomes[1].error == "interrupted by KeyboardInterrupt; the lease was released"
    assert _statuses(engine, jobs) == ["SUCCESS", "FAIL", None]


def test_batch_interrupted_in_the_body_releases_its_set(engine: sa.Engine) -> None:
    jobs = _jobs("interrupt-batch")

    def body(leases: Sequence[Lease]) -> Any:
        raise KeyboardInterrupt

    report = waiting.settle_batch(_wait(engine, _Watcher(_Log())), jobs, body)

    assert _outcomes(report) == ["failed", "failed", "failed"]
    assert isinstance(report.interrupt, KeyboardInterrupt)
    assert _statuses(engine, jobs) == ["FAIL", "FAIL", "FAIL"]
