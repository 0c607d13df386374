"""Batch leases, on PostgreSQL and SQLite: each key of a set claimed, renewed, finished and fenced exactly as
one lease is, with a fixed number of statements for the whole set."""

from __future__ import annotations

import datetime as dt
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import batch, errors
from dagster_joblease.batch import (
    claim_many,
    complete_many,
    fail_many,
    fenced_transaction_many,
    heartbeat_many,
    release_many,
)
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import Lease, LeaseService, LeaseStatus, NotAcquiredReason
from dagster_joblease.storage import create_engine, lease_table
from dagster_joblease.storage import leases as store
from dagster_joblease.storage.rowset import bind_rows
from tests import batch_workers
from tests.sql_watch import recorded_sql

t = lease_table


def days(count: int, code: str = "daily-billing") -> list[JobIdentity]:
    start = dt.date(2024, 1, 1)
    return [JobIdentity.schedule(code, (start + dt.timedelta(days=i)).isoformat()) for i in range(count)]


def rows_by_key(engine: sa.Engine) -> dict[str, sa.Row[Any]]:
    with engine.connect() as conn:
        return {r.lock_key: r for r in conn.execute(sa.select(t))}


def force_expire(engine: sa.Engine, jobs: list[JobIdentity]) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.lock_key.in_([j.idempotency_key for j in jobs]))
            .values(expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
        )


@pytest.fixture
def statements(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every SQL statement the engine's work sends, in order."""
    yield from recorded_sql(monkeypatch, engine)


def _claims(sent: list[str]) -> list[str]:
    """The kind of each statement on the lease table (a leading WITH … names no kind)."""
    kinds = []
    for sql in sent:
        if "INSERT INTO joblease_lease" in sql:
            kinds.append("INSERT")
        elif "UPDATE joblease_lease" in sql:
            kinds.append("UPDATE")
        elif "FROM joblease_lease" in sql:
            kinds.append("SELECT")
    return kinds


# -- the claim's pure parts ---------------------------------------------------------------------------

JOB = JobIdentity.schedule("daily-billing", "2024-01-01")
WHEN = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("row", "tokens", "attempt", "previous_error", "token"),
    [
        ((JOB.idempotency_key, 7, 1, WHEN, None), {JOB.idempotency_key: "mine"}, 1, None, "mine"),  # new row
        ((JOB.idempotency_key, 7, 1, WHEN, "stale"), {JOB.idempotency_key: "mine"}, 1, None, "mine"),
        (
            (JOB.idempotency_key, 7, 3, WHEN, "boom"),
            {JOB.idempotency_key: "mine"},
            3,
            "boom",
            "mine",
        ),  # SQLite
        (
            (JOB.idempotency_key, 7, 2, WHEN, "boom", "db"),
            {JOB.idempotency_key: "mine"},
            2,
            "boom",
            "db",
        ),  # PG
    ],
)
def test_a_won_row_becomes_the_lease_a_single_claim_returns(
    row: tuple[Any, ...], tokens: dict[str, str], attempt: int, previous_error: str | None, token: str
) -> None:
    claim = batch.won_claim(JOB, row, tokens, 30_000, "me")
    assert claim.lease is not None
    assert (claim.lease.id, claim.lease.attempt, claim.lease.owner_token) == (7, attempt, token)
    assert (claim.lease.lease_ms, claim.lease.expires_at, claim.lease.previous_error) == (
        30_000,
        WHEN,
        previous_error,
    )
    assert claim.lease.reclaimed is (attempt > 1)
    assert (claim.reason, claim.status, claim.holder, claim.attempt, claim.heartbeat_age_ms) == (
        None,
        LeaseStatus.RUNNING,
        "me",
        attempt,
        0,
    )
    assert tokens[JOB.idempotency_key] == token  # the database's token replaces the one made here


