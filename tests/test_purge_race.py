"""A claim racing a purge that has the row locked is never refused in the name of nobody (real
PostgreSQL; the interleaving is forced with locks, not timing)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import AcquireResult, LeaseService
from dagster_joblease.storage import create_engine
from tests.conftest import wait_until

pytestmark = pytest.mark.postgres_only

GATE = 917_017  # the advisory lock the claim's insert waits on, right after it met the row


def _connect(pg_url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    url = sa.make_url(pg_url)
    return psycopg.connect(host=url.host, port=url.port, user=url.username, dbname=url.database, **kwargs)


@pytest.fixture
def gated(pg_url: str) -> Iterator[tuple[psycopg.Connection[Any], Callable[[str], bool]]]:
    """An AFTER INSERT statement trigger on the lease table that waits for advisory lock GATE: while the
    returned autocommit connection holds it, a claim's insert finds the row, then pauses before its
    reclaim. The callable says whether a session of the database waits on a lock of the given kind."""
    control = _connect(pg_url, autocommit=True)
    control.execute(
        "CREATE FUNCTION claim_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"PERFORM pg_advisory_lock({GATE}); PERFORM pg_advisory_unlock({GATE}); RETURN NULL; END $$"
    )
    control.execute(
        "CREATE TRIGGER claim_gate AFTER INSERT ON joblease_lease FOR EACH STATEMENT "
        "EXECUTE FUNCTION claim_gate()"
    )

    def waiting_on(locktype: str) -> bool:
        row = control.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE NOT l.granted AND l.locktype = %s AND a.datname = current_database()",
            (locktype,),
        ).fetchone()
        return row is not None and row[0] > 0

    yield control, waiting_on
    control.close()


def test_a_claim_whose_reclaim_waits_on_a_purge_acquires_once_the_purge_commits(
    pg_url: str, gated: tuple[psycopg.Connection[Any], Callable[[str], bool]]
) -> None:
    control, waiting_on = gated
    engine = create_engine(pg_url)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        job = JobIdentity.schedule("purge-race", "1")
        with _connect(pg_url, autocommit=True) as setup:  # a FAIL row, as a purge would delete it
            setup.execute(
                "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, "
                "attempt, lease_ms, holder, created_at, acquired_at, heartbeat_at, expires_at, finished_at) "
                "VALUES (%s, 'SCHEDULE', %s, %s, 'FAIL', 'old', 1, 1000, 'h', now(), now(), now(), now(), "
                "now())",
                (job.idempotency_key, job.code, job.run_key),
            )
        control.execute("SELECT pg_advisory_lock(%s)", (GATE,))
        outcome: list[AcquireResult | BaseException] = []

        def claim() -> None:
            try:
                outcome.append(service.try_acquire(job))
            except BaseException as exc:
                outcome.append(exc)

        claimer = threading.Thread(target=claim)
        claimer.start()
        wait_until(lambda: waiting_on("advisory"), timeout=60)  # its insert met the FAIL row
        with _connect(pg_url) as purge:  # a purge batch: the row deleted, not yet committed
            purge.execute("DELETE FROM joblease_lease WHERE lock_key = %s", (job.idempotency_key,))
            control.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
            wait_until(lambda: waiting_on("transactionid"), timeout=60)  # its reclaim waits on the purge
            purge.commit()
        claimer.join(60)
        assert not claimer.is_alive()
        (result,) = outcome
        assert isinstance(result, AcquireResult)
        assert result.lease is not None, f"refused ({result.reason}) though the row no longer exists"
        assert result.lease.attempt == 1
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT status, attempt FROM joblease_lease WHERE lock_key = :k"),
                {"k": job.idempotency_key},
            ).all()
        assert [tuple(r) for r in rows] == [("RUNNING", 1)]
    finally:
        engine.dispose()


def test_a_refusal_still_names_the_rival_that_took_the_row(
    pg_url: str, gated: tuple[psycopg.Connection[Any], Callable[[str], bool]]
) -> None:
    """The other change between the statements: a rival reclaims the FAIL row while the claim is paused.
    The claim's snapshot-only refusal is not reported; the next round names the live holder (HELD)."""
    control, waiting_on = gated
    engine = create_engine(pg_url)
    rival_engine = create_engine(pg_url)
    try:
        service = LeaseService(engine, lease_ms=60_000)
        rival = LeaseService(rival_engine, lease_ms=60_000)
        job = JobIdentity.schedule("purge-race", "2")
        first = rival.acquire(job)
        assert first is not None
        rival.fail(first, "boom")
        control.execute("SELECT pg_advisory_lock(%s)", (GATE,))
        outcome: list[AcquireResult | BaseException] = []
        claimer = threading.Thread(target=lambda: outcome.append(service.try_acquire(job)))
        claimer.start()
        wait_until(lambda: waiting_on("advisory"), timeout=60)
        with _connect(pg_url) as other:  # a rival's reclaim holds the row, not yet committed
            other.execute(
                "UPDATE joblease_lease SET status = 'RUNNING', attempt = attempt + 1, owner_token = 'rival', "
                "expires_at = now() + interval '1 hour' WHERE lock_key = %s",
                (job.idempotency_key,),
            )
            control.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
            wait_until(lambda: waiting_on("transactionid"), timeout=60)
            other.commit()
        claimer.join(60)
        (result,) = outcome
        assert isinstance(result, AcquireResult)
        assert result.lease is None and result.reason is not None
        assert result.reason.name == "HELD", result.reason
    finally:
        engine.dispose()
        rival_engine.dispose()
