"""Migrations: idempotent, safe when several processes race them, independent of a host's Alembic."""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext

from dagster_joblease import errors
from dagster_joblease.storage import (
    check_schema,
    create_engine,
    current_revision,
    head_revision,
    metadata,
    migrate,
    require_schema,
)
from dagster_joblease.storage.migrate import SchemaDiff
from dagster_joblease.storage.schema import HEAD_REVISION, VERSION_TABLE
from tests import lease_workers
from tests.conftest import _admin_execute, admin_url

OUR_TABLES = {
    "joblease_lease",
    "joblease_outbox",
    "joblease_outbox_event",
    "joblease_inbox",
    "joblease_route_group",
    VERSION_TABLE,
}


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A brand-new PostgreSQL database with nothing in it (not cloned from the migrated template)."""
    name = f"joblease_empty_{uuid.uuid4().hex[:10]}"
    _admin_execute(f'CREATE DATABASE "{name}"')
    yield admin_url().set(database=name).render_as_string(hide_password=False)
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh' / 'joblease.sqlite'}"
    return str(request.getfixturevalue("empty_pg_url"))


@pytest.fixture
def empty_engine(empty_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(empty_url)
    yield eng
    eng.dispose()


def table_names(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_migrate_from_empty_and_again(empty_engine: sa.Engine) -> None:
    with pytest.raises(errors.SchemaNotAtHeadError) as info:
        require_schema(empty_engine)
    assert info.value.db_revision is None and info.value.head_revision == head_revision()
    assert current_revision(empty_engine) is None
    assert not check_schema(empty_engine).ok

    assert migrate(empty_engine) is None
    assert current_revision(empty_engine) == head_revision() == HEAD_REVISION
    assert migrate(empty_engine) == head_revision()  # idempotent: nothing to do the second time
    assert migrate(empty_engine) == head_revision()
    require_schema(empty_engine)
    assert OUR_TABLES <= table_names(empty_engine)
    with empty_engine.connect() as conn:
        versions = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    assert versions == [HEAD_REVISION]


def test_check_schema_is_ok_after_migrate(engine: sa.Engine) -> None:
    diff = check_schema(engine)
    assert isinstance(diff, SchemaDiff)
    assert diff.differences == ()
    assert diff.db_revision == diff.head_revision == head_revision()
    assert diff.ok


def test_check_schema_reports_a_dropped_index(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_joblease_lease_finished_at"))
    diff = check_schema(engine)
    assert not diff.ok
    assert any("ix_joblease_lease_finished_at" in d for d in diff.differences), diff.differences
    # The revision alone would not have told us: it still says head.
    assert diff.db_revision == head_revision()


def test_check_schema_reports_an_added_column(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE joblease_outbox ADD COLUMN surprise INTEGER"))
    diff = check_schema(engine)
    assert not diff.ok
    assert any("surprise" in d for d in diff.differences), diff.differences


def test_check_schema_ignores_foreign_tables(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE host_orders (id INTEGER PRIMARY KEY, total INTEGER)"))
    assert check_schema(engine).ok


def test_coexists_with_a_foreign_alembic_version_table(empty_engine: sa.Engine) -> None:
    with empty_engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)"))
        conn.execute(sa.text("INSERT INTO alembic_version (version_num) VALUES ('hostapp_7f3a')"))
        conn.execute(sa.text("CREATE TABLE host_orders (id INTEGER PRIMARY KEY)"))
    migrate(empty_engine)
    migrate(empty_engine)
    with empty_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == [
            "hostapp_7f3a"
        ]
        # The host application's Alembic still sees its own revision, ours sees ours.
        assert MigrationContext.configure(conn).get_current_revision() == "hostapp_7f3a"
    assert current_revision(empty_engine) == head_revision()
    assert check_schema(empty_engine).ok
    assert {"alembic_version", "host_orders"} | OUR_TABLES <= table_names(empty_engine)
    assert set(metadata.tables) <= table_names(empty_engine)


@pytest.mark.chaos
def test_six_processes_migrate_a_fresh_database_at_once(empty_url: str) -> None:
    mp = multiprocessing.get_context("fork")
    processes = 6
    barrier = mp.Barrier(processes)
    results = mp.Queue()
    workers = [
        mp.Process(target=lease_workers.migrate_worker, args=(empty_url, barrier, results))
        for _ in range(processes)
    ]
    for proc in workers:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for proc in workers:
        proc.join(timeout=60)
    assert [o[0] for o in outcomes] == ["ok"] * processes, outcomes
    assert [proc.exitcode for proc in workers] == [0] * processes
    engine = create_engine(empty_url)
    try:
        assert current_revision(engine) == head_revision()
        assert check_schema(engine).ok
        with engine.connect() as conn:
            assert conn.execute(sa.text(f"SELECT count(*) FROM {VERSION_TABLE}")).scalar_one() == 1
    finally:
        engine.dispose()


def _index_names(engine: sa.Engine, table: str) -> set[str]:
    return {ix["name"] for ix in sa.inspect(engine).get_indexes(table) if ix["name"]}


def test_index_audit_upgrades_a_0001_database_with_rows_in_place(empty_engine: sa.Engine) -> None:
    """Rows written under 0001's schema stay claimable, purgeable and countable after the index audit."""
    from dagster_joblease import admin, outbox
    from dagster_joblease.identity import JobIdentity
    from dagster_joblease.lease import LeaseService

    migrate(empty_engine, "0001")
    assert "ix_joblease_lease_status_finished_at" in _index_names(empty_engine, "joblease_lease")
    held = JobIdentity.schedule("audit", "held")
    done = JobIdentity.schedule("audit", "done")
    now = "CURRENT_TIMESTAMP"
    with empty_engine.begin() as conn:  # 0001's columns, written the way 0001-era code wrote them
        for job, status, finished, expires in (
            (held, "RUNNING", "NULL", "'2999-01-01 00:00:00+00'"),
            (done, "SUCCESS", "'2000-01-01 00:00:00+00'", "'2000-01-01 00:00:00+00'"),
        ):
            conn.execute(
                sa.text(
                    "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, "
                    "attempt, lease_ms, holder, created_at, acquired_at, heartbeat_at, expires_at, "
                    "finished_at) "
                    f"VALUES (:key, 'SCHEDULE', 'audit', :run_key, :status, 'tok', 1, 60000, 'h', {now}, "
                    f"{now}, {now}, {expires}, {finished})"
                ),
                {"key": job.idempotency_key, "run_key": job.run_key, "status": status},
            )
        for key, status, sent in (
            ("v2:p", "PENDING", "NULL"),
            ("v2:d", "DEAD", "NULL"),
            ("v2:s", "SENT", now),
        ):
            conn.execute(
                sa.text(
                    "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, "
                    "attempts, next_attempt_at, created_at, updated_at, sent_at) VALUES (:key, 'billing', "
                    f"'{{}}', :sha, :status, 0, {now}, {now}, {now}, {sent})"
                ),
                {"key": key, "sha": "0" * 64, "status": status},
            )

    migrate(empty_engine)

    assert current_revision(empty_engine) == head_revision()
    assert check_schema(empty_engine).ok
    lease_ix = _index_names(empty_engine, "joblease_lease")
    outbox_ix = _index_names(empty_engine, "joblease_outbox")
    assert {"ix_joblease_lease_finished_at", "ix_joblease_lease_live"} <= lease_ix
    assert "ix_joblease_lease_status_finished_at" not in lease_ix
    assert "ix_joblease_outbox_dead" in outbox_ix
    assert "ix_joblease_outbox_status_topic" not in outbox_ix
    service = LeaseService(empty_engine)
    assert service.try_acquire(held).reason is not None  # still held by its 0001-era holder
    assert service.try_acquire(JobIdentity.schedule("audit", "fresh")).acquired
    day = 86_400_000
    assert (
        admin.purge_leases(empty_engine, finished_before_ms=day, min_replay_window_ms=day, dry_run=True) == 1
    )
    assert admin.purge_sent(empty_engine, older_than_ms=0, min_retention_ms=0, dry_run=True) == 1
    assert outbox.delivery_health(empty_engine, topics=["billing"]).dead == 1
    assert [r.idempotency_key for r in admin.list_outbox(empty_engine, status="dead")] == ["v2:d"]
    assert [r.idempotency_key for r in admin.list_outbox(empty_engine, status="pending")] == ["v2:p"]
    running = admin.list_leases(empty_engine, status="running")
    assert sorted(r.run_key for r in running) == ["fresh", "held"]


