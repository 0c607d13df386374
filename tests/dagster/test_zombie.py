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
import uuid
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource, build_reconciliation_sensor
from dagster_joblease.dagster.holders import encode_holder
from dagster_joblease.dagster.metadata import TAG_OUTCOME
from dagster_joblease.storage.schema import lease_table
from tests.conftest import wait_until
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg
from tests.dagster.test_takeover import _ready, _start_blocking_run


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


def _holding(proc: subprocess.Popen[str], ready: Path) -> tuple[int, str]:
    """The blocking run's step pid and run id, once its op holds the lease."""
    wait_until(lambda: _ready(ready) or proc.poll() is not None, timeout=120)
    assert ready.exists(), proc.communicate()[1]
    pid, run_id = ready.read_text().split()
    return int(pid), run_id


@pytest.mark.chaos
def test_a_sigkilled_run_is_a_zombie_once_its_heartbeat_is_stale_by_its_own_interval(
    dagster_pg: DagsterPg, tmp_path: Path
) -> None:
    day = "2024-08-01"
    job = JobIdentity.schedule("t-wait", day)
    instance = dagster_pg.instance
    blocking = jobs.blocking_job()
    ready = tmp_path / "ready"
    proc = _start_blocking_run(dagster_pg, day, ready)
    engine = create_engine(dagster_pg.joblease_url)
    try:
        step_pid, run_id = _holding(proc, ready)
        # The worker dies: the step process and the run process, no release, no run failure event.
        os.kill(step_pid, signal.SIGKILL)
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
        # run still STARTED whose heartbeat is missing for four of its own intervals is a zombie (this used
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


@pytest.mark.chaos
def test_a_holder_cut_off_for_less_than_the_failover_tolerance_is_alive_to_the_sensor(
    dagster_pg: DagsterPg, tmp_path: Path
) -> None:
    """#35 item 3: a STARTED run whose heartbeat is stale (3 of its 5 s intervals, as in a database
    failover that cuts it off) but not missing for the failover tolerance (4 intervals) is alive: the sensor
    neither fails its lease nor relaunches its partition nor tags it lost. (It used to call it a zombie
    holder after two missed beats, fail its lease and relaunch, so the live run's work happened twice.)"""
    day, ready = "2024-08-03", tmp_path / "ready"
    job = JobIdentity.schedule("t-wait", day)
    step_pid = 0
    proc = _start_blocking_run(dagster_pg, day, ready)
    engine = create_engine(dagster_pg.joblease_url)
    try:
        step_pid, run_id = _holding(proc, ready)
        # The holder is cut off: its heartbeats stop (the step process is paused), its last one 12 s ago.
        os.kill(step_pid, signal.SIGSTOP)
        _move(engine, job, heartbeat_at=12)
        sensor = build_reconciliation_sensor(jobs.blocking_job(), code="t-wait", name="blip_zombies")
        requests, message = _tick(dagster_pg, jobs.blocking_job(), sensor)
        assert day not in [r.partition_key for r in requests], message
        with engine.connect() as conn:
            status = conn.execute(
                sa.select(lease_table.c.status).where(lease_table.c.lock_key == job.idempotency_key)
            ).scalar_one()
        assert status == "RUNNING"  # not taken from the live holder
        run = dagster_pg.instance.get_run_by_id(run_id)
        assert run is not None and run.tags.get(TAG_OUTCOME) != "lost", message
    finally:
        if step_pid:
            os.kill(step_pid, signal.SIGCONT)
            os.kill(step_pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
        engine.dispose()


def _created_ago(dagster_pg: DagsterPg, run_id: str, seconds: int) -> None:
    """As if the run was created (enqueued) ``seconds`` ago: Dagster's runs table, its creation time."""
    storage = sa.create_engine(dagster_pg.storage_url)
    try:
        with storage.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE runs SET create_timestamp = create_timestamp - make_interval(secs => :s) "
                    "WHERE run_id = :r"
                ),
                {"s": seconds, "r": run_id},
            )
    finally:
        storage.dispose()