@pytest.mark.parametrize(
    ("status", "age", "reclaimable", "reason"),
    [
        ("RUNNING", 1_500.0, False, NotAcquiredReason.HELD),
        ("SUCCESS", None, False, NotAcquiredReason.SUCCEEDED),
        ("FAIL", None, False, NotAcquiredReason.CONTENDED),  # failed but not reclaimable: a race
        ("FAIL", None, True, None),  # reclaimable again: another round
        ("RUNNING", 90_000.0, True, None),  # expired in between: another round
    ],
)
def test_a_reported_row_becomes_a_refusal_or_another_round(
    status: str, age: float | None, reclaimable: bool, reason: NotAcquiredReason | None
) -> None:
    claim = batch.refused_claim(JOB, (JOB.idempotency_key, status, "them", 4, WHEN, age, reclaimable))
    if reason is None:
        assert claim is None
        return
    assert claim is not None
    assert (claim.lease, claim.reason, claim.status, claim.holder, claim.attempt) == (
        None,
        reason,
        LeaseStatus(status),
        "them",
        4,
    )
    assert (claim.expires_at, claim.heartbeat_age_ms) == (WHEN, None if age is None else int(age))


def _won(attempt: int) -> batch.KeyClaim:
    return batch.won_claim(
        JOB, (JOB.idempotency_key, 1, attempt, WHEN, None), {JOB.idempotency_key: "t"}, 1, "me"
    )


def _refused(reason: NotAcquiredReason) -> batch.KeyClaim:
    return batch.KeyClaim(identity=JOB, lease=None, reason=reason)


@pytest.mark.parametrize(
    ("claims", "tally"),
    [
        ([], (0, 0, 0, 0, 0)),
        ([_won(1), _won(1)], (2, 0, 0, 0, 0)),
        ([_won(1), _won(2), _won(5)], (3, 2, 0, 0, 0)),
        ([_refused(NotAcquiredReason.HELD)] * 2, (0, 0, 2, 0, 0)),
        (
            [
                _won(2),
                _refused(NotAcquiredReason.SUCCEEDED),
                _refused(NotAcquiredReason.CONTENDED),
                _refused(NotAcquiredReason.HELD),
                _won(1),
            ],
            (2, 1, 1, 1, 1),
        ),
    ],
)
def test_claim_tally_counts_won_reclaimed_held_succeeded_contended(
    claims: list[batch.KeyClaim], tally: tuple[int, int, int, int, int]
) -> None:
    assert batch.claim_tally(claims) == tally


# -- claims --------------------------------------------------------------------------------------------


def test_a_new_set_is_claimed_with_one_statement(
    service: LeaseService, engine: sa.Engine, statements: list[str]
) -> None:
    jobs = days(50)
    result = claim_many(service, jobs, holder="range-run-1")
    assert _claims(statements) == ["INSERT"]
    assert [c.identity for c in result] == jobs  # the caller's order
    assert len(result.leases) == 50 and result.refused == ()
    tokens = {lease.owner_token for lease in result.leases}
    assert len(tokens) == 50  # every key fenced by its own token
    rows = rows_by_key(engine)
    for claim in result:
        lease = claim.lease
        assert lease is not None and lease.attempt == 1 and not lease.reclaimed and not lease.lost
        assert claim.holder == "range-run-1" and claim.status is LeaseStatus.RUNNING
        row = rows[lease.idempotency_key]
        assert (row.id, row.owner_token, row.attempt, row.status) == (
            lease.id,
            lease.owner_token,
            1,
            "RUNNING",
        )
        assert (row.holder, row.lease_ms, row.run_key) == ("range-run-1", 60_000, claim.identity.run_key)
        assert row.expires_at == lease.expires_at


def test_a_batch_row_is_the_row_a_single_claim_writes(service: LeaseService, engine: sa.Engine) -> None:
    """Column by column (including any added later): only identity, token, id and times differ."""
    one, many = days(2)
    single = service.acquire(one, holder="h")
    assert single is not None
    claim_many(service, [many], holder="h")
    rows = rows_by_key(engine)
    differ = {"id", "lock_key", "run_key", "owner_token"}
    times = {c.name for c in t.columns if isinstance(c.type, sa.DateTime)}
    a, b = rows[one.idempotency_key]._asdict(), rows[many.idempotency_key]._asdict()
    assert {k: v for k, v in a.items() if k not in differ | times} == {
        k: v for k, v in b.items() if k not in differ | times
    }
    assert {k for k in times if a[k] is None} == {k for k in times if b[k] is None}


