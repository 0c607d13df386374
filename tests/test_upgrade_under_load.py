"""A worker that keeps claiming, enqueuing and processing inbox keys while `joblease db upgrade` retypes
columns under it (0006: status, job_type, attempt and attempts become domains) sees no error.

Retyping a column that a prepared statement returns invalidates the statement on the server ("cached plan
must not change result type", SQLSTATE 0A000). Before storage.driver handled it, the library's autocommit
connections kept the stale statement (psycopg drops its prepared statements only on a rollback, and an
autocommit statement never rolls back): ``claim_many`` failed on every call until the process restarted.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import psycopg
import psycopg.sql
import pytest
import sqlalchemy as sa

from dagster_joblease import batch, errors, outbox
from dagster_joblease.identity import JobIdentity
from dagster_joblease.inbox import Inbox
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine, current_revision, driver, migrate
from dagster_joblease.storage.driver import lost_plan
from dagster_joblease.storage.schema import outbox_table
from dagster_joblease.storage.transaction import callers_transaction
from tests.conftest import wait_until

#: 0007's nullable inbox columns, added ahead so that this code's inbox runs on the 0005 schema (0007 adds
#: nothing else; the retype under test is 0006's).
_INBOX_0007 = (
    "ALTER TABLE joblease_inbox ADD COLUMN response_headers TEXT, ADD COLUMN response_content BYTEA, "
    "ADD COLUMN fence BIGINT"
)


class Worker(threading.Thread):
    """Rounds of claims (a set, a reclaim, one lease), enqueues (a set, one row with a backlog bound) and
    inbox keys (new and replayed), each checked; every exception is kept."""

    def __init__(self, engine: sa.Engine, *, inbox: bool = True) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.with_inbox = inbox
        self.service = LeaseService(engine)
        self.inbox = Inbox(engine)
        self.rounds = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.round(self.rounds)
            except BaseException as exc:
                self.errors.append(exc)
            self.rounds += 1

    def round(self, i: int) -> None:
        keys = [JobIdentity.schedule("up", f"{i}-{j}") for j in range(3)]
        claim = batch.claim_many(self.service, [*keys, JobIdentity.schedule("up", f"{i - 1}-0")])
        assert len(claim.leases) == 4, [(k.idempotency_key, k.reason) for k in claim]
        with batch.fenced_transaction_many(self.service, claim.leases) as conn:
            rows = [(f"{lease.idempotency_key}/{lease.attempt}", "up", {"i": i}) for lease in claim.leases]
            assert outbox.enqueue_many(conn, rows) == (True, True, True, True)
            assert outbox.enqueue_once(
                conn, idempotency_key=f"one-{i}", topic="up", payload={}, max_pending=10**6
            )
        batch.complete_many(self.service, claim.leases[1:]).raise_if_lost()
        batch.fail_many(self.service, claim.leases[:1], "again next round").raise_if_lost()
        single = self.service.run_exclusive(JobIdentity.schedule("one", str(i)), lambda lease: lease.attempt)
        assert single.acquired and single.result == 1

        if not self.with_inbox:
            return

        def effect(conn: sa.Connection) -> tuple[int, str]:
            return 201, f'{{"i": {i}}}'

        first = self.inbox.process(f"in-{i}", {"i": i}, effect)
        again = self.inbox.process(f"in-{i}", {"i": i}, effect)
        assert (first.status_code, first.replayed, again.replayed) == (201, False, True)


def test_a_running_worker_survives_the_retyping_upgrade(url_at_0005: str) -> None:
    engine = create_engine(url_at_0005)
    with engine.begin() as conn:
        conn.exec_driver_sql(_INBOX_0007)
    worker = Worker(engine)
    try:
        worker.start()
        # Enough rounds that every statement is prepared (the library's at their first execution,
        # psycopg's own preparation of SQLAlchemy's after five).
        wait_until(lambda: worker.rounds >= 8 or bool(worker.errors), timeout=120)
        assert not worker.errors, worker.errors
        admin = create_engine(url_at_0005, poolclass=sa.pool.NullPool)
        try:
            migrate(admin, "0006")  # `joblease db upgrade`'s call, in place, under the worker
            assert current_revision(admin) == "0006"
        finally:
            admin.dispose()
        after = worker.rounds + 1  # the round in flight may have run before the retype
        wait_until(lambda: worker.rounds >= after + 8 or len(worker.errors) > 20, timeout=120)
    finally:
        worker.stop.set()
        worker.join(timeout=60)
        engine.dispose()
    assert worker.errors == []


def test_lost_plan_is_the_retype_and_the_missing_statement(pg_url: str) -> None:
    """What :func:`lost_plan` recognises, from the server itself (and another 0A000 it does not)."""
    url = sa.make_url(pg_url)
    args: dict[str, Any] = {"host": url.host, "port": url.port, "user": url.username, "dbname": url.database}
    with psycopg.connect(**args, autocommit=True) as pg, psycopg.connect(**args, autocommit=True) as ddl:
        ddl.execute("CREATE TABLE probe (v varchar(4))")
        pg.execute("SELECT v FROM probe", prepare=True)
        ddl.execute("ALTER TABLE probe ALTER COLUMN v TYPE text")  # another session: a migration
        with pytest.raises(psycopg.errors.FeatureNotSupported) as retyped:
            pg.execute("SELECT v FROM probe", prepare=True)
        assert lost_plan(retyped.value), retyped.value
        # The server forgets a statement behind psycopg's back (as a pooler's other session would).
        pg.execute("SELECT 1 FROM probe", prepare=True)
        found = pg.execute("SELECT name FROM pg_prepared_statements WHERE statement = 'SELECT 1 FROM probe'")
        name = found.fetchone()
        assert name is not None
        pg.execute(psycopg.sql.SQL("DEALLOCATE {}").format(psycopg.sql.Identifier(name[0])))
        with pytest.raises(psycopg.errors.InvalidSqlStatementName) as missing:
            pg.execute("SELECT 1 FROM probe", prepare=True)
        assert lost_plan(missing.value), missing.value
        with pytest.raises(psycopg.errors.FeatureNotSupported) as other:
            pg.execute("SELECT 1 FROM probe a LEFT JOIN probe b ON true FOR UPDATE OF b")
        assert not lost_plan(other.value), other.value


_ATTEMPTS = driver.query(
    sa.select(outbox_table.c.attempts).where(outbox_table.c.idempotency_key == sa.bindparam("key"))
)


def test_a_retyped_column_in_a_callers_transaction_and_on_our_own_connection(
    pg_engine: sa.Engine, pg_url: str
) -> None:
    """Every statement the library prepares: on its own autocommit connections the stale statement is
    prepared afresh and run again (no error); in a caller's transaction, which the failure aborted, a
    StorageError says to retry the transaction, and the retry works."""
    url = sa.make_url(pg_url)
    args: dict[str, Any] = {"host": url.host, "port": url.port, "user": url.username, "dbname": url.database}
    with pg_engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v1:r", topic="t", payload={})
    with driver.statements(pg_engine, "read") as db:
        assert db.first(_ATTEMPTS, {"key": "v1:r"}) == (0,)
    with psycopg.connect(**args) as pg:
        db = driver.in_transaction(callers_transaction(pg))
        assert db.first(_ATTEMPTS, {"key": "v1:r"}) == (0,)
        pg.commit()
        with psycopg.connect(**args, autocommit=True) as ddl:
            ddl.execute("ALTER TABLE joblease_outbox ALTER COLUMN attempts TYPE bigint")
        db = driver.in_transaction(callers_transaction(pg))
        with pytest.raises(errors.StorageError, match="retry the transaction"):
            db.first(_ATTEMPTS, {"key": "v1:r"})
        pg.rollback()
        db = driver.in_transaction(callers_transaction(pg))
        assert db.first(_ATTEMPTS, {"key": "v1:r"}) == (0,)
        pg.commit()
    with driver.statements(pg_engine, "read") as db:
        assert db.first(_ATTEMPTS, {"key": "v1:r"}) == (0,)


def _db_upgrade(url: str) -> Any:
    from click.testing import CliRunner

    from dagster_joblease import cli

    return CliRunner().invoke(cli.main, ["--database-url", url, "db", "upgrade"], catch_exceptions=False)


def test_db_upgrade_warns_when_workers_are_connected_and_a_migration_retypes(url_at_0005: str) -> None:
    worker = create_engine(url_at_0005)
    try:
        with worker.connect() as conn:
            conn.exec_driver_sql("SELECT 1")  # a worker's session: its engine names it dagster-joblease
            upgraded = _db_upgrade(url_at_0005)
        assert upgraded.exit_code == 0, upgraded.output
        assert "upgraded from 0005 to" in upgraded.stdout
        assert "warning: 1 other session(s) of dagster-joblease" in upgraded.stderr
        assert "migration 0006 retypes columns" in upgraded.stderr
        with worker.connect() as conn:
            again = _db_upgrade(url_at_0005)  # at head: nothing to run, nothing to say
        assert again.exit_code == 0 and "already at head" in again.stdout and again.stderr == ""
    finally:
        worker.dispose()


def test_db_upgrade_says_nothing_when_no_worker_is_connected(url_at_0005: str) -> None:
    upgraded = _db_upgrade(url_at_0005)
    assert upgraded.exit_code == 0 and upgraded.stderr == "", upgraded.output


def test_a_retyped_column_in_a_pipeline(pg_engine: sa.Engine, pg_url: str) -> None:
    """In pipeline mode the error arrives with the results: the same retry-the-transaction StorageError."""
    url = sa.make_url(pg_url)
    args: dict[str, Any] = {"host": url.host, "port": url.port, "user": url.username, "dbname": url.database}
    with pg_engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key="v1:p", topic="t", payload={})
    with psycopg.connect(**args) as pg:
        with pg.pipeline():
            db = driver.in_transaction(callers_transaction(pg))
            assert db.first(_ATTEMPTS, {"key": "v1:p"}) == (0,)
        pg.commit()
        with psycopg.connect(**args, autocommit=True) as ddl:
            ddl.execute("ALTER TABLE joblease_outbox ALTER COLUMN attempts TYPE bigint")
        with pytest.raises(errors.StorageError, match="retry the transaction"), pg.pipeline():
            db = driver.in_transaction(callers_transaction(pg))
            db.first(_ATTEMPTS, {"key": "v1:p"})
        pg.rollback()
        with pg.pipeline():
            db = driver.in_transaction(callers_transaction(pg))
            assert db.first(_ATTEMPTS, {"key": "v1:p"}) == (0,)
        pg.commit()


def test_a_worker_survives_joblease_db_upgrade_from_0005_to_head(url_at_0005: str) -> None:
    """The operator's command, to head, under a worker that claims and enqueues (this code's inbox needs
    0007's columns, so it joins only in the test above); the command warns that the worker is there."""
    engine = create_engine(url_at_0005)
    worker = Worker(engine, inbox=False)
    try:
        worker.start()
        wait_until(lambda: worker.rounds >= 8 or bool(worker.errors), timeout=120)
        assert not worker.errors, worker.errors
        upgraded = _db_upgrade(url_at_0005)
        assert upgraded.exit_code == 0, upgraded.output
        assert "upgraded from 0005 to" in upgraded.stdout
        assert "migration 0006 retypes columns" in upgraded.stderr
        after = worker.rounds + 1
        wait_until(lambda: worker.rounds >= after + 8 or len(worker.errors) > 20, timeout=120)
    finally:
        worker.stop.set()
        worker.join(timeout=60)
        engine.dispose()
    assert worker.errors == []


