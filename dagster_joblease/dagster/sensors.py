"""The outbox sensor: one indexed query per tick, and at most one unfinished dispatcher run at a time."""

from __future__ import annotations

import datetime as dt
import uuid

import dagster as dg

from dagster_joblease.dagster.resource import JobLeaseResource

__all__ = ["NOT_FINISHED_STATUSES", "build_outbox_sensor"]

#: A dispatcher run in any of these is "not finished". QUEUED and NOT_STARTED matter: Dagster's own
#: IN_PROGRESS_RUN_STATUSES omits them, and a guard built on it piles up queued dispatchers.
NOT_FINISHED_STATUSES = (
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
)


def build_outbox_sensor(
    job: dg.JobDefinition,
    *,
    name: str = "outbox_dispatch_sensor",
    resource_key: str = "joblease",
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor that requests a run of ``job`` (the dispatcher) when outbox rows are due.

    Each evaluation runs one query over the partial index of due rows. Nothing due: a ``SkipReason``
    with the count. Rows due while a dispatcher run is queued or running: a ``SkipReason`` naming that
    run. Otherwise a ``RunRequest`` whose ``run_key`` is unique per request (a sensor's run keys dedupe
    forever, so a constant key would fire once, ever).

    Test it with ``sensor.evaluate_tick(ctx)`` inside ``with build_sensor_context(resources=...) as ctx``
    (the resource has setup/teardown hooks, so the ``with`` is required).
    """

    @dg.sensor(
        name=name,
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key},
        description="Requests a dispatcher run while outbox rows are due (one unfinished run at a time).",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        resource: JobLeaseResource = getattr(context.resources, resource_key)
        summary = resource.due_summary()
        if summary.due == 0:
            return dg.SkipReason("0 outbox rows due")
        busy = context.instance.get_runs(
            dg.RunsFilter(job_name=job.name, statuses=list(NOT_FINISHED_STATUSES)), limit=1
        )
        if busy:
            run = busy[0]
            return dg.SkipReason(
                f"{summary.due} outbox rows due; dispatcher run {run.run_id} is {run.status.value} "
                "(not finished), so no new run is requested"
            )
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%f")
        return dg.RunRequest(
            run_key=f"outbox-dispatch-{stamp}-{uuid.uuid4().hex[:8]}",
            tags={
                "joblease/due": str(summary.due),
                "joblease/oldest_due_age_ms": str(summary.oldest_due_age_ms or 0),
            },
        )

    return _sensor
