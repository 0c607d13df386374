"""Lease and outbox administration on both backends (real PostgreSQL and real SQLite files)."""

from __future__ import annotations

import multiprocessing
import secrets
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import admin, errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService, NotAcquiredReason
from dagster_joblease.storage import create_engine
from dagster_joblease.storage import leases as store
from dagster_joblease.storage import outbox as outbox_store
from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.admin_helpers import (
    DAY_MS,
    HOUR_MS,
    add_outbox_row,
    backdate_acquired,
    backdate_finished,
    count,
    lease_statuses,
    purge_worker,
    waiting_on_a_lock,
)
from tests.conftest import wait_until


def _boom(_: object) -> None:
    raise ZeroDivisionError("division by zero")


def test_list_and_show_leases(engine: sa.Engine) -> None:
    svc = LeaseService(engine)
    assert svc.run_exclusive(JobIdentity.initial("bootstrap"), lambda _: None).acquired
    held = svc.acquire(JobIdentity.schedule("daily", "2026-01-02"), lease_ms=600_000)
    assert held is not None
    with pytest.raises(ZeroDivisionError):
        svc.run_exclusive(JobIdentity.schedule("daily", "2026-01-01"), _boom)

    rows = admin.list_leases(engine)
    assert [(r.code, r.run_key, r.status) for r in rows] == [
        ("daily", "2026-01-01", "FAIL"),
        ("daily", "2026-01-02", "RUNNING"),
        ("bootstrap", None, "SUCCESS"),
    ]
    assert rows[0].last_error == "ZeroDivisionError: division by zero"
    assert rows[0].remaining_ms is None and not rows[0].live

    (running,) = admin.list_leases(engine, status="running")
    assert running.id == held.id and running.live and not running.expired
    assert running.remaining_ms is not None and 0 < running.remaining_ms <= 600_000
    assert running.idempotency_key == held.idempotency_key
    assert running.expires_at.tzinfo is not None
    assert [r.job_type for r in admin.list_leases(engine, code="bootstrap")] == ["INITIAL"]
    assert len(admin.list_leases(engine, limit=1)) == 1

    assert admin.list_leases(engine, older_than_ms=HOUR_MS) == []
    backdate_acquired(engine, held.id, 2 * HOUR_MS)
    assert [r.id for r in admin.list_leases(engine, older_than_ms=HOUR_MS)] == [held.id]
    assert admin.list_leases(engine, expired_only=True) == []

    assert admin.show_lease(engine, held.idempotency_key).id == held.id
    assert admin.show_lease(engine, " daily ", "2026-01-02").id == held.id
    assert admin.show_lease(engine, held.id).code == "daily"
    assert admin.show_lease(engine, "bootstrap").status == "SUCCESS"
    with pytest.raises(errors.NotFoundError, match="2 SCHEDULE run"):
        admin.show_lease(engine, "daily")
    with pytest.raises(errors.NotFoundError, match="no lease for SCHEDULE run 'daily' / '1999'"):
        admin.show_lease(engine, "daily", "1999")
    with pytest.raises(errors.NotFoundError, match="no lease with key v2:0000"):
        admin.show_lease(engine, "v2:" + "0" * 64)
    with pytest.raises(errors.NotFoundError):
        admin.show_lease(engine, 10_000)

    with pytest.raises(errors.AdminArgumentError, match="allowed"):
        admin.list_leases(engine, status="bogus")
    with pytest.raises(errors.AdminArgumentError, match="limit"):
        admin.list_leases(engine, limit=0)
    with pytest.raises(errors.InvalidJobIdentityError):
        admin.show_lease(engine, "x" * 65)


KEY = "v2:" + "0" * 64


@pytest.mark.parametrize(
    ("job", "schedules", "close", "message"),
    [
        (None, 0, [], f"no lease with key {KEY}; list them with `joblease leases list`"),
        (
            JobIdentity.initial("daily"),
            2,
            ["x"],  # a code with SCHEDULE runs: the run key is what is missing (close matches unread)
            "no lease for INITIAL run 'daily' (key K); 2 SCHEDULE run(s) of that code exist: "
            "give the run key too",
        ),
        (
            JobIdentity.initial("dayly"),
            0,
            ["daily", "daily-2"],
            "no lease for INITIAL run 'dayly' (key K); close matches: daily, daily-2",
        ),
        (
            JobIdentity.schedule("daily", "1999"),
            0,
            [],
            "no lease for SCHEDULE run 'daily' / '1999' (key K); "
            "list them with `joblease leases list --code CODE`",
        ),
    ],
)
def test_a_lease_not_found_names_what_was_looked_up_and_what_to_try(
    job: JobIdentity | None, schedules: int, close: list[str], message: str
) -> None:
    key = KEY if job is None else job.idempotency_key
    expected = message.replace("(key K)", f"(key {key})")
    assert admin.lease_not_found(key, job, schedules=schedules, close=close) == expected


