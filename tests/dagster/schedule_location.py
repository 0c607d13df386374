"""A code location for the catch-up test (issue 35 item 13): the same daily job under a leased schedule and
under Dagster's own ``build_schedule_from_partitioned_job``, loaded as Dagster loads a location."""

from __future__ import annotations

import dagster as dg

from dagster_joblease.dagster import JobLeaseResource, build_leased_schedule

days = dg.DailyPartitionsDefinition(start_date="2024-01-01")


@dg.op
def noop() -> None:
    """Does nothing: the test counts the runs the scheduler launches, not what they do."""


@dg.job(partitions_def=days)
def daily_job() -> None:
    noop()


leased = build_leased_schedule(daily_job, code="t-catch-up", name="leased_schedule", resource_key=None)
dagsters = dg.build_schedule_from_partitioned_job(daily_job, name="dagsters_schedule")

defs = dg.Definitions(
    jobs=[daily_job], schedules=[leased, dagsters], resources={"joblease": JobLeaseResource()}
)
