"""Schedule ticks: the partition key is the run key, the partition and the lease run key (in the tags)."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from zoneinfo import ZoneInfo

import dagster as dg
import pytest

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource, build_leased_schedule
from dagster_joblease.dagster.holders import encode_holder
from dagster_joblease.dagster.metadata import TAG_OUTCOME
from dagster_joblease.errors import ConfigurationError

UTC = dt.UTC
#: The resource the ticks read leases through: an SQLite file of this module's own.
_DB = Path(__import__("tempfile").mkdtemp(prefix="joblease-schedules-")) / "leases.db"
RESOURCES = {"joblease": JobLeaseResource(database_url=f"sqlite:///{_DB}")}


@dg.op
def noop() -> None:
    pass


def _job(name: str, partitions_def: dg.PartitionsDefinition | None) -> dg.JobDefinition:
    @dg.job(name=name, partitions_def=partitions_def)
    def the_job() -> None:
        noop()

    return the_job


def _evaluate(schedule: dg.ScheduleDefinition, at: dt.datetime, **resources: object) -> object:
    with dg.build_schedule_context(scheduled_execution_time=at, resources=resources or RESOURCES) as context:
        return schedule(context)


def _tick(schedule: dg.ScheduleDefinition, at: dt.datetime) -> dg.RunRequest:
    request = _evaluate(schedule, at)
    assert isinstance(request, dg.RunRequest)
    return request


def _assert_request(request: dg.RunRequest, code: str, key: str) -> None:
    assert request.run_key == key
    assert request.partition_key == key
    # The outcome is 'pending' from the queue on until the leased step says otherwise; nothing else of
    # joblease's is put on at launch (the partition is Dagster's own dagster/partition).
    assert {k: v for k, v in request.tags.items() if k.startswith("joblease/")} == {TAG_OUTCOME: "pending"}
    assert JobIdentity.schedule(code, key).run_key == key


def test_daily_at_two_utc_requests_yesterday() -> None:
    job = _job("daily", dg.DailyPartitionsDefinition(start_date="2024-01-01"))
    schedule = build_leased_schedule(job, code="billing", cron_schedule="0 2 * * *")
    assert schedule.cron_schedule == "0 2 * * *"
    assert schedule.execution_timezone == "UTC"
    for tick, key in [
        (dt.datetime(2024, 3, 2, 2, 0, tzinfo=UTC), "2024-03-01"),
        (dt.datetime(2024, 3, 3, 2, 0, tzinfo=UTC), "2024-03-02"),
        (dt.datetime(2024, 12, 31, 2, 0, tzinfo=UTC), "2024-12-30"),
    ]:
        _assert_request(_tick(schedule, tick), "billing", key)


def test_hourly_ticks() -> None:
    job = _job("hourly", dg.HourlyPartitionsDefinition(start_date="2024-01-01-00:00"))
    schedule = build_leased_schedule(job, code="hourly-sync")
    assert schedule.cron_schedule == "0 * * * *"
    _assert_request(
        _tick(schedule, dt.datetime(2024, 3, 2, 10, 0, tzinfo=UTC)), "hourly-sync", "2024-03-02-09:00"
    )


def test_five_minute_ticks_give_consecutive_windows() -> None:
    partitions = dg.TimeWindowPartitionsDefinition(
        start="2024-01-01-00:00", cron_schedule="*/5 * * * *", fmt="%Y-%m-%d-%H:%M"
    )
    schedule = build_leased_schedule(_job("five", partitions), code="sync-orders")
    assert schedule.cron_schedule == "*/5 * * * *"
    keys = [_tick(schedule, dt.datetime(2024, 3, 2, 10, minute, tzinfo=UTC)).run_key for minute in (0, 5, 10)]
    assert keys == ["2024-03-02-09:55", "2024-03-02-10:00", "2024-03-02-10:05"]


def test_named_time_zone() -> None:
    berlin = dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="Europe/Berlin")
    schedule = build_leased_schedule(_job("berlin", berlin), code="berlin-close", cron_schedule="30 0 * * *")
    assert schedule.execution_timezone == "Europe/Berlin"
    # 00:30 in Berlin on 2 March is 23:30 UTC on 1 March: the complete Berlin day is 1 March.
    tick = dt.datetime(2024, 3, 2, 0, 30, tzinfo=ZoneInfo("Europe/Berlin"))
    _assert_request(_tick(schedule, tick), "berlin-close", "2024-03-01")


def test_the_code_location_schedules() -> None:
    import definitions

    billing = _tick(definitions.daily_billing_schedule, dt.datetime(2024, 5, 1, 2, 0, tzinfo=UTC))
    _assert_request(billing, "daily-billing", "2024-04-30")
    orders = _tick(definitions.sync_orders_schedule, dt.datetime(2024, 5, 1, 2, 5, tzinfo=UTC))
    _assert_request(orders, "sync-orders", "2024-05-01-02:00")


def test_no_complete_partition_yet_is_a_skip() -> None:
    schedule = build_leased_schedule(
        _job("future", dg.DailyPartitionsDefinition(start_date="2030-01-01")), code="x"
    )
    assert isinstance(_evaluate(schedule, dt.datetime(2029, 1, 1, tzinfo=UTC)), dg.SkipReason)


def test_a_tick_whose_partition_is_done_skips_naming_the_winner() -> None:
    """A partition done elsewhere (a backfill, another deployment) launches no green run that did nothing."""
    job = _job("done_elsewhere", dg.DailyPartitionsDefinition(start_date="2024-01-01"))
    code, tick = f"done-{uuid.uuid4().hex[:6]}", dt.datetime(2024, 3, 2, 2, 0, tzinfo=UTC)
    schedule = build_leased_schedule(job, code=code, cron_schedule="0 2 * * *")
    _assert_request(_tick(schedule, tick), code, "2024-03-01")  # no lease yet: requested

    run_id = str(uuid.uuid4())
    engine = create_engine(f"sqlite:///{_DB}")
    try:
        service = LeaseService(engine, holder=encode_holder("prod-eu", run_id))
        lease = service.acquire(JobIdentity.schedule(code, "2024-03-01"))
        assert lease is not None
        assert isinstance(_evaluate(schedule, tick), dg.RunRequest)  # RUNNING: not done, requested
        service.complete(lease)
    finally:
        engine.dispose()
    skipped = _evaluate(schedule, tick)
    assert isinstance(skipped, dg.SkipReason)
    assert skipped.skip_message == (
        f"skipped: {code}@2024-03-01 is already done by run {run_id} of deployment 'prod-eu' "
        "(lease SUCCESS); nothing launched"
    )
    # Turned off, the tick requests the partition (the run itself then skips, tagged skipped-succeeded).
    plain = build_leased_schedule(job, code=code, cron_schedule="0 2 * * *", resource_key=None, name="plain")
    _assert_request(_tick(plain, tick), code, "2024-03-01")
    # A lease that cannot be read never stops the tick: the run asks the lease itself.
    down = JobLeaseResource(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none")
    request = _evaluate(schedule, tick, joblease=down)  # (the tick's log says it could not read the lease)
    assert isinstance(request, dg.RunRequest) and request.partition_key == "2024-03-01"


def test_rejects_jobs_without_time_partitions() -> None:
    static = _job("static", dg.StaticPartitionsDefinition(["a", "b"]))
    with pytest.raises(ConfigurationError, match="time-window partitions"):
        build_leased_schedule(static, code="static")
    with pytest.raises(ConfigurationError, match="time-window partitions"):
        build_leased_schedule(_job("plain", None), code="plain")
