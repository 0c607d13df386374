"""A leased schedule and ticks missed while the scheduler daemon was down (issue 35 item 13).

Dagster's own scheduler (``dagster._scheduler.scheduler.launch_scheduled_runs``, the loop ``dagster-daemon``
runs) evaluates a schedule three days after it last ran: for the leased schedule and for Dagster's
``build_schedule_from_partitioned_job`` alike it evaluates only the latest tick and launches one run, for
the last complete partition (a schedule's snapshot carries no partition set in Dagster 1.12 and 1.13, so
no schedule catches up). Replacing Dagster's schedule with the leased one loses nothing, and the leased
schedule says so where it is shown (its description) and where it is built (its docstring).
"""

from __future__ import annotations

import datetime as dt
import logging

import dagster as dg
from dagster._core.test_utils import freeze_time
from dagster._scheduler.scheduler import launch_scheduled_runs
from dagster._time import get_current_datetime

from dagster_joblease.dagster import build_leased_schedule
from dagster_joblease.dagster.schedules import NO_CATCH_UP
from tests.dagster import schedule_location as loc
from tests.dagster.deployments import deployment

MODULE = "tests.dagster.schedule_location"
LOG = logging.getLogger("test_schedule_catch_up")
#: Runs are only counted: the coordinator records them and nothing launches them.
NO_LAUNCH = {"run_launcher": {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}}


def test_missed_ticks_are_not_caught_up_by_a_leased_schedule_nor_by_dagsters() -> None:
    started = dt.datetime(2024, 6, 10, 12, tzinfo=dt.UTC)
    with deployment(MODULE, NO_LAUNCH) as (instance, workspace):
        location = workspace.create_request_context().get_code_location("schedule_location")
        repository = next(iter(location.get_repositories().values()))
        with freeze_time(started):
            for name in ("leased_schedule", "dagsters_schedule"):
                instance.start_schedule(repository.get_schedule(name))
        # The daemon was down for three days: 11, 12 and 13 June 00:00 were missed.
        with freeze_time(started + dt.timedelta(days=3, hours=1)):
            list(launch_scheduled_runs(workspace, LOG, get_current_datetime(), iteration_times={}))
        launched = {
            name: sorted(
                r.tags["dagster/partition"]
                for r in instance.get_runs(dg.RunsFilter(tags={"dagster/schedule_name": name}))
            )
            for name in ("leased_schedule", "dagsters_schedule")
        }
    assert launched == {"leased_schedule": ["2024-06-12"], "dagsters_schedule": ["2024-06-12"]}


def test_a_leased_schedule_says_it_does_not_catch_up() -> None:
    schedule = build_leased_schedule(loc.daily_job, code="t-catch-up", resource_key=None)
    assert schedule.description is not None and schedule.description.endswith(NO_CATCH_UP)
    custom = build_leased_schedule(loc.daily_job, code="t-catch-up", resource_key=None, description="Mine.")
    assert custom.description == f"Mine. {NO_CATCH_UP}"
    assert "not caught up" in (build_leased_schedule.__doc__ or "")
