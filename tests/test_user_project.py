"""Replay-safety tests for a billing job, written with dagster_joblease.testing (the docs' example)."""

from __future__ import annotations

import functools

import httpx
import pytest
import sqlalchemy as sa

from dagster_joblease import Dispatcher, JobIdentity, Lease, LeaseService, Route, enqueue_once
from dagster_joblease.admin import list_outbox
from dagster_joblease.dispatch import DispatchReport
from dagster_joblease.errors import LostLeaseError
from dagster_joblease.testing import (
    CrashPoint,
    RecordingDownstream,
    crash_run_exclusive,
    drain_outbox,
    expire_now,
    reclaim_now,
)

DAY = JobIdentity.schedule("daily-billing", "2026-11-29")


def bill(service: LeaseService, lease: Lease) -> None:
    """The job under test: its outbox row commits only while the lease is still this worker's."""
    with service.fenced_transaction(lease) as conn:
        enqueue_once(conn, idempotency_key=lease.idempotency_key, topic="billing", payload={"day": "11-29"})


def deliver(engine: sa.Engine, downstream: RecordingDownstream) -> DispatchReport:
    routes = {"billing": Route(downstream.url("/billing"))}
    with Dispatcher(engine, routes, backoff_base_ms=1, backoff_max_ms=20) as dispatcher:
        return drain_outbox(dispatcher)


def test_a_worker_that_lost_its_lease_stops_without_an_effect(
    joblease_service: LeaseService, joblease_downstream: RecordingDownstream
) -> None:
    def paused_worker(lease: Lease) -> None:
        reclaim_now(joblease_service, lease)  # another worker takes the run over meanwhile
        bill(joblease_service, lease)  # the fenced write raises LostLeaseError: nothing commits
        httpx.post(joblease_downstream.url("/billing"), headers={"Idempotency-Key": lease.idempotency_key})

    with pytest.raises(LostLeaseError):
        joblease_service.run_exclusive(DAY, paused_worker)
    assert list_outbox(joblease_service.engine) == []
    assert joblease_downstream.keys() == []


def test_a_lost_answer_is_redelivered_and_applied_once(
    joblease_service: LeaseService, joblease_engine: sa.Engine, joblease_downstream: RecordingDownstream
) -> None:
    days = [JobIdentity.schedule("daily-billing", f"2026-11-{day}") for day in (27, 28, 29)]
    for day in days:
        joblease_service.run_exclusive(day, functools.partial(bill, joblease_service))
    joblease_downstream.drop_after_apply_next(2)  # applied, then the connection drops unanswered

    report = deliver(joblease_engine, joblease_downstream)

    keys = [day.idempotency_key for day in days]
    assert report.sent == 3 and report.retried == 2
    assert sum(joblease_downstream.posts(key) for key in keys) == 5
    assert sorted(joblease_downstream.keys()) == sorted(keys)  # a retry must not invent a new key
    joblease_downstream.assert_each_effect_once(keys)


def test_a_worker_killed_after_its_effect_is_rerun_without_a_second_effect(
    joblease_service: LeaseService, joblease_engine: sa.Engine, joblease_downstream: RecordingDownstream
) -> None:
    crashed = crash_run_exclusive(joblease_service, DAY, bill, at=CrashPoint.AFTER_CALLBACK)
    assert crashed.lease is not None and (crashed.lease.status, crashed.lease.attempt) == ("RUNNING", 1)
    assert [row.idempotency_key for row in crashed.outbox] == [DAY.idempotency_key]
    deliver(joblease_engine, joblease_downstream)  # the effect happened; the run is not marked done

    expire_now(joblease_service, DAY)  # instead of waiting out the dead worker's lease
    rerun = joblease_service.run_exclusive(DAY, functools.partial(bill, joblease_service))
    deliver(joblease_engine, joblease_downstream)

    assert rerun.lease is not None and rerun.lease.attempt == 2
    joblease_downstream.assert_each_effect_once([DAY.idempotency_key])