def _created_an_hour_ago(
    dagster_pg: DagsterPg, engine: sa.Engine, day: str, status: dg.DagsterRunStatus
) -> dg.DagsterRun:
    """A run of the partition created an hour ago (long past the held wait plus the margin), after an
    earlier attempt failed (so the sensor has the key to judge)."""
    service = LeaseService(engine)
    held = service.acquire(JobIdentity.schedule("t-wait", day))
    assert held is not None
    service.fail(held, "an earlier attempt failed")
    run = dagster_pg.instance.create_run_for_job(
        jobs.blocking_job(), status=status, tags={"dagster/partition": day}
    )
    _created_ago(dagster_pg, run.run_id, 3_600)
    return run


def _in_flight(dagster_pg: DagsterPg, run: dg.DagsterRun, sensor: dg.SensorDefinition) -> None:
    """One tick: the run's partition is not requested again and the run is not tagged lost."""
    requests, message = _tick(dagster_pg, jobs.blocking_job(), sensor)
    assert run.tags["dagster/partition"] not in [r.partition_key for r in requests], message
    fresh = dagster_pg.instance.get_run_by_id(run.run_id)
    assert fresh is not None and TAG_OUTCOME not in fresh.tags, message


def test_a_run_that_waited_in_the_queue_is_quiet_only_since_it_started(dagster_pg: DagsterPg) -> None:
    """#35 item 5: a run queued for an hour that has just started (it holds no lease yet: it is about to
    claim, or waits for a holder) is in flight, not a zombie: its quiet time counts from its start. (It
    used to count from its creation: tagged lost and its partition requested again at once.)"""
    blocking = jobs.blocking_job()
    engine = create_engine(dagster_pg.joblease_url)
    try:
        run = _created_an_hour_ago(dagster_pg, engine, "2024-08-04", dg.DagsterRunStatus.NOT_STARTED)
        instance = dagster_pg.instance
        instance.report_dagster_event(
            dg.DagsterEvent(event_type_value="PIPELINE_START", job_name=blocking.name), run.run_id
        )
        started = instance.get_run_record_by_id(run.run_id)
        assert started is not None and started.dagster_run.status == dg.DagsterRunStatus.STARTED
        assert started.start_time is not None
        _in_flight(dagster_pg, run, build_reconciliation_sensor(blocking, code="t-wait", name="queued"))
    finally:
        engine.dispose()


def test_a_run_busy_in_an_upstream_lease_is_alive_to_the_downstream_sensor(dagster_pg: DagsterPg) -> None:
    """#35 item 6: a STARTED run that holds none of this code's leases but renews a live lease of another
    code (its upstream step's) is alive: the downstream's sensor neither tags it lost nor relaunches its
    partition while it works. (It used to look only at leases of its own code.)"""
    day = "2024-08-05"
    blocking = jobs.blocking_job()
    engine = create_engine(dagster_pg.joblease_url)
    try:
        run = _created_an_hour_ago(dagster_pg, engine, day, dg.DagsterRunStatus.STARTED)
        upstream = LeaseService(engine, lease_ms=600_000, heartbeat_ms=60_000)
        held = upstream.try_acquire(
            JobIdentity.schedule(f"t-up-{uuid.uuid4().hex[:6]}", day),
            holder=encode_holder("tests", run.run_id),
        )
        assert held.acquired

        sensor = build_reconciliation_sensor(blocking, code="t-wait", name="busy_upstream")
        _in_flight(dagster_pg, run, sensor)

        # Once that lease is done and the run stays quiet, it is a zombie after all.
        assert held.lease is not None
        upstream.complete(held.lease)
        with engine.begin() as conn:
            conn.execute(
                sa.update(lease_table)
                .where(lease_table.c.id == held.lease.id)
                .values(finished_at=sa.func.clock_timestamp() - dt.timedelta(hours=1))
            )
        requests, message = _tick(dagster_pg, blocking, sensor)
        assert day in [r.partition_key for r in requests], message
    finally:
        engine.dispose()