@pytest.mark.parametrize(
    ("status", "claimed", "refusal"),
    [
        ("DEAD", False, None),
        ("DEAD", True, None),  # a DEAD row's claim is history
        ("PENDING", False, None),  # waiting out its backoff: made due now
        ("PENDING", True, "outbox row 7 is being delivered by a dispatcher right now (unexpired claim); "),
        ("SENT", False, "outbox row 7 was already SENT; requeueing delivered rows is not supported"),
        ("SENT", True, "outbox row 7 was already SENT"),
        ("SKIPPED", False, None),  # a person's skip is undone by a requeue
    ],
)
def test_requeue_refuses_a_sent_row_and_one_being_delivered(
    status: str, claimed: bool, refusal: str | None
) -> None:
    said = admin.requeue_refusal(7, status, claimed=claimed)
    assert said is None if refusal is None else (said is not None and said.startswith(refusal)), said


@pytest.mark.parametrize(
    ("status", "refusal"),
    [
        ("DEAD", None),
        (
            "PENDING",
            "outbox row 7 is PENDING; only a DEAD row is skipped (it is still being delivered or retried",
        ),
        ("SENT", "outbox row 7 is SENT; only a DEAD row is skipped (it was delivered"),
        (
            "SKIPPED",
            "outbox row 7 is SKIPPED; only a DEAD row is skipped (it already is; `joblease outbox requeue 7`",
        ),
    ],
)
def test_skip_refuses_every_row_that_is_not_dead(status: str, refusal: str | None) -> None:
    said = admin.skip_refusal(7, status)
    assert said is None if refusal is None else (said is not None and said.startswith(refusal)), said


@pytest.mark.parametrize(
    ("key", "last_error", "note"),
    [
        (None, None, "skipped by an operator at 2026-12-04T22:00:01+00:00: never sent"),
        (
            "k",
            None,
            "skipped by an operator at 2026-12-04T22:00:01+00:00: never sent; its ordering key 'k' flows on",
        ),
        (
            None,
            "HTTP 400",
            "skipped by an operator at 2026-12-04T22:00:01+00:00: never sent (last error: HTTP 400)",
        ),
    ],
)
def test_skipped_row_note_says_who_when_and_keeps_the_error(
    key: str | None, last_error: str | None, note: str
) -> None:
    now = datetime(2026, 12, 4, 22, 0, 1, 250_000, tzinfo=UTC)
    assert admin.skipped_row_note(now, key, last_error) == note


def test_admin_fail_refuses_a_live_lease_then_force_fences_the_old_holder(engine: sa.Engine) -> None:
    svc = LeaseService(engine)
    job = JobIdentity.schedule("export", "2026-02-01")
    lease = svc.acquire(job, lease_ms=600_000)
    assert lease is not None

    with pytest.raises(errors.AdminRefusedError, match=r"live lease.*two holders"):
        admin.admin_fail(engine, lease.idempotency_key)
    svc.heartbeat(lease)  # untouched: the holder still owns it

    outcome = admin.reset_lease(engine, lease.idempotency_key, force=True, reason="node lost")
    assert outcome.changed and outcome.was_live
    row = outcome.lease
    assert row.status == "FAIL" and row.finished_at is not None
    assert row.last_error is not None and row.last_error.startswith("admin reset of attempt 1: node lost")
    assert admin.FORCED_MARK in row.last_error
    with pytest.raises(errors.LostLeaseError):
        svc.heartbeat(lease)
    with pytest.raises(errors.LostLeaseError):
        svc.complete(lease)

    again = svc.acquire(job)
    assert again is not None and again.attempt == 2 and again.idempotency_key == lease.idempotency_key
    assert again.previous_error == row.last_error