def test_migrate_logs_the_warning(url_at_0005: str, caplog: pytest.LogCaptureFixture) -> None:
    """A JobLeaseResource that upgrades on first use calls migrate(): the warning goes to the log."""
    worker = create_engine(url_at_0005)
    admin = create_engine(url_at_0005, poolclass=sa.pool.NullPool)
    try:
        with worker.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
            with caplog.at_level("WARNING", logger="dagster_joblease"):
                migrate(admin, "0006")
            logged = [r.getMessage() for r in caplog.records if r.name == "dagster_joblease.storage.migrate"]
            assert len(logged) == 1 and "migration 0006 retypes columns" in logged[0], logged
            caplog.clear()
            migrate(admin)  # 0007 retypes nothing: nothing to say
            assert not caplog.records
    finally:
        admin.dispose()
        worker.dispose()


def test_the_cli_prints_the_warning_once(url_at_0005: str) -> None:
    """In a process of its own (pytest's log capture would hide a logged copy): the command prints the
    warning and migrate() does not log it again."""
    worker = create_engine(url_at_0005)
    try:
        with worker.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
            argv = [sys.executable, "-m", "dagster_joblease", "--database-url", url_at_0005, "db", "upgrade"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stderr.count("retypes columns") == 1, done.stderr
    finally:
        worker.dispose()
