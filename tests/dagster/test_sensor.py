"""The outbox sensor and the dispatcher job on a PostgreSQL-backed instance with a real receiver."""

from __future__ import annotations

import os
from collections.abc import Iterator

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin

from dagster_joblease import create_engine, outbox
from dagster_joblease.dagster import (
    NOT_FINISHED_STATUSES,
    OUTBOX_ASSET_KEY,
    JobLeaseResource,
    outbox_asset_spec,
)
from dagster_joblease.receiver import effect_count
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg
from tests.receiver_proc import ReceiverProcess

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    eng = create_engine(dagster_pg.joblease_url)
    yield eng
    eng.dispose()


def _tick(dagster_pg: DagsterPg) -> dg.SensorResult | object:
    with dg.build_sensor_context(
        instance=dagster_pg.instance, resources={"joblease": JobLeaseResource()}
    ) as context:
        return jobs.dispatch_sensor.evaluate_tick(context)


def _origin(job_name: str) -> RemoteJobOrigin:
    # A queued run must name where its code lives; the sensor only reads statuses, so any location works.
    location = RegisteredCodeLocationOrigin(location_name="tests")
    return RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(
            code_location_origin=location, repository_name="__repository__"
        ),
        job_name=job_name,
    )


def _enqueue(engine: sa.Engine, key: str, topic: str = jobs.TOPIC) -> None:
    with engine.begin() as conn:
        assert outbox.enqueue_once(conn, idempotency_key=key, topic=topic, payload={"key": key})


def test_sensor_requests_one_dispatcher_run_at_a_time_and_the_job_reports(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    instance = dagster_pg.instance
    nothing = _tick(dagster_pg)
    assert nothing.run_requests == [] and nothing.skip_message == "0 outbox rows due"

    _enqueue(engine, "v2:sensor-1")
    _enqueue(engine, "v2:sensor-2")
    _enqueue(engine, "v2:sensor-poison", topic="no.route.configured")
    first = _tick(dagster_pg)
    (request,) = first.run_requests
    assert request.run_key and request.tags["joblease/due"] == "3"

    # The daemon turns the request into a run; until it finishes, no second dispatcher is requested.
    # QUEUED and NOT_STARTED count as not finished (Dagster's IN_PROGRESS_RUN_STATUSES omits them).
    job_def = jobs.defs.resolve_job_def("test_dispatch_job")
    run = instance.create_run_for_job(
        job_def,
        status=dg.DagsterRunStatus.NOT_STARTED,
        tags=request.tags,
        remote_job_origin=_origin(job_def.name),
    )
    steps = [
        (None, dg.DagsterRunStatus.NOT_STARTED),
        (dg.DagsterEventType.RUN_ENQUEUED, dg.DagsterRunStatus.QUEUED),
        (dg.DagsterEventType.RUN_STARTING, dg.DagsterRunStatus.STARTING),
        (dg.DagsterEventType.RUN_START, dg.DagsterRunStatus.STARTED),
        (dg.DagsterEventType.RUN_CANCELING, dg.DagsterRunStatus.CANCELING),
    ]
    for event_type, status in steps:
        if event_type is not None:
            instance.report_dagster_event(
                dg.DagsterEvent(event_type_value=event_type.value, job_name=job_def.name), run.run_id
            )
        stored = instance.get_run_by_id(run.run_id)
        assert stored is not None and stored.status == status and status in NOT_FINISHED_STATUSES
        busy = _tick(dagster_pg)
        assert busy.run_requests == []
        assert f"dispatcher run {run.run_id} is {status.value}" in busy.skip_message
        assert busy.skip_message.startswith("3 outbox rows due")
    instance.report_dagster_event(
        dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_CANCELED.value, job_name=job_def.name),
        run.run_id,
    )
    (again,) = _tick(dagster_pg).run_requests  # a finished (canceled) dispatcher no longer blocks
    assert again.run_key != request.run_key

    with ReceiverProcess(dagster_pg.joblease_url) as receiver:
        os.environ[jobs.RECEIVER_ENV] = receiver.url
        try:
            result = job_def.execute_in_process(instance=instance, run_config=QUIET)
            counts = result.output_for_node("test_dispatch_job_dispatch")
            sent = counts["sent"]
            for _ in range(5):
                # On a loaded machine a delivery can time out: a retry (with backoff) is the dispatcher
                # working as designed; the retried row goes out on a later run.
                if sent == 2:
                    break
                wait_until(lambda: outbox.due_summary(engine).due > 0, timeout=10)
                again = job_def.execute_in_process(instance=instance, run_config=QUIET)
                sent += again.output_for_node("test_dispatch_job_dispatch")["sent"]
        finally:
            os.environ.pop(jobs.RECEIVER_ENV)
    assert result.success
    assert (counts["claimed"], counts["dead"], counts["sent"] + counts["retried"]) == (3, 1, 2), counts
    assert sent == 2
    assert effect_count(engine) == 2

    (observation,) = result.asset_observations_for_node("test_dispatch_job_dispatch")
    assert observation.asset_key == OUTBOX_ASSET_KEY
    assert observation.metadata["sent"] == dg.MetadataValue.int(counts["sent"])
    assert {"batches", "lost_claims", "released", "unrecorded", "due_after"} <= set(observation.metadata)
    assert (counts["lost_claims"], counts["released"], counts["unrecorded"]) == (0, 0, 0), counts
    (check,) = result.get_asset_check_evaluations()
    assert check.asset_key == OUTBOX_ASSET_KEY and check.check_name == "no_dead_rows"
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert check.metadata["dead_rows"] == dg.MetadataValue.int(1)
    dead_table = str(check.metadata["dead"])
    assert "v2:sensor-poison" in dead_table and "no.route.configured" in dead_table

    # The finished dispatcher no longer blocks; dead rows are not due, so nothing is requested.
    after = _tick(dagster_pg)
    assert after.run_requests == [] and after.skip_message == "0 outbox rows due"

    # New work gets a new, different run key (a sensor's run keys dedupe forever).
    _enqueue(engine, "v2:sensor-3")
    (second,) = _tick(dagster_pg).run_requests
    assert second.run_key != request.run_key


def test_the_dead_rows_check_runs_on_its_own(dagster_pg: DagsterPg, engine: sa.Engine) -> None:
    _enqueue(engine, "v2:check-dead", topic="check.topic")
    with engine.begin() as conn:  # as the dispatcher parks a row after a 4xx
        conn.execute(
            sa.update(outbox_table)
            .where(outbox_table.c.idempotency_key == "v2:check-dead")
            .values(status="DEAD", attempts=1, last_status=400, last_error="HTTP 400: rejected")
        )
    checks_job = dg.define_asset_job(
        "outbox_checks_job", selection=dg.AssetSelection.checks_for_assets(OUTBOX_ASSET_KEY)
    )
    defs = dg.Definitions(
        assets=[outbox_asset_spec],
        asset_checks=[jobs.dead_rows_check],
        jobs=[checks_job],
        resources={"joblease": JobLeaseResource()},
    )
    result = defs.resolve_job_def("outbox_checks_job").execute_in_process(
        instance=dagster_pg.instance, run_config=QUIET
    )
    assert result.success  # a failed check is reported, not a failed run
    (check,) = result.get_asset_check_evaluations()
    assert check.passed is False and check.severity == dg.AssetCheckSeverity.ERROR
    dead = str(check.metadata["dead"])
    assert "v2:check-dead" in dead and "check.topic" in dead and "HTTP 400: rejected" in dead
