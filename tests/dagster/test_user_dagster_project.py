"""A leased Dagster job tested with run_partition_twice (the docs' Dagster example)."""

from __future__ import annotations

import dagster as dg
import sqlalchemy as sa

from dagster_joblease.admin import list_outbox
from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_op
from dagster_joblease.dagster.testing import run_partition_twice


@leased_op(code="daily-billing")
def bill_day(run: LeasedRun) -> None:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="billing", payload={"day": run.partition_key})


@dg.job(partitions_def=dg.DailyPartitionsDefinition(start_date="2024-01-01"))
def daily_billing_job() -> None:
    bill_day()


def test_a_backfill_and_a_schedule_tick_bill_a_day_once(
    joblease_database_url: str, joblease_engine: sa.Engine
) -> None:
    resources = {"joblease": JobLeaseResource(database_url=joblease_database_url)}

    backfill, schedule = run_partition_twice(daily_billing_job, "2024-01-02", resources=resources)

    assert backfill.success and schedule.success  # the loser succeeds too, as a recorded skip
    assert [backfill.won, schedule.won].count(True) == 1
    assert len(list_outbox(joblease_engine)) == 1
