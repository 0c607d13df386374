"""The outbox sensor: one indexed query per tick, and at most one unfinished dispatcher run at a time."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import dagster as dg
import sqlalchemy as sa

from dagster_joblease import checks, outbox
from dagster_joblease.dagster.internals import REPOSITORY_LABEL_TAG
from dagster_joblease.dagster.jobs import (
    OutboxHealth,
    RoutesSource,
    pause_text,
    resolve_routes,
    topic_groups,
)
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.storage.clock import db_now
from dagster_joblease.storage.engine import translate_errors

__all__ = ["NOT_FINISHED_STATUSES", "build_outbox_sensor", "db_clock"]

#: A dispatcher run in any of these is "not finished". QUEUED and NOT_STARTED matter: Dagster's own
#: IN_PROGRESS_RUN_STATUSES omits them, and a guard built on it piles up queued dispatchers.
NOT_FINISHED_STATUSES = (
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
)


def db_clock(engine: sa.Engine) -> dt.datetime:
    """The joblease database's current time (UTC, aware): what sensors compare against, not the host's."""
    with translate_errors("read the database clock"), engine.connect() as conn:
        value = conn.execute(sa.select(db_now())).scalar_one()
    if isinstance(value, str):  # SQLite returns the text layout it stores
        value = dt.datetime.fromisoformat(value)
    assert isinstance(value, dt.datetime)
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def _own_location(context: dg.SensorEvaluationContext) -> dict[str, str]:
    """Tags that pick this code location's runs (another location may have a job of the same name)."""
    origin = context.code_location_origin
    if origin is None or context.repository_name is None:
        return {}
    return {REPOSITORY_LABEL_TAG: f"{context.repository_name}@{origin.location_name}"}


#: The outbox sensor's default interval: a committed row waits up to this long for a dispatcher run, so it
#: is part of the time from a commit to its effect downstream (``benchmarks/kill_to_effect.py``). A tick
#: is one query over the partial index of due rows.
OUTBOX_SENSOR_INTERVAL_S = 10


def build_outbox_sensor(
    job: dg.JobDefinition,
    *,
    name: str = "outbox_dispatch_sensor",
    resource_key: str = "joblease",
    minimum_interval_seconds: int = OUTBOX_SENSOR_INTERVAL_S,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    routes: RoutesSource | None = None,
    health: OutboxHealth | None = None,
    checks_interval_seconds: int = 300,
) -> dg.SensorDefinition:
    """A sensor that requests a run of ``job`` (the dispatcher) when outbox rows of its topics are due.

    ``routes`` (the dispatcher's routes, or a callable returning them) scopes the sensor to the topics
    this location delivers, so a location never starts dispatchers for another location's rows; ``None``
    looks at every topic. With ``health`` the sensor also reports those outbox checks (at most every
    ``checks_interval_seconds``), so they are evaluated even while no dispatcher runs.

    Each evaluation runs one query over the partial index of due rows. Nothing due: a ``SkipReason``
    with the count. With ``routes``, rows of limit groups a downstream paused (``429``/``503`` with
    ``Retry-After``) do not count as due, and the skip reason names the pause and its end. Rows due while a
    dispatcher run is queued or running: a ``SkipReason`` naming that run. Otherwise a ``RunRequest`` whose
    ``run_key`` is unique per request (a sensor's run keys dedupe
    forever, so a constant key would fire once, ever).

    Test it with ``sensor.evaluate_tick(ctx)`` inside ``with build_sensor_context(resources=...) as ctx``
    (the resource has setup/teardown hooks, so the ``with`` is required).
    """
    checks.integer("checks_interval_seconds", checks_interval_seconds, unit="seconds")

    # By name, not by object: Definitions rebuilds a sensor's job objects when it binds resources, and
    # that copy passes `owners=[]`, which Dagster 1.13 reports as a BetaWarning in every process.
    @dg.sensor(
        name=name,
        job_name=job.name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={resource_key},
        description="Requests a dispatcher run while outbox rows of its topics are due (one at a time).",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        resource: JobLeaseResource = getattr(context.resources, resource_key)
        engine = resource.engine
        route_map = None if routes is None else resolve_routes(routes)
        topics = None if route_map is None else tuple(sorted(route_map))
        groups = None if route_map is None else topic_groups(route_map)
        # Paused groups' rows are left out of `due`: no dispatcher run every tick that claims nothing.
        summary = outbox.delivery_health(engine, topics=topics, groups=groups)
        cursor: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
        checks_at = float(cursor.get("checks_at", 0))
        events: list[dg.AssetCheckEvaluation] = []
        if health is not None:
            now = db_clock(engine).timestamp()
            if now - checks_at >= checks_interval_seconds:
                events = health.evaluate(engine)
                checks_at = now
        new_cursor = json.dumps({"checks_at": checks_at})
        if summary.due == 0:
            reason = "0 outbox rows due"
            if summary.pauses:
                held = pause_text(summary.pauses)
                reason += f" ({summary.paused_due} more wait out a downstream's pause: {held})"
            return dg.SensorResult(skip_reason=dg.SkipReason(reason), asset_events=events, cursor=new_cursor)
        busy = context.instance.get_runs(
            dg.RunsFilter(
                job_name=job.name, statuses=list(NOT_FINISHED_STATUSES), tags=_own_location(context)
            ),
            limit=1,
        )
        if busy:
            run = busy[0]
            return dg.SensorResult(
                skip_reason=dg.SkipReason(
                    f"{summary.due} outbox rows due; dispatcher run {run.run_id} is {run.status.value} "
                    "(not finished), so no new run is requested"
                ),
                asset_events=events,
                cursor=new_cursor,
            )
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%f")
        request = dg.RunRequest(
            run_key=f"outbox-dispatch-{stamp}-{uuid.uuid4().hex[:8]}",
            tags={
                "joblease/due": str(summary.due),
                "joblease/oldest_due_age_ms": str(summary.oldest_due_age_ms or 0),
            },
        )
        return dg.SensorResult(run_requests=[request], asset_events=events, cursor=new_cursor)

    return _sensor
