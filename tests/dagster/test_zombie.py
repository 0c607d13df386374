"""A SIGKILLed run worker under Dagster's defaults (run monitoring off) does not block reconciliation.

A real run (multiprocess executor: the leased op in its own step process) holds the partition's lease;
the test SIGKILLs the run's processes, as an OOM kill or a lost node does. Without run monitoring Dagster
still calls the run STARTED forever. Time is driven on the database clock (the heartbeat and the expiry
are written into the past), never raced.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import TAG_OUTCOME, JobLeaseResource, build_reconciliation_sensor
from dagster_joblease.storage.schema import lease_table
from tests.conftest import wait_until
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

REPO = Path(__file__).resolve().parents[2]


def _tick(
    dagster_pg: DagsterPg, job: dg.JobDefinition, sensor: dg.SensorDefinition
) -> tuple[list[dg.RunRequest], str]:
    # A short held wait: a run that holds no lease stops counting as "maybe waiting" after 1 s.
    resource = JobLeaseResource(held_wait_ms=1_000)
    defs = dg.Definitions(jobs=[job], sensors=[sensor], resources={"joblease": resource})
    with dg.build_sensor_context(
        instance=dagster_pg.instance, resources={"joblease": resource}, definitions=defs
    ) as context:
        data = sensor.evaluate_tick(context)
    return list(data.run_requests or []), data.skip_message or ""


def _move(engine: sa.Engine, job: JobIdentity, **seconds_ago: int) -> None:
    t = lease_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.lock_key == job.idempotency_key)
            .values(
                **{
                    column: sa.func.clock_timestamp() - dt.timedelta(seconds=ago)
                    for column, ago in seconds_ago.items()
                }
            )
        )


@pytest.mark.chaos
def test_a_sigkilled_run_is_a_zombie_once_its_heartbeat_is_stale_by_its_own_interval(
    dagster_pg: DagsterPg, tmp_path: Path
) -> None:
    day = "2024-08-01"
    job = JobIdentity.schedule("t-wait", day)
    instance = dagster_pg.instance
    blocking = jobs.blocking_job()
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.dagster.blocking_run", day, str(ready)],
        cwd=REPO,
        env=dagster_pg.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    engine = create_engine(dagster_pg.joblease_url)
    try:
        wait_until(
            lambda: (ready.exists() and len(ready.read_text().split()) == 2) or proc.poll() is not None,
            timeout=120,
        )
        assert ready.exists(), proc.communicate()[1]
        step_pid, run_id = ready.read_text().split()
        # The worker dies: the step process and the run process, no release, no run failure event.
        os.kill(int(step_pid), signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        run = instance.get_run_by_id(run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.STARTED  # run monitoring is off

        sensor = build_reconciliation_sensor(blocking, code="t-wait", zombie_margin=dt.timedelta(0))
        # As if killed a moment ago (its last heartbeat written a minute ahead, so however slow this machine,
        # it is not stale by its own 5 s interval during the tick): in flight, not relaunched.
        _move(engine, job, heartbeat_at=-60)
        requests, message = _tick(dagster_pg, blocking, sensor)
        assert day not in [r.partition_key for r in requests], message

        # No heartbeat for an hour (its own interval: 5 s; its lease: 10 minutes, not expired). DESIGN 8: a
        # run still STARTED whose holder is stale by its own interval is a zombie, not in flight (this used
        # to wait for the lease's expiry). The sensor fails its lease (fenced) and relaunches the partition.
        _move(engine, job, heartbeat_at=3_600)
        requests, message = _tick(dagster_pg, blocking, sensor)
        (request,) = [r for r in requests if r.partition_key == day]
        assert request.tags["joblease/reconcile_reason"] == f"zombie holder dagster:tests/{run_id}"
        zombie = instance.get_run_by_id(run_id)
        assert zombie is not None and zombie.tags[TAG_OUTCOME] == "lost"
        assert zombie.status == dg.DagsterRunStatus.STARTED  # Dagster's status is Dagster's (monitoring)
        with engine.connect() as conn:
            status = conn.execute(
                sa.select(lease_table.c.status).where(lease_table.c.lock_key == job.idempotency_key)
            ).scalar_one()
        assert status == "FAIL"  # freed: the relaunched run reclaims it at once
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
        engine.dispose()


def test_a_young_run_without_the_lease_may_still_be_waiting_and_counts_in_flight(
    dagster_pg: DagsterPg,
) -> None:
    day = "2024-08-02"
    blocking = jobs.blocking_job()
    engine = create_engine(dagster_pg.joblease_url)
    try:
        service = LeaseService(engine)
        held = service.acquire(JobIdentity.schedule("t-wait", day))
        assert held is not None
        service.fail(held, "boom")
        instance = dagster_pg.instance
        waiting = instance.create_run_for_job(
            blocking, status=dg.DagsterRunStatus.STARTED, tags={"dagster/partition": day}
        )
        patient = build_reconciliation_sensor(blocking, code="t-wait", name="patient_zombies")
        requests, _ = _tick(dagster_pg, blocking, patient)
        assert day not in [r.partition_key for r in requests]
        fresh = instance.get_run_by_id(waiting.run_id)
        assert fresh is not None and TAG_OUTCOME not in fresh.tags  # in flight, not a zombie
        # Past its held wait plus the margin it holds nothing: a zombie, the partition is relaunched.
        strict = build_reconciliation_sensor(
            blocking, code="t-wait", name="strict_zombies", zombie_margin=dt.timedelta(0)
        )
        wait_until(
            lambda: day in [r.partition_key for r in _tick(dagster_pg, blocking, strict)[0]], timeout=30
        )
        tagged = instance.get_run_by_id(waiting.run_id)
        assert tagged is not None and tagged.tags[TAG_OUTCOME] == "lost"
    finally:
        engine.dispose()
