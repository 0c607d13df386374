"""A live holder is judged by its own recorded heartbeat, not by the waiter's or the sensor's settings.

Real Dagster runs on a PostgreSQL-backed instance. The holder is a lease recorded as a Dagster run of this
instance whose run was marked CANCELED (a forced termination does that while the step process lives on);
its heartbeat is moved into the past on the database clock, far enough to be "stale" by a short interval
and far from stale by the holder's own one, so nothing here races a clock.
"""

from __future__ import annotations

import datetime as dt
import uuid

import dagster as dg
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource, build_reconciliation_sensor, leased_op
from dagster_joblease.dagster.holders import encode_holder
from dagster_joblease.dagster.metadata import TAG_OUTCOME
from dagster_joblease.storage.schema import lease_table
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
HOUR_MS = 3_600_000


def _eager_job(code: str) -> dg.JobDefinition:
    """A waiter with a 1 s heartbeat of its own, giving up on a live holder after 0.3 s."""
    op = leased_op(code=code, name=f"eager_{code.replace('-', '_')}_op", held_wait_ms=300)(
        jobs.write_domain_and_outbox
    )

    @dg.job(
        name=f"eager_{code.replace('-', '_')}",
        partitions_def=jobs.days,
        executor_def=dg.in_process_executor,
        resource_defs={"joblease": JobLeaseResource(heartbeat_ms=1_000, lease_ms=60_000, deployment="tests")},
    )
    def _the_job() -> None:
        op()

    return _the_job


def _hold(
    dagster_pg: DagsterPg,
    job: dg.JobDefinition,
    code: str,
    day: str,
    heartbeat_ms: int,
    status: dg.DagsterRunStatus,
) -> tuple[LeaseService, str]:
    """A lease held by a Dagster run of this instance (given status), recording ``heartbeat_ms``."""
    run = dagster_pg.instance.create_run_for_job(job, status=status, tags={"dagster/partition": day})
    holder = encode_holder("tests", run.run_id)
    engine = create_engine(dagster_pg.joblease_url)
    service = LeaseService(engine, lease_ms=HOUR_MS, heartbeat_ms=heartbeat_ms, holder=holder)
    assert service.acquire(JobIdentity.schedule(code, day)) is not None
    return service, run.run_id


def _age_heartbeat(service: LeaseService, code: str, day: str, seconds: int) -> None:
    t = lease_table
    with service.engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.code == code, t.c.run_key == day)
            .values(heartbeat_at=sa.func.clock_timestamp() - dt.timedelta(seconds=seconds))
        )


def _row(service: LeaseService, code: str, day: str) -> tuple[str, int, int | None]:
    t = lease_table
    with service.engine.connect() as conn:
        status, attempt, heartbeat_ms = conn.execute(
            sa.select(t.c.status, t.c.attempt, t.c.heartbeat_ms).where(t.c.code == code, t.c.run_key == day)
        ).one()
    return status, attempt, heartbeat_ms


def test_a_waiter_with_a_short_heartbeat_does_not_take_over_a_holder_with_a_long_one(
    dagster_pg: DagsterPg,
) -> None:
    code, day = f"ht-{uuid.uuid4().hex[:6]}", "2024-07-01"
    job = _eager_job(code)
    # The holder renews every 10 minutes; its run is CANCELED (forced termination) but its process works.
    service, _ = _hold(dagster_pg, job, code, day, heartbeat_ms=600_000, status=dg.DagsterRunStatus.CANCELED)
    _age_heartbeat(service, code, day, seconds=180)  # 3 minutes: "stale" by the waiter's 2 x 1 s only
    try:
        result = job.execute_in_process(
            partition_key=day, instance=dagster_pg.instance, run_config=QUIET, raise_on_error=False
        )
        assert not result.success
        run = dagster_pg.instance.get_run_by_id(result.run_id)
        assert run is not None and run.tags[TAG_OUTCOME] == "held"
        assert _row(service, code, day) == ("RUNNING", 1, 600_000)  # never taken from the live holder

        # Past twice the holder's own interval, the finished run's holder is dead: taken over at once.
        _age_heartbeat(service, code, day, seconds=1_300)
        taken = job.execute_in_process(partition_key=day, instance=dagster_pg.instance, run_config=QUIET)
        assert taken.success
        tags = dagster_pg.instance.get_run_by_id(taken.run_id)
        assert tags is not None and tags.tags[TAG_OUTCOME] == "reclaimed"
        assert _row(service, code, day) == ("SUCCESS", 2, 1_000)  # the new holder's own interval
    finally:
        service.engine.dispose()