def test_admin_fail_resets_an_expired_lease_without_force_and_refuses_success(engine: sa.Engine) -> None:
    svc = LeaseService(engine)
    stuck = svc.acquire(JobIdentity.schedule("sync", "a"), lease_ms=300)
    assert stuck is not None
    wait_until(lambda: admin.show_lease(engine, stuck.idempotency_key).expired)
    (listed,) = admin.list_leases(engine, expired_only=True)
    assert listed.id == stuck.id and listed.remaining_ms is not None and listed.remaining_ms <= 0

    outcome = admin.reset_lease(engine, stuck.id)
    assert outcome.changed and not outcome.was_live
    assert outcome.lease.status == "FAIL" and "overdue" in (outcome.lease.last_error or "")
    repeat = admin.reset_lease(engine, stuck.idempotency_key, reason="again")
    assert not repeat.changed and repeat.lease.last_error == outcome.lease.last_error

    assert svc.run_exclusive(JobIdentity.initial("once"), lambda _: None).acquired
    done = admin.show_lease(engine, "once")
    with pytest.raises(errors.AdminRefusedError, match="SUCCESS is final"):
        admin.admin_fail(engine, done.idempotency_key, force=True)
    assert admin.show_lease(engine, "once").status == "SUCCESS"

    with pytest.raises(errors.NotFoundError):
        admin.admin_fail(engine, "v2:" + "1" * 64)
    with pytest.raises(errors.AdminArgumentError, match="v2: idempotency key or a numeric lease id"):
        admin.admin_fail(engine, "sync")
    with pytest.raises(errors.AdminArgumentError, match="reason"):
        admin.admin_fail(engine, stuck.id, reason="  ")


def test_replay_after_retention(engine: sa.Engine) -> None:
    """A purged SCHEDULE run can run again (attempt 1, same key); INITIAL and RUNNING rows survive."""
    svc = LeaseService(engine)
    nightly = JobIdentity.schedule("nightly", "2026-01-01")
    assert svc.run_exclusive(nightly, lambda _: "done").acquired
    assert svc.try_acquire(nightly).reason is NotAcquiredReason.SUCCEEDED
    with pytest.raises(ZeroDivisionError):
        svc.run_exclusive(JobIdentity.schedule("nightly", "2026-01-02"), _boom)
    assert svc.run_exclusive(JobIdentity.initial("bootstrap"), lambda _: None).acquired
    running = svc.acquire(JobIdentity.schedule("nightly", "2026-01-03"), lease_ms=600_000)
    assert running is not None
    backdate_finished(engine, 8 * DAY_MS)
    before = lease_statuses(engine)

    with pytest.raises(errors.RetentionWindowError, match="can run again"):
        admin.purge_leases(engine, finished_before_ms=DAY_MS, min_replay_window_ms=7 * DAY_MS)
    assert lease_statuses(engine) == before
    assert admin.purge_leases(engine, finished_before_ms=9 * DAY_MS, min_replay_window_ms=7 * DAY_MS) == 0
    assert (
        admin.purge_leases(
            engine, finished_before_ms=7 * DAY_MS, min_replay_window_ms=7 * DAY_MS, dry_run=True
        )
        == 2
    )
    assert lease_statuses(engine) == before

    assert admin.purge_leases(engine, finished_before_ms=7 * DAY_MS, min_replay_window_ms=7 * DAY_MS) == 2
    assert sorted(r.code + ":" + r.status for r in admin.list_leases(engine)) == [
        "bootstrap:SUCCESS",
        "nightly:RUNNING",
    ]
    replay = svc.acquire(nightly)
    assert replay is not None and replay.attempt == 1 and replay.idempotency_key == nightly.idempotency_key
    assert svc.acquire(JobIdentity.initial("bootstrap")) is None

    with pytest.raises(errors.AdminArgumentError):
        admin.purge_leases(engine, finished_before_ms=-1, min_replay_window_ms=0)