def test_index_audit_downgrades_to_the_previous_indexes(empty_engine: sa.Engine) -> None:
    migrate(empty_engine)
    from alembic import command

    from dagster_joblease.storage.migrate import _config

    with empty_engine.begin() as conn:
        command.downgrade(_config(conn), "0002")  # the revision before the index audit
    assert "ix_joblease_lease_status_finished_at" in _index_names(empty_engine, "joblease_lease")
    assert "ix_joblease_outbox_status_topic" in _index_names(empty_engine, "joblease_outbox")
    assert "ix_joblease_outbox_dead" not in _index_names(empty_engine, "joblease_outbox")
    assert "ix_joblease_lease_live" not in _index_names(empty_engine, "joblease_lease")
    migrate(empty_engine)
    assert check_schema(empty_engine).ok


def _lease_plan_indexes(engine: sa.Engine, stmt: sa.Select[Any]) -> set[str]:
    """The indexes PostgreSQL's plan of ``stmt`` reads, with sequential scans disabled for the sample."""
    compiled = stmt.compile(engine, compile_kwargs={"literal_binds": True})
    with engine.connect() as conn:
        conn.execute(sa.text("SET enable_seqscan = off"))
        plan = "\n".join(conn.execute(sa.text(f"EXPLAIN {compiled}")).scalars())
    assert "Seq Scan" not in plan, plan
    return {name for name in _index_names(engine, "joblease_lease") if name in plan}


