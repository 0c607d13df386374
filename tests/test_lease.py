"""The lease contract, on PostgreSQL and SQLite: one winner, fencing, the state machine, the DB clock."""

from __future__ import annotations

import datetime as dt
import json
import unicodedata
from typing import Any

import pytest
import sqlalchemy as sa

from dagster_joblease import errors
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import (
    MAX_ERROR_CHARS,
    RELEASED_ERROR,
    Lease,
    LeaseService,
    LeaseStatus,
    NotAcquiredReason,
)
from dagster_joblease.storage import create_engine, lease_table
from dagster_joblease.storage import engine as engine_module
from dagster_joblease.storage.clock import ms_until
from tests.conftest import wait_until

JOB = JobIdentity.schedule("daily-billing", "2026-11-29")


def row_of(engine: sa.Engine, job: JobIdentity) -> sa.Row[Any]:
    with engine.connect() as conn:
        return conn.execute(sa.select(lease_table).where(lease_table.c.lock_key == job.idempotency_key)).one()


def row_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(lease_table)).scalar_one())


def force_expire(engine: sa.Engine, job: JobIdentity) -> None:
    """What a long stall looks like from the outside: the holder's expiry lies in the past."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(lease_table)
            .where(lease_table.c.lock_key == job.idempotency_key)
            .values(expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
        )


def test_fresh_acquire(service: LeaseService, engine: sa.Engine) -> None:
    result = service.try_acquire(JOB)
    assert result.acquired and result.reason is None
    lease = result.lease
    assert lease is not None
    assert lease.attempt == 1 and not lease.reclaimed and not lease.lost
    assert lease.idempotency_key == JOB.idempotency_key
    assert lease.lease_ms == 60_000
    assert len(lease.owner_token) == 32
    row = row_of(engine, JOB)
    assert row.id == lease.id
    assert row.status == LeaseStatus.RUNNING
    assert row.owner_token == lease.owner_token
    assert row.attempt == 1
    assert row.lease_ms == 60_000
    assert (row.job_type, row.code, row.run_key) == ("SCHEDULE", "daily-billing", "2026-11-29")
    assert row.finished_at is None and row.last_error is None
    remaining = service.remaining_ms(lease)
    assert remaining is not None and 0 < remaining <= 60_000


def test_loser_is_told_held(service: LeaseService, rival: LeaseService, engine: sa.Engine) -> None:
    lease = service.acquire(JOB)
    assert lease is not None
    result = rival.try_acquire(JOB)
    assert not result.acquired
    assert result.lease is None
    assert result.reason is NotAcquiredReason.HELD
    assert rival.acquire(JOB) is None
    row = row_of(engine, JOB)
    assert (row.owner_token, row.attempt, row.status) == (lease.owner_token, 1, "RUNNING")
    # Another run key of the same code is an independent run.
    assert rival.acquire(JobIdentity.schedule("daily-billing", "2026-11-30")) is not None
    assert row_count(engine) == 2


def test_success_is_never_reclaimed(engine: sa.Engine, rival: LeaseService) -> None:
    service = LeaseService(engine, lease_ms=50)
    lease = service.acquire(JOB)
    assert lease is not None
    service.complete(lease)
    row = row_of(engine, JOB)
    assert row.status == "SUCCESS" and row.finished_at is not None
    force_expire(engine, JOB)
    for _ in range(3):
        result = rival.try_acquire(JOB)
        assert result.reason is NotAcquiredReason.SUCCEEDED
    assert row_of(engine, JOB).attempt == 1


def test_fail_is_reclaimable_with_the_same_key(
    service: LeaseService, rival: LeaseService, engine: sa.Engine
) -> None:
    first = service.acquire(JOB)
    assert first is not None
    service.fail(first, "upstream API said 503")
    row = row_of(engine, JOB)
    assert (row.status, row.last_error) == ("FAIL", "upstream API said 503")
    second = rival.acquire(JOB)
    assert second is not None
    assert second.attempt == 2 and second.reclaimed
    assert second.id == first.id
    assert second.owner_token != first.owner_token
    assert second.idempotency_key == first.idempotency_key == JOB.idempotency_key
    assert second.previous_error == "upstream API said 503"
    row = row_of(engine, JOB)
    assert (row.status, row.attempt, row.owner_token) == ("RUNNING", 2, second.owner_token)
    assert row.finished_at is None
    assert row_count(engine) == 1


def test_fail_accepts_an_exception(service: LeaseService, engine: sa.Engine) -> None:
    lease = service.acquire(JOB)
    assert lease is not None
    service.fail(lease, ValueError("bad row 7"))
    assert row_of(engine, JOB).last_error == "ValueError: bad row 7"


def test_expired_running_lease_is_reclaimable(engine: sa.Engine, rival: LeaseService) -> None:
    short = LeaseService(engine, lease_ms=150, heartbeat_ms=0)
    first = short.acquire(JOB)
    assert first is not None
    assert rival.try_acquire(JOB).reason is NotAcquiredReason.HELD
    wait_until(lambda: (short.remaining_ms(first) or 0) < 0, timeout=10)
    second = rival.acquire(JOB)
    assert second is not None
    assert (second.attempt, second.id) == (2, first.id)
    assert second.owner_token != first.owner_token
    assert second.previous_error is not None and "expired" in second.previous_error
    # The new holder's own lease length applies from now on.
    assert row_of(engine, JOB).lease_ms == 60_000


def test_stale_lease_is_fenced_everywhere(engine: sa.Engine, rival: LeaseService) -> None:
    holder = LeaseService(engine, lease_ms=60_000)
    stale = holder.acquire(JOB)
    assert stale is not None
    force_expire(engine, JOB)
    current = rival.acquire(JOB)
    assert current is not None and current.attempt == 2
    actions = [
        lambda: holder.heartbeat(stale),
        lambda: holder.complete(stale, {"done": True}),
        lambda: holder.fail(stale, "late failure"),
        lambda: holder.release(stale),
    ]
    for action in actions:
        with pytest.raises(errors.LostLeaseError) as info:
            action()
        assert info.value.lease_id == stale.id and info.value.attempt == 1
        assert info.value.idempotency_key == JOB.idempotency_key
    assert stale.lost
    with pytest.raises(errors.LostLeaseError):
        stale.ensure_held()
    assert holder.remaining_ms(stale) is None
    # Nothing the stale holder tried touched the current owner's row.
    row = row_of(engine, JOB)
    assert (row.status, row.owner_token, row.attempt, row.result) == ("RUNNING", current.owner_token, 2, None)
    assert not current.lost
    rival.complete(current)
    assert row_of(engine, JOB).status == "SUCCESS"


def test_finished_lease_is_fenced_too(service: LeaseService) -> None:
    lease = service.acquire(JOB)
    assert lease is not None
    service.complete(lease)
    for action in (service.heartbeat, service.complete, service.release):
        with pytest.raises(errors.LostLeaseError):
            action(lease)
    with pytest.raises(errors.LostLeaseError):
        service.fail(lease, "after success")


def test_release_marks_fail_with_a_reason(
    service: LeaseService, rival: LeaseService, engine: sa.Engine
) -> None:
    lease = service.acquire(JOB)
    assert lease is not None
    service.release(lease)
    row = row_of(engine, JOB)
    assert row.status == "FAIL" and row.last_error == RELEASED_ERROR and "released" in row.last_error
    again = rival.acquire(JOB)
    assert again is not None and again.attempt == 2
    rival.release(again, "shutting down for deploy")
    assert row_of(engine, JOB).last_error == "shutting down for deploy"


def test_error_text_is_bounded(service: LeaseService, engine: sa.Engine) -> None:
    for size in (MAX_ERROR_CHARS, MAX_ERROR_CHARS + 1, 50_000, 2_000_000):
        job = JobIdentity.schedule("bounded", str(size))
        lease = service.acquire(job)
        assert lease is not None
        text = "E" * size
        service.fail(lease, text)
        stored = row_of(engine, job).last_error
        assert len(stored) <= MAX_ERROR_CHARS
        if size <= MAX_ERROR_CHARS:
            assert stored == text
        else:
            assert stored.startswith("E" * 1000) and "cut" in stored


def test_complete_stores_json(service: LeaseService, engine: sa.Engine) -> None:
    data = {"rows": 3, "ids": [1, 2, 3], "note": "été ✓", "nested": {"ok": True, "none": None}}
    lease = service.acquire(JOB)
    assert lease is not None
    with pytest.raises(errors.InvalidPayloadError):
        service.complete(lease, {"when": dt.datetime.now()})
    with pytest.raises(errors.InvalidPayloadError):
        service.complete(lease, {"x": float("nan")})
    assert row_of(engine, JOB).status == "RUNNING"  # refused data did not finish the run
    service.complete(lease, data)
    row = row_of(engine, JOB)
    assert row.status == "SUCCESS"
    assert row.result == data
    assert json.loads(json.dumps(row.result)) == data


def test_initial_runs_once_forever(engine: sa.Engine, rival: LeaseService) -> None:
    service = LeaseService(engine, lease_ms=60_000)
    seed = JobIdentity.initial("seed-default-settings")
    first = service.acquire(seed)
    assert first is not None
    assert rival.try_acquire(seed).reason is NotAcquiredReason.HELD
    service.fail(first, "boom")
    second = rival.acquire(seed)
    assert second is not None and second.attempt == 2
    rival.complete(second)
    force_expire(engine, seed)
    assert service.try_acquire(seed).reason is NotAcquiredReason.SUCCEEDED
    row = row_of(engine, seed)
    assert (row.job_type, row.run_key, row.status) == ("INITIAL", None, "SUCCESS")


def _db_ms(engine: sa.Engine, column: sa.ColumnElement[Any], lease: Lease) -> int:
    with engine.connect() as conn:
        value = conn.execute(sa.select(ms_until(column)).where(lease_table.c.id == lease.id)).scalar_one()
    return int(value)


def test_heartbeat_extends_on_the_db_clock_with_the_holders_lease_ms(
    engine: sa.Engine, other_engine: sa.Engine
) -> None:
    holder = LeaseService(engine, lease_ms=2_000)
    lease = holder.acquire(JOB)
    assert lease is not None
    first_expiry = row_of(engine, JOB).expires_at
    wait_until(lambda: (holder.remaining_ms(lease) or 0) < 1_900)
    # A service with a very different default renews the same lease by the holder's stored 2 s.
    other_defaults = LeaseService(other_engine, lease_ms=3_600_000)
    new_expiry = other_defaults.heartbeat(lease)
    row = row_of(engine, JOB)
    assert new_expiry == row.expires_at
    assert _as_utc(new_expiry) > _as_utc(first_expiry)
    renewed_for = _as_utc(row.expires_at) - _as_utc(row.heartbeat_at)
    assert dt.timedelta(milliseconds=2_000) <= renewed_for < dt.timedelta(milliseconds=2_100)
    remaining = holder.remaining_ms(lease)
    assert remaining is not None and 1_000 < remaining <= 2_000
    assert row.lease_ms == 2_000


def _as_utc(value: dt.datetime) -> dt.datetime:
    # SQLite hands back naive UTC text; PostgreSQL an aware timestamp.
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


HOSTILE = [
    ("x'; DROP TABLE joblease_lease; --", "2026-11-29' OR '1'='1"),
    ('quote"d \\ back\\slash', "100% %s %(run)s ?"),
    ("emoji-🚀-job", "🧪🧪 ∑ ключ 键"),
    ("rapport-e\u0301te\u0301", "cafe\u0301 -- /* c */ ;"),
    ("tab\tinside", "new\u2028line\u2029sep"),
]


@pytest.mark.parametrize(("code", "run_key"), HOSTILE)
def test_hostile_strings_are_stored_and_matched_exactly(
    service: LeaseService, rival: LeaseService, engine: sa.Engine, code: str, run_key: str
) -> None:
    """Quotes, placeholders, comments, emoji and combining accents are data, never SQL."""
    if "\t" in code:
        with pytest.raises(errors.InvalidJobIdentityError):
            JobIdentity.schedule(code, run_key)
        return
    job = JobIdentity.schedule(code, run_key)
    lease = service.acquire(job)
    assert lease is not None
    row = row_of(engine, job)
    assert row.code == unicodedata.normalize("NFC", code) == job.code
    assert row.run_key == unicodedata.normalize("NFC", run_key) == job.run_key
    nfd = JobIdentity.schedule(unicodedata.normalize("NFD", code), unicodedata.normalize("NFD", run_key))
    assert nfd.idempotency_key == job.idempotency_key
    assert rival.try_acquire(nfd).reason is NotAcquiredReason.HELD
    with engine.connect() as conn:
        by_value = conn.execute(
            sa.select(lease_table.c.id).where(
                lease_table.c.code == job.code, lease_table.c.run_key == job.run_key
            )
        ).all()
    assert [r.id for r in by_value] == [lease.id]
    service.complete(lease)
    assert row_count(engine) == 1


@pytest.mark.parametrize("bad", ["daily-billing", ("SCHEDULE", "a", "b"), None, {"code": "x"}])
def test_non_identity_is_refused_before_any_sql(bad: Any) -> None:
    engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/does_not_exist?connect_timeout=2")
    try:
        service = LeaseService(engine)
        with pytest.raises(errors.InvalidJobIdentityError):
            service.try_acquire(bad)
        with pytest.raises(errors.InvalidJobIdentityError):
            service.acquire(bad)
        called: list[object] = []
        with pytest.raises(errors.InvalidJobIdentityError):
            service.run_exclusive(bad, called.append)
        assert called == []
        # And the engine really is unreachable: the same call with a valid identity is a StorageError.
        with pytest.raises(errors.StorageError):
            service.acquire(JOB)
    finally:
        engine.dispose()


def test_storage_errors_never_show_the_password() -> None:
    engine = create_engine("postgresql+psycopg://app:s3cret-pw@127.0.0.1:1/app_db?connect_timeout=2")
    try:
        with pytest.raises(errors.StorageError) as info:
            LeaseService(engine).acquire(JOB)
    finally:
        engine.dispose()
    assert "s3cret-pw" not in str(info.value)
    assert "acquire a lease" in str(info.value)


def test_invalid_identities_never_reach_the_database(engine: sa.Engine) -> None:
    for args in [("SCHEDULE", "code", None), ("INITIAL", "code", "k"), ("SCHEDULE", "c\x00", "k")]:
        with pytest.raises(errors.InvalidJobIdentityError):
            JobIdentity(*args)
    assert row_count(engine) == 0


def test_no_data_is_sql_null(service: LeaseService, engine: sa.Engine) -> None:
    first = service.acquire(JOB)
    assert first is not None
    service.fail(first, "x")
    second = service.acquire(JOB)
    assert second is not None
    service.complete(second)
    with engine.connect() as conn:
        nulls = conn.execute(
            sa.select(sa.func.count()).select_from(lease_table).where(lease_table.c.result.is_(None))
        ).scalar_one()
    assert nulls == 1


def _terminate_pooled_backend(engine: sa.Engine, admin: sa.Engine) -> None:
    """Kill every other session on the database: the pool's and the claims' autocommit connections."""
    with admin.connect() as conn:
        killed = conn.execute(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ).scalar_one()
    assert killed >= 1


def test_a_dead_idle_connection_is_replaced_before_use(
    pg_engine: sa.Engine, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = create_engine(pg_url)
    try:
        service = LeaseService(pg_engine, lease_ms=60_000)
        assert service.acquire(JobIdentity.schedule("ping", "1")) is not None
        _terminate_pooled_backend(pg_engine, admin)
        # Idle past the threshold: the checkout ping finds it dead and the pool reconnects, unseen.
        monkeypatch.setattr(engine_module, "IDLE_PING_AFTER_S", 0.0)
        assert service.acquire(JobIdentity.schedule("ping", "2")) is not None

        # A connection reused at once is not pinged: the failure surfaces once, then the pool recovers.
        monkeypatch.setattr(engine_module, "IDLE_PING_AFTER_S", 3600.0)
        _terminate_pooled_backend(pg_engine, admin)
        with pytest.raises(errors.StorageError):
            service.acquire(JobIdentity.schedule("ping", "3"))
        assert service.acquire(JobIdentity.schedule("ping", "3")) is not None
    finally:
        admin.dispose()


def _domain_table(engine: sa.Engine) -> sa.Table:
    table = sa.Table("fenced_domain", sa.MetaData(), sa.Column("k", sa.String(32), primary_key=True))
    table.create(engine, checkfirst=True)
    return table


def _domain_keys(engine: sa.Engine, table: sa.Table) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.select(table.c.k)).scalars())


def test_fenced_transaction_commits_while_held(service: LeaseService, engine: sa.Engine) -> None:
    table = _domain_table(engine)
    lease = service.acquire(JobIdentity.schedule("fenced", "held"), lease_ms=60_000)
    assert lease is not None
    with service.fenced_transaction(lease) as conn:
        conn.execute(table.insert().values(k="held"))
    assert _domain_keys(engine, table) == ["held"]
    assert not lease.lost


def test_fenced_transaction_rolls_back_the_domain_change_after_a_reclaim(
    service: LeaseService, rival: LeaseService, engine: sa.Engine
) -> None:
    table = _domain_table(engine)
    job = JobIdentity.schedule("fenced", "reclaimed")
    stale = service.acquire(job, lease_ms=60_000)
    assert stale is not None
    force_expire(engine, job)
    fresh = rival.acquire(job)
    assert fresh is not None and fresh.attempt == 2
    with pytest.raises(errors.LostLeaseError), service.fenced_transaction(stale) as conn:
        conn.execute(table.insert().values(k="stale"))
    assert stale.lost
    assert _domain_keys(engine, table) == []
    with rival.fenced_transaction(fresh) as conn:
        conn.execute(table.insert().values(k="fresh"))
    assert _domain_keys(engine, table) == ["fresh"]


def test_fenced_transaction_refuses_an_expired_lease_nobody_reclaimed(
    service: LeaseService, engine: sa.Engine
) -> None:
    table = _domain_table(engine)
    job = JobIdentity.schedule("fenced", "expired")
    lease = service.acquire(job, lease_ms=60_000)
    assert lease is not None
    force_expire(engine, job)
    with pytest.raises(errors.LostLeaseError), service.fenced_transaction(lease) as conn:
        conn.execute(table.insert().values(k="late"))
    assert _domain_keys(engine, table) == []


@pytest.mark.parametrize("finish", ["running", "succeeded"])
def test_a_refused_claim_is_a_plain_read_that_never_waits_on_the_row(pg_url: str, finish: str) -> None:
    """A claim refused because the run is held or done says why in the same statement without locking the
    row: it neither waits behind a transaction that holds the row nor writes (no commit flush). The
    ``ON CONFLICT DO UPDATE`` alone locks the row even to refuse, so it would block here until the
    lock timeout."""
    holder_engine = create_engine(pg_url)
    rival_engine = create_engine(pg_url, connect_args={"options": "-c lock_timeout=3000"})
    try:
        holder = LeaseService(holder_engine)
        lease = holder.acquire(JOB)
        assert lease is not None
        if finish == "succeeded":
            holder.complete(lease)
        with holder_engine.begin() as conn:
            conn.execute(
                sa.select(lease_table.c.id)
                .where(lease_table.c.lock_key == JOB.idempotency_key)
                .with_for_update()
            )
            result = LeaseService(rival_engine).try_acquire(JOB)
        expected = NotAcquiredReason.HELD if finish == "running" else NotAcquiredReason.SUCCEEDED
        assert result.reason is expected
        row = row_of(holder_engine, JOB)
        assert row.attempt == 1 and row.owner_token == lease.owner_token
    finally:
        holder_engine.dispose()
        rival_engine.dispose()


@pytest.mark.postgres_only
def test_a_row_purged_between_the_insert_and_the_reclaim_is_claimed_afresh(pg_engine: sa.Engine) -> None:
    """On PostgreSQL a claim that meets a row takes a second statement; a purge can remove the row in
    between. A statement trigger deletes it at exactly that moment: the claim then inserts again."""
    service = LeaseService(pg_engine, lease_ms=60_000)
    job = JobIdentity.schedule("vanish", "1")
    lease = service.acquire(job)
    assert lease is not None
    service.complete(lease)
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION purge_vanish() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "DELETE FROM joblease_lease WHERE code = 'vanish' AND status = 'SUCCESS'; RETURN NULL; END $$"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER purge_vanish AFTER INSERT ON joblease_lease "
            "FOR EACH STATEMENT EXECUTE FUNCTION purge_vanish()"
        )
    # A service that has not met the row yet starts with the insert (``service`` would start with the
    # reclaim-or-status statement, see test_a_known_key_whose_row_was_purged_is_claimed_afresh).
    again = LeaseService(pg_engine, lease_ms=60_000).try_acquire(job)
    assert again.lease is not None, again.reason
    assert again.lease.attempt == 1
    with pg_engine.connect() as conn:
        rows = conn.execute(sa.select(lease_table.c.status).where(lease_table.c.code == "vanish")).all()
    assert [r.status for r in rows] == ["RUNNING"]
