"""Module-level worker functions that batch lease tests run in real OS processes (multiprocessing spawn)."""

from __future__ import annotations

import datetime as dt
from multiprocessing.synchronize import Barrier

import sqlalchemy as sa

from dagster_joblease.batch import claim_many, complete_many, fail_many, fenced_transaction_many
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.storage import create_engine

RECORD = "batch_record"
SHARED = 240
PRIVATE = 20


def race_days(count: int) -> list[JobIdentity]:
    start = dt.date(2024, 1, 1)
    return [JobIdentity.schedule("race", (start + dt.timedelta(days=i)).isoformat()) for i in range(count)]


def private_keys(index: int) -> list[str]:
    """The keys only racer ``index`` claims (after the shared ones)."""
    jobs = race_days(SHARED + PRIVATE * (index + 1))
    return [j.idempotency_key for j in jobs[SHARED + PRIVATE * index :]]


def race_range(url: str, index: int, processes: int, barrier: Barrier) -> None:
    """Claim the shared days plus this racer's own, all at once with the others; bill the won days in
    one fenced set transaction, then complete them."""
    engine = create_engine(url)
    service = LeaseService(engine, lease_ms=60_000, holder=f"racer-{index}")
    jobs = race_days(SHARED + PRIVATE * processes)
    mine = jobs[:SHARED] + jobs[SHARED + PRIVATE * index : SHARED + PRIVATE * (index + 1)]
    if index % 2:
        mine.reverse()  # the order given must not matter: keys are always locked in key order
    record = sa.text(f"INSERT INTO {RECORD} (key, holder) VALUES (:key, :holder)")
    with engine.connect():
        pass  # open a connection before the start line, so the race is about the SQL
    try:
        barrier.wait(timeout=120)
        won = claim_many(service, mine).leases
        if won:
            with fenced_transaction_many(service, won) as conn:
                conn.execute(record, [{"key": x.idempotency_key, "holder": f"racer-{index}"} for x in won])
            complete_many(service, won).raise_if_lost()
    finally:
        engine.dispose()


ATTEMPTS = "batch_attempt"


def reclaim_rounds(url: str, index: int, rounds: int, count: int, barrier: Barrier) -> None:
    """Round after round, claim the whole shared set (FAIL rows are reclaimed), record each won
    (key, attempt) in a fenced set transaction, then fail what was won so the others reclaim it."""
    engine = create_engine(url)
    service = LeaseService(engine, lease_ms=60_000, holder=f"reclaimer-{index}")
    jobs = race_days(count)
    if index % 2:
        jobs.reverse()
    record = sa.text(f"INSERT INTO {ATTEMPTS} (key, attempt, holder) VALUES (:key, :attempt, :holder)")
    with engine.connect():
        pass
    try:
        barrier.wait(timeout=120)
        for _ in range(rounds):
            won = claim_many(service, jobs).leases
            if not won:
                continue
            with fenced_transaction_many(service, won) as conn:
                conn.execute(
                    record,
                    [
                        {"key": x.idempotency_key, "attempt": x.attempt, "holder": f"reclaimer-{index}"}
                        for x in won
                    ],
                )
            fail_many(service, won, "handed on").raise_if_lost()
    finally:
        engine.dispose()