def test_claim_indexes_upgrade_a_0004_database_with_rows_in_place(empty_engine: sa.Engine) -> None:
    """0005: the full (code, run_key) index becomes the succeeded rows' one; a code's rows of every status
    are still found (through the live and succeeded indexes), and the downgrade restores the full index."""
    from alembic import command

    from dagster_joblease import admin
    from dagster_joblease.identity import JobIdentity
    from dagster_joblease.lease import LeaseService
    from dagster_joblease.storage import leases
    from dagster_joblease.storage.migrate import _config
    from dagster_joblease.storage.schema import any_status, lease_table

    migrate(empty_engine, "0004")
    assert "ix_joblease_lease_code_run_key" in _index_names(empty_engine, "joblease_lease")
    service = LeaseService(empty_engine)
    jobs = {
        status: JobIdentity.schedule("claims", status.lower()) for status in ("RUNNING", "FAIL", "SUCCESS")
    }
    for status, job in jobs.items():  # written by 0004-era code, before the migration
        lease = service.acquire(job)
        assert lease is not None
        if status == "FAIL":
            service.fail(lease, "boom")
        elif status == "SUCCESS":
            service.complete(lease)
    service.acquire(JobIdentity.initial("solo"))

    def found() -> None:
        listed = admin.list_leases(empty_engine, code="claims")
        assert sorted((r.run_key or "", r.status) for r in listed) == [
            ("fail", "FAIL"),
            ("running", "RUNNING"),
            ("success", "SUCCESS"),
        ]
        assert [r.status for r in admin.list_leases(empty_engine, code="claims", status="success")] == [
            "SUCCESS"
        ]
        keys = ["fail", "running", "success", "never"]
        with empty_engine.connect() as conn:
            assert leases.run_keys_with_rows(conn, "claims", keys) == {"fail", "running", "success"}
        with pytest.raises(errors.NotFoundError, match="3 SCHEDULE run"):
            admin.show_lease(empty_engine, "claims")  # no INITIAL run: the count of its SCHEDULE rows
        with pytest.raises(errors.NotFoundError, match="--code claims --run-key success"):
            admin.show_lease(empty_engine, "claims", "succes")  # the near-match hint reads them too
        assert admin.show_lease(empty_engine, "solo").run_key is None

    migrate(empty_engine)
    assert current_revision(empty_engine) == head_revision() == HEAD_REVISION
    assert check_schema(empty_engine).ok
    lease_ix = _index_names(empty_engine, "joblease_lease")
    assert "ix_joblease_lease_code_run_key" not in lease_ix
    assert {"ix_joblease_lease_succeeded", "ix_joblease_lease_live"} <= lease_ix
    found()
    t = lease_table
    if empty_engine.dialect.name == "postgresql":
        by_code = sa.select(t.c.id).where(t.c.code == "claims", any_status())
        assert _lease_plan_indexes(empty_engine, by_code) == {
            "ix_joblease_lease_live",
            "ix_joblease_lease_succeeded",
        }
    # A claim and a reclaim go on; the reclaimed FAIL row leaves no entry in the succeeded index.
    assert service.try_acquire(jobs["FAIL"]).lease is not None
    assert service.try_acquire(JobIdentity.schedule("claims", "fresh")).acquired
    with empty_engine.connect() as conn:
        assert leases.run_keys_with_rows(conn, "claims", ["fresh", "fail"]) == {"fresh", "fail"}

    with empty_engine.begin() as conn:
        command.downgrade(_config(conn), "0004")
    lease_ix = _index_names(empty_engine, "joblease_lease")
    assert "ix_joblease_lease_code_run_key" in lease_ix
    assert "ix_joblease_lease_succeeded" not in lease_ix
    assert current_revision(empty_engine) == "0004"
    assert len(admin.list_leases(empty_engine, code="claims")) == 4
    migrate(empty_engine)
    assert check_schema(empty_engine).ok