def test_every_row_state_is_told_per_key(
    service: LeaseService, rival: LeaseService, engine: sa.Engine
) -> None:
    new, held, succeeded, failed, expired = days(5)
    winner = rival.acquire(succeeded, holder="winner-run")
    assert winner is not None
    rival.complete(winner)
    holder = rival.acquire(held, holder="live-run")
    assert holder is not None
    first_fail = rival.acquire(failed, holder="failed-run")
    assert first_fail is not None
    rival.fail(first_fail, "boom")
    stalled = rival.acquire(expired, holder="stalled-run")
    assert stalled is not None
    force_expire(engine, [expired])

    result = claim_many(service, [new, held, succeeded, failed, expired], holder="me")

    assert result[new].lease is not None and result[new].lease.attempt == 1
    assert result[held].lease is None and result[held].reason is NotAcquiredReason.HELD
    assert (result[held].holder, result[held].attempt, result[held].status) == (
        "live-run",
        1,
        LeaseStatus.RUNNING,
    )
    assert result[held].expires_at == holder.expires_at
    assert result[held].heartbeat_age_ms is not None and result[held].heartbeat_age_ms >= 0
    assert result[succeeded].reason is NotAcquiredReason.SUCCEEDED
    assert result[succeeded].holder == "winner-run" and result[succeeded].status is LeaseStatus.SUCCESS
    reclaimed = result[failed].lease
    assert reclaimed is not None and reclaimed.reclaimed and reclaimed.attempt == 2
    assert reclaimed.previous_error == "boom"
    taken = result[expired].lease
    assert taken is not None and taken.attempt == 2
    assert taken.previous_error == "attempt 1 expired without finishing (worker died or stalled)"
    rows = rows_by_key(engine)
    for job in (new, failed, expired):
        lease = result[job].lease
        assert lease is not None
        row = rows[job.idempotency_key]
        assert (row.owner_token, row.holder, row.status) == (lease.owner_token, "me", "RUNNING")
        assert row.finished_at is None and row.result is None
    assert rows[held.idempotency_key].owner_token == holder.owner_token
    assert rows[succeeded.idempotency_key].status == "SUCCESS"
    # The stalled holder is fenced out, as after a single reclaim.
    with pytest.raises(errors.LostLeaseError):
        rival.heartbeat(stalled)


def test_a_set_that_met_rows_takes_a_fixed_number_of_statements(
    service: LeaseService, rival: LeaseService, statements: list[str]
) -> None:
    jobs = days(30)
    first = claim_many(rival, jobs[:20])
    fail_many(rival, first.leases[:10], "retry me")
    statements.clear()
    result = claim_many(service, jobs)
    assert _claims(statements) == ["INSERT", "UPDATE", "SELECT"]
    assert len(result.leases) == 20  # 10 new, 10 reclaimed
    assert len(result.with_reason(NotAcquiredReason.HELD)) == 10


def test_batch_leases_work_with_every_single_lease_method(service: LeaseService, engine: sa.Engine) -> None:
    a, b, c = claim_many(service, days(3)).leases
    assert service.heartbeat(a) > a.expires_at - dt.timedelta(seconds=1)
    with service.fenced_transaction(a) as conn:
        conn.execute(sa.text("SELECT 1"))
    service.complete(a, {"rows": 3})
    service.fail(b, "no")
    service.release(c)
    assert service.remaining_ms(c) is None
    rows = rows_by_key(engine)
    assert [rows[x.idempotency_key].status for x in (a, b, c)] == ["SUCCESS", "FAIL", "FAIL"]


def test_a_claim_spanning_several_statements_is_still_one_call(
    service: LeaseService, statements: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "STATEMENT_KEYS", 7)
    jobs = days(20)
    result = claim_many(service, jobs)
    assert len(result.leases) == 20
    assert _claims(statements) == ["INSERT"] * 3
    again = claim_many(service, jobs)
    assert len(again.with_reason(NotAcquiredReason.HELD)) == 20
    assert len(heartbeat_many(service, result.leases).held) == 20
    assert len(complete_many(service, result.leases).held) == 20


def test_large_sets_work(service: LeaseService, engine: sa.Engine) -> None:
    jobs = days(10_000)
    result = claim_many(service, jobs)
    assert len(result.leases) == 10_000
    assert len(claim_many(service, jobs).with_reason(NotAcquiredReason.HELD)) == 10_000
    beat = heartbeat_many(service, result.leases)
    assert len(beat.held) == 10_000 and beat.lost == () and len(beat.expires_at) == 10_000
    done = complete_many(service, result.leases)
    assert len(done.held) == 10_000 and done.lost == ()
    assert len(claim_many(service, jobs).with_reason(NotAcquiredReason.SUCCEEDED)) == 10_000
    with engine.connect() as conn:
        counts = dict(conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status)).all())
    assert counts == {"SUCCESS": 10_000}