def test_the_sensor_judges_a_holder_by_its_own_interval_and_holder_stale_ms_only_lengthens(
    dagster_pg: DagsterPg,
) -> None:
    code, day = f"hs-{uuid.uuid4().hex[:6]}", "2024-07-02"
    job = _eager_job(code)
    # A 20 s holder heartbeat; the resource's default (10 s) would call it stale after 20 s.
    service, _ = _hold(dagster_pg, job, code, day, heartbeat_ms=20_000, status=dg.DagsterRunStatus.FAILURE)
    _age_heartbeat(service, code, day, seconds=30)
    quick = build_reconciliation_sensor(
        job, code=code, name=f"quick_{code.replace('-', '_')}", holder_stale_ms=1
    )
    default = build_reconciliation_sensor(job, code=code)
    try:
        for sensor in (default, quick):  # 30 s < 2 x 20 s: live, whatever the sensor's own setting
            requests, message = _tick(dagster_pg, job, sensor)
            assert requests == [] and "1 held by a live lease" in message, message
        _age_heartbeat(service, code, day, seconds=45)
        # Asked first: a tick that finds the holder dead takes its lease (FAIL), after which every sensor
        # relaunches the key for that reason, whatever its holder_stale_ms.
        patient = build_reconciliation_sensor(
            job, code=code, name=f"patient_{code.replace('-', '_')}", holder_stale_ms=HOUR_MS
        )
        requests, message = _tick(dagster_pg, job, patient)
        assert requests == [] and "1 held by a live lease" in message, message  # lengthened: not stale yet
        assert _row(service, code, day)[0] == "RUNNING"
        (request,) = _tick(dagster_pg, job, default)[0]
        assert request.partition_key == day
    finally:
        service.engine.dispose()


def test_a_holder_recorded_without_heartbeat_is_judged_by_expiry_only(dagster_pg: DagsterPg) -> None:
    code, day = f"hz-{uuid.uuid4().hex[:6]}", "2024-07-03"
    job = _eager_job(code)
    service, _ = _hold(dagster_pg, job, code, day, heartbeat_ms=0, status=dg.DagsterRunStatus.FAILURE)
    _age_heartbeat(service, code, day, seconds=3_000)  # 50 minutes without a heartbeat: it never beats
    try:
        requests, message = _tick(dagster_pg, job, build_reconciliation_sensor(job, code=code))
        assert requests == [] and "1 held by a live lease" in message
        result = job.execute_in_process(
            partition_key=day, instance=dagster_pg.instance, run_config=QUIET, raise_on_error=False
        )
        assert not result.success
        assert _row(service, code, day) == ("RUNNING", 1, 0)
    finally:
        service.engine.dispose()


def _tick(
    dagster_pg: DagsterPg, job: dg.JobDefinition, sensor: dg.SensorDefinition
) -> tuple[list[dg.RunRequest], str]:
    defs = dg.Definitions(jobs=[job], sensors=[sensor], resources={"joblease": JobLeaseResource()})
    with dg.build_sensor_context(
        instance=dagster_pg.instance, resources={"joblease": JobLeaseResource()}, definitions=defs
    ) as context:
        data = sensor.evaluate_tick(context)
    return list(data.run_requests or []), data.skip_message or ""