_BAD_ROWS = {
    "joblease_lease": (
        "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, attempt,"
        " lease_ms, created_at, acquired_at, heartbeat_at, expires_at) VALUES (:key, :job_type, 'c', 'r',"
        " :status, 't', :attempt, 1000, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP,"
        " CURRENT_TIMESTAMP)",
        [
            {"job_type": "SCHEDULE", "status": "running", "attempt": 1},
            {"job_type": "BOTH", "status": "RUNNING", "attempt": 1},
            {"job_type": "SCHEDULE", "status": "RUNNING", "attempt": 0},
        ],
    ),
    "joblease_outbox": (
        "INSERT INTO joblease_outbox (idempotency_key, topic, payload, payload_sha256, status, attempts,"
        " next_attempt_at, created_at, updated_at) VALUES (:key, 't', '{}', 'h', :status, :attempts,"
        " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)",
        [{"status": "LOST", "attempts": 0}, {"status": "PENDING", "attempts": -1}],
    ),
    "joblease_inbox": (
        "INSERT INTO joblease_inbox (idempotency_key, payload_sha256, status, created_at)"
        " VALUES (:key, 'h', :status, CURRENT_TIMESTAMP)",
        [{"status": "MAYBE"}],
    ),
}


def _refused_rows(engine: sa.Engine) -> int:
    """Try every rule-breaking row of ``_BAD_ROWS``; how many the database refused (each in its own
    transaction, so one refusal does not hide the next)."""
    refused = 0
    for table, (sql, rows) in _BAD_ROWS.items():
        for i, row in enumerate(rows):
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text(sql), {"key": f"bad-{table}-{i}", **row})
            except sa.exc.IntegrityError:
                refused += 1
    return refused