# -- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("identities", "match"),
    [
        ([], "is empty"),
        ("2024-01-01", "not one item"),
        (JobIdentity.schedule("x", "1"), "not one item"),
        ([JobIdentity.schedule("x", "1"), "x@2"], "must be a JobIdentity"),
        ([JobIdentity.schedule("x", "1"), JobIdentity.schedule("x", " 1 ")], "appears twice"),
        (None, "not one item"),
    ],
)
def test_bad_sets_are_refused_before_any_sql(
    service: LeaseService, statements: list[str], identities: Any, match: str
) -> None:
    with pytest.raises(errors.InvalidJobIdentityError, match=match):
        claim_many(service, identities)
    assert statements == []


def test_too_many_keys_are_refused_with_the_bound(
    service: LeaseService, statements: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "MAX_BATCH_KEYS", 5)
    with pytest.raises(errors.InvalidJobIdentityError, match="at most 5 are allowed per call"):
        claim_many(service, days(6))
    assert statements == []
    assert batch.MAX_BATCH_KEYS == 5 and len(claim_many(service, days(5)).leases) == 5


def test_bad_options_and_lease_sets_are_refused(service: LeaseService, statements: list[str]) -> None:
    with pytest.raises(errors.InvalidLeaseOptionsError, match="lease_ms"):
        claim_many(service, days(2), lease_ms=0)
    with pytest.raises(errors.InvalidLeaseOptionsError, match="holder"):
        claim_many(service, days(2), holder=" padded ")
    assert statements == []
    leases = claim_many(service, days(2)).leases
    for write in (heartbeat_many, complete_many, release_many):
        assert write(service, []) == batch.BatchWrite(action=write.__name__[:-5], held=(), lost=())
        with pytest.raises(errors.InvalidLeaseOptionsError, match="appears twice"):
            write(service, [leases[0], leases[0]])
        with pytest.raises(errors.InvalidLeaseOptionsError, match="must be a Lease"):
            write(service, [leases[0], "lease"])  # type: ignore[list-item]
    with pytest.raises(errors.InvalidLeaseOptionsError, match="fenced by no lease"):
        with fenced_transaction_many(service, []):
            pass
    with pytest.raises(errors.InvalidPayloadError, match="JSON-serializable"):
        complete_many(service, leases, {"when": dt.date(2024, 1, 1)})
    assert all(not x.lost for x in leases)


# -- fenced set writes ---------------------------------------------------------------------------------


def test_heartbeat_renews_the_set_and_reports_the_lost(
    service: LeaseService, rival: LeaseService, engine: sa.Engine, statements: list[str]
) -> None:
    jobs = days(4)
    leases = claim_many(service, jobs, lease_ms=600_000).leases
    force_expire(engine, jobs[:2])
    taken = rival.acquire(jobs[0])
    assert taken is not None
    statements.clear()
    beat = heartbeat_many(service, leases)
    assert _claims(statements) == ["UPDATE"]
    assert beat.lost == (leases[0],) and beat.held == leases[1:]
    assert leases[0].lost and not any(x.lost for x in leases[1:])
    rows = rows_by_key(engine)
    for lease in leases[1:]:  # the expired one nobody took is renewed too, as a single heartbeat does
        row = rows[lease.idempotency_key]
        assert beat.expires_at[lease.idempotency_key] == row.expires_at
        assert row.expires_at > row.heartbeat_at + dt.timedelta(seconds=599)
    assert rows[jobs[0].idempotency_key].owner_token == taken.owner_token
    with pytest.raises(errors.LostBatchLeaseError) as caught:
        beat.raise_if_lost()
    assert caught.value.idempotency_key == jobs[0].idempotency_key
    assert caught.value.lost_keys == (jobs[0].idempotency_key,)