def test_outbox_stats_list_requeue_and_purge(engine: sa.Engine) -> None:
    due_old = add_outbox_row(engine, "k-due-old", "billing", next_in_ms=-5 * 60_000)
    add_outbox_row(engine, "k-due", "billing")
    add_outbox_row(engine, "k-later", "mail", attempts=2, last_status=503, next_in_ms=HOUR_MS)
    in_flight = add_outbox_row(engine, "k-flight", "mail", attempts=1, claimed_for_ms=60_000)
    dead_billing = add_outbox_row(
        engine, "k-dead-1", "billing", status="DEAD", attempts=1, last_status=400, last_error="400: bad"
    )
    add_outbox_row(engine, "k-dead-2", "mail", status="DEAD", attempts=10, last_status=503, last_error="503")
    old_sent = add_outbox_row(
        engine, "k-sent-old", "billing", status="SENT", attempts=1, sent_ago_ms=2 * DAY_MS
    )
    add_outbox_row(engine, "k-sent-new", "billing", status="SENT", attempts=1, sent_ago_ms=0)

    stats = admin.outbox_stats(engine)
    assert dict(stats.by_status) == {"PENDING": 4, "SENT": 2, "DEAD": 2, "SKIPPED": 0}
    assert stats.total == 8
    assert stats.due == 2  # the backed-off and the claimed rows are not due
    assert stats.oldest_due_age_ms is not None and stats.oldest_due_age_ms >= 5 * 60_000
    assert admin.TopicCount("mail", "DEAD", 1) in stats.by_topic
    assert stats.to_json()["by_status"]["SENT"] == 2

    dead = admin.list_outbox(engine, status="dead")
    assert [(r.idempotency_key, r.last_status) for r in dead] == [("k-dead-2", 503), ("k-dead-1", 400)]
    assert [r.idempotency_key for r in admin.list_outbox(engine, status="Dead", topic="mail")] == ["k-dead-2"]
    flight = next(r for r in admin.list_outbox(engine, status="pending") if r.id == in_flight)
    assert flight.claimed
    (old,) = [r for r in admin.list_outbox(engine) if r.id == due_old]
    assert old.due_in_ms is not None and old.due_in_ms <= -5 * 60_000 and not old.claimed
    assert len(admin.list_outbox(engine, limit=3)) == 3

    assert admin.requeue(engine, row_id=dead_billing) == 1
    (requeued,) = [r for r in admin.list_outbox(engine) if r.id == dead_billing]
    assert (requeued.status, requeued.attempts, requeued.idempotency_key) == ("PENDING", 0, "k-dead-1")
    assert requeued.last_error == "400: bad" and requeued.due_in_ms is not None and requeued.due_in_ms <= 0
    assert admin.requeue(engine, topic="mail") == 1
    assert admin.requeue(engine, all_dead=True) == 0
    assert admin.outbox_stats(engine).due == 4

    with pytest.raises(errors.AdminRefusedError, match="already SENT"):
        admin.requeue(engine, row_id=old_sent)
    with pytest.raises(errors.AdminRefusedError, match="being delivered"):
        admin.requeue(engine, row_id=in_flight)
    with pytest.raises(errors.NotFoundError, match="no outbox row with id 99999"):
        admin.requeue(engine, row_id=99_999)
    with pytest.raises(errors.AdminArgumentError, match="needs a selection"):
        admin.requeue(engine)
    with pytest.raises(errors.AdminArgumentError, match="not both"):
        admin.requeue(engine, row_id=1, all_dead=True)

    with pytest.raises(errors.RetentionWindowError, match="deduplication window"):
        admin.purge_sent(engine, older_than_ms=HOUR_MS, min_retention_ms=DAY_MS)
    assert count(engine, outbox_table) == 8
    assert admin.purge_sent(engine, older_than_ms=DAY_MS, min_retention_ms=DAY_MS, dry_run=True) == 1
    assert admin.purge_sent(engine, older_than_ms=DAY_MS, min_retention_ms=DAY_MS) == 1
    assert [r.idempotency_key for r in admin.list_outbox(engine, status="sent")] == ["k-sent-new"]
    assert count(engine, lease_table) == 0