def test_check_domains_upgrade_a_0005_database_with_rows_in_place(empty_engine: sa.Engine) -> None:
    """0006: on PostgreSQL the one-column rules move from table CHECKs onto domains (a table CHECK is
    prepared again by every one-row write); rows already there keep working, every rule-breaking value is
    still refused, the partial indexes still serve their queries, and the downgrade restores the CHECKs."""
    from alembic import command

    from dagster_joblease import admin, outbox
    from dagster_joblease.identity import JobIdentity
    from dagster_joblease.lease import LeaseService
    from dagster_joblease.storage.migrate import _config
    from dagster_joblease.storage.schema import outbox_table

    pg = empty_engine.dialect.name == "postgresql"
    migrate(empty_engine, "0005")
    service = LeaseService(empty_engine)
    failed = service.acquire(JobIdentity.schedule("dom", "failed"))
    assert failed is not None
    service.fail(failed, "boom")
    done = service.acquire(JobIdentity.schedule("dom", "done"))
    assert done is not None
    service.complete(done)
    with empty_engine.begin() as conn:
        outbox.enqueue_once(conn, topic="t", payload={"n": 1}, idempotency_key="dom-1")

    def checks() -> set[str]:
        return {
            str(ck["name"])
            for table in _BAD_ROWS
            for ck in sa.inspect(empty_engine).get_check_constraints(table)
        }

    before = checks()
    assert len(before) == 7  # lease 4, outbox 2, inbox 1
    assert _refused_rows(empty_engine) == 6

    migrate(empty_engine)
    assert current_revision(empty_engine) == head_revision() == HEAD_REVISION
    assert check_schema(empty_engine).ok, check_schema(empty_engine).differences
    # PostgreSQL: no table CHECK left on the hot tables; SQLite keeps every one.
    assert checks() == (set() if pg else before)
    assert _refused_rows(empty_engine) == 6  # the domains refuse what the checks refused
    if pg:
        with empty_engine.connect() as conn:
            types = dict(
                conn.execute(
                    sa.text(
                        "SELECT table_name || '.' || column_name, domain_name FROM information_schema.columns"
                        " WHERE domain_name LIKE 'joblease_%'"
                    )
                ).all()
            )
        assert types == {
            "joblease_lease.status": "joblease_lease_status",
            "joblease_lease.job_type": "joblease_job_type",
            "joblease_lease.attempt": "joblease_attempt",
            "joblease_outbox.status": "joblease_outbox_status",
            "joblease_outbox.attempts": "joblease_attempts",
            "joblease_inbox.status": "joblease_inbox_status",
        }
        due = sa.select(outbox_table.c.id).where(
            outbox_table.c.status == "PENDING", outbox_table.c.next_attempt_at <= sa.func.now()
        )
        compiled = due.compile(empty_engine, compile_kwargs={"literal_binds": True})
        with empty_engine.connect() as conn:
            conn.execute(sa.text("SET enable_seqscan = off"))
            plan = "\n".join(conn.execute(sa.text(f"EXPLAIN {compiled}")).scalars())
        assert "ix_joblease_outbox_due" in plan, plan

    # The rows written before go on: the failed lease is reclaimed, the done one refused, the row delivered.
    assert service.try_acquire(JobIdentity.schedule("dom", "failed")).lease is not None
    assert not service.try_acquire(JobIdentity.schedule("dom", "done")).acquired
    assert service.try_acquire(JobIdentity.initial("dom-initial")).acquired
    assert {r.status for r in admin.list_leases(empty_engine, code="dom")} == {"RUNNING", "SUCCESS"}
    with empty_engine.connect() as conn:
        assert conn.execute(sa.select(outbox_table.c.status, outbox_table.c.attempts)).all() == [
            ("PENDING", 0)
        ]

    with empty_engine.begin() as conn:
        command.downgrade(_config(conn), "0005")
    assert current_revision(empty_engine) == "0005"
    assert len(checks()) == 7
    assert _refused_rows(empty_engine) == 6
    migrate(empty_engine)
    assert check_schema(empty_engine).ok


def test_check_schema_reports_a_column_that_lost_its_domain(pg_engine: sa.Engine) -> None:
    with pg_engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE joblease_outbox ALTER COLUMN status TYPE VARCHAR(16)"))
    diff = check_schema(pg_engine)
    assert not diff.ok
    assert any("joblease_outbox" in d and "status" in d for d in diff.differences), diff.differences