def test_complete_fail_and_release_write_only_what_is_still_held(
    service: LeaseService, rival: LeaseService, engine: sa.Engine
) -> None:
    jobs = days(6)
    leases = claim_many(service, jobs).leases
    force_expire(engine, [jobs[0]])
    stolen = rival.acquire(jobs[0])
    assert stolen is not None
    done = complete_many(service, leases[:2], {"rows": 2})
    assert done.held == (leases[1],) and done.lost == (leases[0],)
    failed = fail_many(service, leases[2:4], ValueError("bad day"))
    released = release_many(service, leases[4:])
    assert failed.lost == () and released.lost == ()
    rows = rows_by_key(engine)
    assert rows[jobs[0].idempotency_key].status == "RUNNING"  # the rival's, untouched
    assert rows[jobs[1].idempotency_key].status == "SUCCESS"
    assert rows[jobs[1].idempotency_key].result == {"rows": 2}
    assert rows[jobs[1].idempotency_key].finished_at is not None
    for job in jobs[2:4]:
        assert (rows[job.idempotency_key].status, rows[job.idempotency_key].last_error) == (
            "FAIL",
            "ValueError: bad day",
        )
    assert rows[jobs[4].idempotency_key].last_error == "released by its holder before finishing"
    # Finished leases are fenced: a second write reports them all lost.
    assert complete_many(service, leases[1:]).held == ()
    again = claim_many(service, jobs)
    assert [c.lease.attempt if c.lease else c.reason for c in again] == [
        NotAcquiredReason.HELD,
        NotAcquiredReason.SUCCEEDED,
        2,
        2,
        2,
        2,
    ]
    assert again[jobs[2]].lease is not None and again[jobs[2]].lease.previous_error == "ValueError: bad day"


def test_no_result_is_sql_null(service: LeaseService, engine: sa.Engine) -> None:
    leases = claim_many(service, days(2)).leases
    complete_many(service, leases)
    with engine.connect() as conn:
        nulls = conn.execute(sa.select(sa.func.count()).where(t.c.result.is_(None))).scalar_one()
    assert nulls == 2


def test_error_text_is_bounded(service: LeaseService, engine: sa.Engine) -> None:
    leases = claim_many(service, days(2)).leases
    fail_many(service, leases, "x" * 50_000)
    assert all(len(r.last_error) == 4_000 for r in rows_by_key(engine).values())


# -- fenced transaction over a set ---------------------------------------------------------------------


def _domain(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE billed (day VARCHAR(32) PRIMARY KEY)"))


def _billed(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.text("SELECT day FROM billed")).scalars())


def _bill(conn: sa.Connection, leases: tuple[Lease, ...]) -> None:
    conn.execute(
        sa.text("INSERT INTO billed (day) VALUES (:day)"), [{"day": x.identity.run_key} for x in leases]
    )


def test_a_fenced_set_transaction_commits_while_every_lease_is_held(
    service: LeaseService, engine: sa.Engine
) -> None:
    _domain(engine)
    jobs = days(5)
    leases = claim_many(service, jobs).leases
    with fenced_transaction_many(service, leases) as conn:
        _bill(conn, leases)
    assert _billed(engine) == [j.run_key for j in jobs]
    assert len(complete_many(service, leases).held) == 5


def test_one_lost_lease_aborts_the_whole_set(
    service: LeaseService, rival: LeaseService, engine: sa.Engine
) -> None:
    _domain(engine)
    jobs = days(5)
    leases = claim_many(service, jobs).leases
    force_expire(engine, [jobs[3]])
    stolen = rival.acquire(jobs[3])
    assert stolen is not None
    ran = []
    with pytest.raises(errors.LostBatchLeaseError) as caught:
        with fenced_transaction_many(service, leases) as conn:
            ran.append(True)
            _bill(conn, leases)
    assert ran == [] and _billed(engine) == []
    assert caught.value.idempotency_key == jobs[3].idempotency_key
    assert caught.value.lease_id == leases[3].id and jobs[3].idempotency_key in str(caught.value)
    assert caught.value.lost_keys == (jobs[3].idempotency_key,)
    assert set(caught.value.keys) == {j.idempotency_key for j in jobs}
    assert isinstance(caught.value, errors.LostLeaseError)
    assert all(x.lost for x in leases)  # every key of the set reported lost
    rows = rows_by_key(engine)
    for job in jobs[:3] + jobs[4:]:  # ... and its lease failed, so a retry reclaims it at once
        assert rows[job.idempotency_key].status == "FAIL"
        assert jobs[3].idempotency_key in rows[job.idempotency_key].last_error
    assert rows[jobs[3].idempotency_key].owner_token == stolen.owner_token
    assert rows[jobs[3].idempotency_key].status == "RUNNING"
    retry = claim_many(service, jobs)
    assert len(retry.leases) == 4 and retry[jobs[3]].reason is NotAcquiredReason.HELD


