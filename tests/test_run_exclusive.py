"""run_exclusive on PostgreSQL and SQLite: losers skip, winners heartbeat, outcomes are recorded."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import Lease, LeaseService, NotAcquiredReason
from dagster_joblease.storage import create_engine, lease_table
from tests.conftest import wait_until
from tests.sql_watch import watch_sql

JOB = JobIdentity.schedule("nightly-sync", "2026-11-29")


def row_of(engine: sa.Engine, job: JobIdentity = JOB) -> sa.Row[Any]:
    with engine.connect() as conn:
        return conn.execute(sa.select(lease_table).where(lease_table.c.lock_key == job.idempotency_key)).one()


def test_loser_does_not_call_fn(service: LeaseService, rival: LeaseService) -> None:
    held = service.acquire(JOB)
    assert held is not None
    calls: list[Lease] = []
    outcome = rival.run_exclusive(JOB, calls.append)
    assert calls == []
    assert not outcome.acquired
    assert outcome.reason is NotAcquiredReason.HELD
    assert outcome.result is None and outcome.lease is None
    assert outcome.outcome == "skipped: held by a live lease"
    service.complete(held)
    outcome = rival.run_exclusive(JOB, calls.append)
    assert calls == [] and outcome.reason is NotAcquiredReason.SUCCEEDED


def test_winner_gets_its_result_and_success_is_recorded(service: LeaseService, engine: sa.Engine) -> None:
    seen: list[Lease] = []

    def work(lease: Lease) -> dict[str, int]:
        seen.append(lease)
        assert not lease.lost
        assert row_of(engine).owner_token == lease.owner_token
        return {"rows": 42}

    outcome = service.run_exclusive(JOB, work)
    assert outcome.acquired and outcome.result == {"rows": 42}
    assert outcome.outcome == "won"
    (lease,) = seen
    assert outcome.lease is lease
    assert (lease.attempt, lease.idempotency_key) == (1, JOB.idempotency_key)
    assert lease.id == row_of(engine).id and len(lease.owner_token) == 32
    row = row_of(engine)
    assert (row.status, row.attempt, row.last_error) == ("SUCCESS", 1, None)
    assert row.finished_at is not None


def test_exception_records_fail_and_reraises(service: LeaseService, engine: sa.Engine) -> None:
    boom = RuntimeError("ledger locked: 'acct-7'")

    def work(lease: Lease) -> None:
        raise boom

    with pytest.raises(RuntimeError) as info:
        service.run_exclusive(JOB, work)
    assert info.value is boom
    row = row_of(engine)
    assert row.status == "FAIL"
    assert row.last_error == "RuntimeError: ledger locked: 'acct-7'"
    # A retry reclaims the same logical run.
    outcome = service.run_exclusive(JOB, lambda lease: lease.attempt)
    assert outcome.result == 2 and outcome.outcome == "reclaimed"
    assert row_of(engine).status == "SUCCESS"


def test_long_error_text_is_bounded(service: LeaseService, engine: sa.Engine) -> None:
    def work(lease: Lease) -> None:
        raise ValueError("x" * 100_000)

    with pytest.raises(ValueError):
        service.run_exclusive(JOB, work)
    stored = row_of(engine).last_error
    assert stored.startswith("ValueError: xxx") and len(stored) <= 4_000


@pytest.mark.parametrize(
    "interrupt", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"]
)
def test_interrupts_release_the_lease(
    service: LeaseService, rival: LeaseService, engine: sa.Engine, interrupt: BaseException
) -> None:
    def work(lease: Lease) -> None:
        raise interrupt

    with pytest.raises(type(interrupt)) as info:
        service.run_exclusive(JOB, work)
    assert info.value is interrupt
    row = row_of(engine)
    assert row.status == "FAIL"
    assert "released" in row.last_error and type(interrupt).__name__ in row.last_error
    # Released, not left to expire: the next worker reclaims at once.
    again = rival.acquire(JOB)
    assert again is not None and again.attempt == 2


def test_heartbeat_keeps_a_short_lease_alive(engine: sa.Engine, rival: LeaseService) -> None:
    service = LeaseService(engine)
    observed: list[NotAcquiredReason | None] = []

    def work(lease: Lease) -> str:
        # About a second of work under a 300 ms lease: only the heartbeat keeps it ours.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            time.sleep(0.1)
            observed.append(rival.try_acquire(JOB).reason)
            assert not lease.lost
        return "done"

    outcome = service.run_exclusive(JOB, work, lease_ms=300, heartbeat_ms=50)
    assert outcome.result == "done"
    assert len(observed) >= 5
    assert set(observed) == {NotAcquiredReason.HELD}
    row = row_of(engine)
    assert (row.status, row.attempt, row.lease_ms) == ("SUCCESS", 1, 300)
    assert row.heartbeat_at > row.acquired_at


def _steal(other_engine: sa.Engine, rival: LeaseService) -> Lease:
    """Another worker's view: the holder looks dead (expiry in the past), so it reclaims."""
    with other_engine.begin() as conn:
        conn.execute(
            sa.update(lease_table)
            .where(lease_table.c.lock_key == JOB.idempotency_key)
            .values(expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
        )
    stolen = rival.acquire(JOB)
    assert stolen is not None and stolen.attempt == 2
    return stolen


class _HeartbeatGate:
    """Holds the heartbeat thread's renewals at a gate (the statements the holder's engine sends), so a
    test decides when the holder may renew instead of racing its interval."""

    def __init__(self, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._in_flight = 0
        watch_sql(monkeypatch, engine, self._before, self._after)

    @staticmethod
    def _is_renewal(statement: str) -> bool:
        return (
            threading.current_thread().name.startswith("joblease-heartbeat") and "heartbeat_at" in statement
        )

    def _before(self, statement: str) -> None:
        if self._is_renewal(statement):
            with self._cond:
                assert self._cond.wait_for(lambda: self._open, timeout=60), "the gate stayed shut"
                self._in_flight += 1

    def _after(self, statement: str) -> None:
        if self._is_renewal(statement):
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def shut(self) -> None:
        """No renewal runs from now on until :meth:`open`, and none is still in flight."""
        with self._cond:
            self._open = False
            assert self._cond.wait_for(lambda: self._in_flight == 0, timeout=60)

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()


def test_lost_lease_is_seen_at_once_and_finalization_raises(
    service: LeaseService,
    rival: LeaseService,
    other_engine: sa.Engine,
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stolen: list[Lease] = []
    gate = _HeartbeatGate(engine, monkeypatch)

    def work(lease: Lease) -> str:
        assert not lease.lost
        # The holder may not renew between the forced expiry and the rival's claim (on a loaded machine
        # a 50 ms heartbeat would, now and then); its first renewal after the takeover sees the loss.
        gate.shut()
        try:
            stolen.append(_steal(other_engine, rival))
        finally:
            gate.open()
        wait_until(lambda: lease.lost, timeout=30)
        with pytest.raises(errors.LostLeaseError):
            lease.ensure_held()
        return "finished anyway"

    with pytest.raises(errors.LostLeaseError) as info:
        service.run_exclusive(JOB, work, heartbeat_ms=50)
    assert info.value.attempt == 1
    row = row_of(engine)
    assert (row.status, row.attempt, row.owner_token) == ("RUNNING", 2, stolen[0].owner_token)


def test_failure_after_loss_does_not_touch_the_new_owner(
    service: LeaseService, rival: LeaseService, other_engine: sa.Engine, engine: sa.Engine
) -> None:
    stolen: list[Lease] = []

    def work(lease: Lease) -> None:
        stolen.append(_steal(other_engine, rival))
        raise ValueError("late failure")

    with pytest.raises(errors.LostLeaseError) as info:
        service.run_exclusive(JOB, work, heartbeat_ms=0)
    assert isinstance(info.value.__cause__, ValueError)
    row = row_of(engine)
    assert (row.status, row.attempt, row.owner_token) == ("RUNNING", 2, stolen[0].owner_token)
    assert "late failure" not in (row.last_error or "")


def test_interrupt_after_loss_still_reraises_the_interrupt(
    service: LeaseService, rival: LeaseService, other_engine: sa.Engine, engine: sa.Engine
) -> None:
    def work(lease: Lease) -> None:
        _steal(other_engine, rival)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        service.run_exclusive(JOB, work, heartbeat_ms=0)
    row = row_of(engine)
    assert (row.status, row.attempt) == ("RUNNING", 2)


def test_no_heartbeat_thread_when_heartbeat_is_zero(service: LeaseService, engine: sa.Engine) -> None:
    def work(lease: Lease) -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("joblease-heartbeat")]

    assert service.run_exclusive(JOB, work, heartbeat_ms=0).result == []
    other = JobIdentity.schedule("nightly-sync", "2026-11-30")
    names = service.run_exclusive(other, work, heartbeat_ms=1_000).result
    assert names == [f"joblease-heartbeat-{row_of(engine, other).id}"]
    assert not [t for t in threading.enumerate() if t.name.startswith("joblease-heartbeat")]


def test_fn_error_wins_over_a_storage_error_while_recording_it(
    service: LeaseService, engine: sa.Engine
) -> None:
    unreachable = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/does_not_exist?connect_timeout=2")
    boom = ValueError("the real problem")

    def work(lease: Lease) -> None:
        service.engine = unreachable  # the database goes away while fn runs
        raise boom

    try:
        with pytest.raises(ValueError) as info:
            service.run_exclusive(JOB, work, heartbeat_ms=0)
    finally:
        service.engine = engine
        unreachable.dispose()
    assert info.value is boom
    assert row_of(engine).status == "RUNNING"  # not recorded; it expires and is reclaimed later


def test_an_unexpected_heartbeat_error_is_logged_and_renewal_goes_on(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A heartbeat that raises something other than a storage error must not end the heartbeat thread:
    the lease would expire silently while the work goes on."""
    calls: list[int] = []
    renewed_twice = threading.Event()

    class Flaky(LeaseService):
        def heartbeat(self, lease: Lease) -> dt.datetime:
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("a bug in a renewal")
            at = super().heartbeat(lease)
            if len(calls) >= 3:
                renewed_twice.set()
            return at

    service = Flaky(engine, lease_ms=60_000)
    renewed: list[dt.datetime] = []

    def work(lease: Lease) -> None:
        first = row_of(engine).heartbeat_at
        # The thread survived the error and renewed twice more (however slowly a loaded machine runs it).
        assert renewed_twice.wait(120)
        renewed.append(row_of(engine).heartbeat_at)
        assert renewed[0] > first

    with caplog.at_level("ERROR", logger="dagster_joblease"):
        outcome = service.run_exclusive(JOB, work, heartbeat_ms=20)
    assert outcome.acquired and row_of(engine).status == "SUCCESS"
    assert any("failed unexpectedly; still renewing" in r.getMessage() for r in caplog.records)