def _outbox_status_refused(engine: sa.Engine, status: str) -> bool:
    """Whether the database refuses an outbox row with ``status`` (the row is rolled back either way)."""
    from dagster_joblease import outbox

    try:
        with engine.begin() as conn:
            outbox.enqueue_once(conn, topic="t", payload={}, idempotency_key=f"probe-{uuid.uuid4().hex}")
            conn.execute(
                sa.text("UPDATE joblease_outbox SET status = :s WHERE idempotency_key LIKE 'probe-%'"),
                {"s": status},
            )
            raise _RolledBack
    except sa.exc.IntegrityError:
        return True
    except _RolledBack:
        return False


class _RolledBack(Exception):
    pass


def test_outbox_skipped_status_upgrades_a_0008_database_with_rows_in_every_status(
    empty_engine: sa.Engine,
) -> None:
    """0009 widens the outbox status rule (PostgreSQL: the domain's CHECK, replaced NOT VALID and then
    validated; SQLite: the table rebuilt) to admit SKIPPED. Rows in every status written before keep
    their values, ids, keys and indexes; a value outside the rule is still refused; the downgrade turns
    SKIPPED rows into what the previous build made of a skip (DEAD without an ordering key)."""
    from alembic import command

    from dagster_joblease import outbox
    from dagster_joblease.storage.migrate import _config
    from dagster_joblease.storage.schema import outbox_table as t

    migrate(empty_engine, "0008")
    statuses = {"p": "PENDING", "s": "SENT", "d": "DEAD", "k": "DEAD"}
    with empty_engine.begin() as conn:
        for name in statuses:
            outbox.enqueue_once(
                conn,
                topic="t",
                payload={"n": name},
                idempotency_key=name,
                ordering_key="key" if name == "k" else None,
            )
        for name, status in statuses.items():
            conn.execute(sa.update(t).where(t.c.idempotency_key == name).values(status=status))

    def rows() -> list[Any]:
        with empty_engine.connect() as conn:
            return list(
                conn.execute(
                    sa.select(t.c.id, t.c.idempotency_key, t.c.status, t.c.ordering_key).order_by(t.c.id)
                )
            )

    before = rows()
    assert _outbox_status_refused(empty_engine, "SKIPPED")
    migrate(empty_engine)
    assert current_revision(empty_engine) == head_revision() == HEAD_REVISION
    assert check_schema(empty_engine).ok, check_schema(empty_engine).differences
    assert rows() == before
    assert not _outbox_status_refused(empty_engine, "SKIPPED")
    assert _outbox_status_refused(empty_engine, "BOGUS")
    assert _refused_rows(empty_engine) == 6  # every other rule still holds
    assert _index_names(empty_engine, "joblease_outbox") >= {
        "ix_joblease_outbox_due",
        "ix_joblease_outbox_dead",
        "ix_joblease_outbox_sent_at",
        "ix_joblease_outbox_claim_group",
        "ix_joblease_outbox_ordering",
    }
    if empty_engine.dialect.name == "postgresql":
        with empty_engine.connect() as conn:
            validated = (
                conn.execute(
                    sa.text(
                        "SELECT convalidated FROM pg_constraint c JOIN pg_type y ON y.oid = c.contypid"
                        " WHERE y.typname = 'joblease_outbox_status'"
                    )
                )
                .scalars()
                .all()
            )
        assert validated == [True]

    with empty_engine.begin() as conn:
        conn.execute(sa.update(t).where(t.c.idempotency_key == "k").values(status="SKIPPED"))
    with empty_engine.begin() as conn:
        command.downgrade(_config(conn), "0008")
    assert current_revision(empty_engine) == "0008"
    assert _outbox_status_refused(empty_engine, "SKIPPED")
    after = {r.idempotency_key: (r.status, r.ordering_key) for r in rows()}
    assert after == {"p": ("PENDING", None), "s": ("SENT", None), "d": ("DEAD", None), "k": ("DEAD", None)}
    migrate(empty_engine)
    assert check_schema(empty_engine).ok
    assert not _outbox_status_refused(empty_engine, "SKIPPED")