def test_an_expired_lease_nobody_reclaimed_aborts_the_set_too(
    service: LeaseService, engine: sa.Engine
) -> None:
    jobs = days(3)
    leases = claim_many(service, jobs).leases
    force_expire(engine, [jobs[0]])
    with pytest.raises(errors.LostBatchLeaseError) as caught:
        with fenced_transaction_many(service, leases):
            pass
    assert caught.value.lost_keys == (jobs[0].idempotency_key,)
    assert {r.status for r in rows_by_key(engine).values()} == {"FAIL"}


def test_a_lease_known_lost_aborts_before_the_transaction_opens(
    service: LeaseService, rival: LeaseService, engine: sa.Engine
) -> None:
    jobs = days(3)
    leases = claim_many(service, jobs).leases
    force_expire(engine, [jobs[1]])
    assert rival.acquire(jobs[1]) is not None
    assert heartbeat_many(service, leases).lost == (leases[1],)
    with pytest.raises(errors.LostBatchLeaseError, match="open a fenced transaction"):
        with fenced_transaction_many(service, leases):
            raise AssertionError("must not run")
    assert [rows_by_key(engine)[j.idempotency_key].status for j in jobs] == ["FAIL", "RUNNING", "FAIL"]


def test_the_blocks_own_error_rolls_back_and_keeps_the_leases(
    service: LeaseService, engine: sa.Engine
) -> None:
    _domain(engine)
    leases = claim_many(service, days(3)).leases
    with pytest.raises(ZeroDivisionError):
        with fenced_transaction_many(service, leases) as conn:
            _bill(conn, leases)
            1 / 0  # noqa: B018
    assert _billed(engine) == []
    assert not any(x.lost for x in leases)
    assert {r.status for r in rows_by_key(engine).values()} == {"RUNNING"}


def test_the_set_stays_locked_until_the_transaction_ends(pg_engine: sa.Engine) -> None:
    """While a fenced set transaction is open its rows are locked: no other writer (a reclaim, an admin
    change) can touch them before the commit."""
    service = LeaseService(pg_engine, lease_ms=60_000)
    jobs = days(3)
    leases = claim_many(service, jobs).leases
    keys = [j.idempotency_key for j in jobs]
    probe = sa.select(t.c.id).where(t.c.lock_key.in_(keys)).with_for_update(nowait=True)
    with fenced_transaction_many(service, leases):
        with (
            pg_engine.connect() as other,
            pytest.raises(sa.exc.OperationalError, match="could not obtain lock"),
        ):
            other.execute(probe).all()
    with pg_engine.connect() as other:
        assert len(other.execute(probe).all()) == 3


# -- races ---------------------------------------------------------------------------------------------


def test_a_row_purged_between_the_statements_is_claimed_afresh(pg_engine: sa.Engine) -> None:
    """A statement trigger deletes the finished rows right after the claim's INSERT met them."""
    service = LeaseService(pg_engine, lease_ms=60_000)
    jobs = days(4, code="vanish")
    complete_many(service, claim_many(service, jobs[:2]).leases)
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION purge_vanish() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "DELETE FROM joblease_lease WHERE code = 'vanish' AND status = 'SUCCESS'; RETURN NULL; END $$"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER purge_vanish AFTER INSERT ON joblease_lease "
            "FOR EACH STATEMENT EXECUTE FUNCTION purge_vanish()"
        )
    result = claim_many(service, jobs)
    assert [c.lease.attempt if c.lease else c.reason for c in result] == [1, 1, 1, 1]
    assert {r.status for r in rows_by_key(pg_engine).values()} == {"RUNNING"}