def _purge_while_a_row_changes(
    url: str, engine: sa.Engine, what: str, change: sa.Executable, params: dict[str, object]
) -> object:
    """Run a purge in another process while ``change`` (uncommitted, row lock held) moves the only
    purgeable row out of its purgeable state; commit once the purge waits on that row; return its result.

    The purge's SELECT sees the old, purgeable row; its DELETE then waits for the lock. This is the
    window a reclaim can hit by chance; the held lock makes it certain."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with engine.connect() as holder:
        transaction = holder.begin()
        assert holder.execute(change, params).rowcount == 1
        worker = ctx.Process(target=purge_worker, args=(url, what, 7 * DAY_MS, out))
        worker.start()
        try:
            wait_until(lambda: waiting_on_a_lock(engine, "DELETE FROM joblease_"), timeout=30)
        finally:
            transaction.commit()
        worker.join(60)
    assert worker.exitcode == 0
    return out.get(timeout=5)


def test_purge_never_deletes_a_lease_reclaimed_while_it_runs(pg_url: str) -> None:
    """A FAIL row reclaimed (FAIL → RUNNING) between the purge's select and its delete must survive:
    deleting it would let the next claim win attempt 1 while the reclaimer still holds attempt 2."""
    engine = create_engine(pg_url)
    svc = LeaseService(engine, lease_ms=600_000)
    job = JobIdentity.schedule("nightly", "2026-01-01")
    with pytest.raises(ZeroDivisionError):
        svc.run_exclusive(job, _boom)
    backdate_finished(engine, 8 * DAY_MS)
    reclaim = {
        "p_lock_key": job.idempotency_key,
        "p_job_type": job.type.value,
        "p_code": job.code,
        "p_run_key": job.run_key,
        "p_owner_token": secrets.token_hex(16),
        "p_lease_ms": 600_000,
        "p_heartbeat_ms": 60_000,
        "p_holder": "worker-a",
    }
    deleted = _purge_while_a_row_changes(pg_url, engine, "leases", store.CLAIM_OR_RECLAIM.postgresql, reclaim)
    assert deleted == 0
    (row,) = admin.list_leases(engine)
    assert (row.status, row.attempt, row.holder) == ("RUNNING", 2, "worker-a")
    assert svc.try_acquire(job).reason is NotAcquiredReason.HELD  # no second holder at attempt 1
    engine.dispose()


def test_outbox_purge_never_deletes_a_row_that_left_sent_while_it_runs(pg_url: str) -> None:
    engine = create_engine(pg_url)
    row_id = add_outbox_row(engine, "k-old", "billing", status="SENT", attempts=1, sent_ago_ms=8 * DAY_MS)
    o = outbox_table
    back_to_pending = sa.update(o).where(o.c.id == sa.bindparam("row_id")).values(status="PENDING")
    deleted = _purge_while_a_row_changes(pg_url, engine, "outbox", back_to_pending, {"row_id": row_id})
    assert deleted == 0
    assert [r.status for r in admin.list_outbox(engine)] == ["PENDING"]  # PENDING rows are never purged
    engine.dispose()


def test_a_purge_runs_one_transaction_per_batch_until_a_short_one(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """admin runs the storage purge batch by batch (each its own transaction) until one comes back short;
    sent rows first, then skipped ones, at most one batch's worth per transaction."""
    from dagster_joblease.storage import purge

    for i in range(3):
        add_outbox_row(engine, f"k-sent-{i}", "billing", status="SENT", attempts=1, sent_ago_ms=2 * DAY_MS)
    skipped = [add_outbox_row(engine, f"k-skip-{i}", "billing", status="SKIPPED") for i in range(2)]
    o = outbox_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(o)
            .where(o.c.id.in_(skipped))
            .values(updated_at=db_now_plus_ms(sa.literal(-2 * DAY_MS, sa.BigInteger())))
        )
    batches: list[int] = []
    one_batch = outbox_store.purge_sent

    def counted(conn: sa.Connection, **kwargs: Any) -> int:
        batches.append(n := one_batch(conn, **kwargs))
        return n

    monkeypatch.setattr(purge, "PURGE_BATCH", 2)
    monkeypatch.setattr(outbox_store, "purge_sent", counted)
    assert admin.purge_sent(engine, older_than_ms=DAY_MS, min_retention_ms=DAY_MS, dry_run=True) == 5
    assert admin.purge_sent(engine, older_than_ms=DAY_MS, min_retention_ms=DAY_MS) == 5
    assert batches == [5, 2, 2, 1]  # the dry run's count, then 2 sent, 1 sent + 1 skipped, 1 skipped
    assert admin.list_outbox(engine) == []


def test_windows_are_bounded_so_what_is_accepted_works_on_both_backends(engine: sa.Engine) -> None:
    from dagster_joblease.inbox import Inbox
    from dagster_joblease.options import MAX_DURATION_MS

    add_outbox_row(engine, "k-sent", "billing", status="SENT", attempts=1, sent_ago_ms=2 * DAY_MS)
    assert admin.list_leases(engine, older_than_ms=MAX_DURATION_MS) == []
    assert admin.purge_leases(engine, finished_before_ms=MAX_DURATION_MS, min_replay_window_ms=0) == 0
    assert admin.purge_sent(engine, older_than_ms=MAX_DURATION_MS, min_retention_ms=MAX_DURATION_MS) == 0
    assert Inbox(engine).purge(MAX_DURATION_MS) == 0
    for huge in (MAX_DURATION_MS + 1, 10**20):
        with pytest.raises(errors.AdminArgumentError, match="100 years"):
            admin.list_leases(engine, older_than_ms=huge)
        with pytest.raises(errors.AdminArgumentError, match="100 years"):
            admin.purge_leases(engine, finished_before_ms=huge, min_replay_window_ms=0)
        with pytest.raises(errors.AdminArgumentError, match="100 years"):
            admin.purge_sent(engine, older_than_ms=huge, min_retention_ms=0)
        with pytest.raises(errors.AdminArgumentError, match="100 years"):
            admin.purge_sent(engine, older_than_ms=huge, min_retention_ms=huge)
        with pytest.raises(errors.InvalidInboxInputError, match="older_than_ms"):
            Inbox(engine).purge(huge)
    assert count(engine, outbox_table) == 1