@pytest.mark.parametrize("processes", [3])
def test_overlapping_sets_claimed_at_once_have_one_winner_per_key(db_url: str, processes: int) -> None:
    """Real processes claim overlapping ranges (some keys new, some FAIL, some expired) at the same
    moment, bill what they won in a fenced set transaction and complete it: every key billed exactly once,
    by the holder of its SUCCESS row, and no process dies of a deadlock."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"CREATE TABLE {batch_workers.RECORD} (key VARCHAR(80), holder VARCHAR(64))")
            )
        service = LeaseService(engine, lease_ms=60_000)
        jobs = batch_workers.race_days(batch_workers.SHARED + batch_workers.PRIVATE * processes)
        seeded = claim_many(service, jobs[::3]).leases
        fail_many(service, seeded[::2], "seeded failure")
        force_expire(engine, [x.identity for x in seeded[1::2]])
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(processes)
        procs = [
            ctx.Process(target=batch_workers.race_range, args=(db_url, i, processes, barrier))
            for i in range(processes)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0] * processes
        with engine.connect() as conn:
            records = conn.execute(sa.text(f"SELECT key, holder FROM {batch_workers.RECORD}")).all()
        rows = rows_by_key(engine)
        assert sorted(k for k, _ in records) == sorted(j.idempotency_key for j in jobs)  # once each
        for key, holder in records:
            assert rows[key].status == "SUCCESS" and rows[key].holder == holder
        for i in range(processes):  # each process won at least the keys only it claimed
            assert {key for key, holder in records if holder == f"racer-{i}"} >= set(
                batch_workers.private_keys(i)
            )
    finally:
        engine.dispose()


def test_concurrent_reclaims_of_overlapping_sets_have_one_winner_per_attempt(db_url: str) -> None:
    """Processes claim the same set over and over while the others fail what they won: every attempt of
    every key has exactly one winner (the fencing number is never handed out twice), nobody deadlocks."""
    processes, rounds, count = 3, 6, 60
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"CREATE TABLE {batch_workers.ATTEMPTS} "
                    "(key VARCHAR(80), attempt INT, holder VARCHAR(64))"
                )
            )
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(processes)
        procs = [
            ctx.Process(target=batch_workers.reclaim_rounds, args=(db_url, i, rounds, count, barrier))
            for i in range(processes)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0] * processes
        with engine.connect() as conn:
            records = conn.execute(sa.text(f"SELECT key, attempt FROM {batch_workers.ATTEMPTS}")).all()
        rows = rows_by_key(engine)
        assert len(records) == len(set(records))  # no (key, attempt) won twice
        for job in batch_workers.race_days(count):
            attempts = sorted(a for k, a in records if k == job.idempotency_key)
            row = rows[job.idempotency_key]
            assert attempts == list(range(1, row.attempt + 1))  # every attempt had its one winner
            assert row.status == "FAIL"
        # Each process made `rounds` claims; at least the first claim of the set won every key.
        assert len(records) >= count
    finally:
        engine.dispose()


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def test_postgresql_statements_reach_rows_by_key_whatever_the_statistics(pg_engine: sa.Engine) -> None:
    """A range claimed into a fresh table has stale statistics (the planner guesses one row per status).
    Every batch statement must still reach the lease rows only through the primary key, the lock-key
    index or a row's ctid: one lookup per key, never a scan of other rows once per key (which made a
    10,000-key heartbeat quadratic: seconds instead of milliseconds). Plans are read, not timed."""
    service = LeaseService(pg_engine, lease_ms=60_000)
    leases = claim_many(service, days(2_000)).leases
    keyed = bind_rows("postgresql", ("lock_key",), [(x.idempotency_key,) for x in leases])
    pairs = bind_rows("postgresql", ("id", "owner_token"), [(x.id, x.owner_token) for x in leases])
    call = {"p_lease_ms": 60_000, "p_heartbeat_ms": 20_000, "p_holder": "h"}
    statements = [
        (store.RECLAIM_MANY.postgresql, {**call, **keyed}),
        (store.REPORT_MANY.postgresql, keyed),
        (store.HELD_MANY.postgresql, pairs),
        *(
            (store.WRITE_MANY[action].postgresql, {**pairs, "w_result": None, "w_error": "x"})
            for action in ("heartbeat", "complete", "fail")
        ),
    ]
    allowed = {"pk_joblease_lease", "uq_joblease_lease_lock_key"}
    with pg_engine.connect() as conn:
        for statement, params in statements:
            compiled = statement.compile(dialect=pg_engine.dialect)
            sql = "EXPLAIN (FORMAT JSON) " + str(compiled)
            (plan,) = conn.exec_driver_sql(sql, {k: params[k] for k in compiled.params}).one()[0]
            for node in _plan_nodes(plan["Plan"]):
                if node.get("Relation Name") != "joblease_lease" or node["Node Type"] in (
                    "ModifyTable",
                    "Tid Scan",
                ):
                    continue
                assert node["Node Type"] == "Index Scan" and node["Index Name"] in allowed, (
                    str(compiled),
                    node,
                )
