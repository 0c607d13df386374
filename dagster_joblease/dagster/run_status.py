"""Run-status sensors that keep ``joblease/*`` run tags true when a run's leased step never ran.

Dagster copies a parent run's tags onto a re-execution or a run retry at launch. When the leased step
then does not run (a re-execution from failure in which only a later step ran; an earlier step failed,
so the leased step was skipped), nothing in the run overwrites the copied ``joblease/outcome=won``: the
run would show an outcome it did not have, and filtering ``joblease/outcome=won`` would list it. These
sensors look at each run as it finishes (success, failure or cancel) and, if no leased step recorded
anything in it (a leased step records an engine event when it starts and when it ends), rewrite its
``joblease/*`` step tags to ``not-run``. Runs that carry no ``joblease/*`` step tag are left alone.

Turn them on (they default to RUNNING) with :func:`build_not_run_sensors`; they watch every job of their
code location (or ``monitored_jobs``; ``monitor_all_code_locations=True`` for every location). A
Components location gets them from ``JobLeaseResourceComponent`` (``not_run_sensors``, default on); a
leased step in a location without them logs a warning saying so
(:mod:`~dagster_joblease.dagster.not_run_coverage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

from dagster_joblease.dagster import metadata, not_run_coverage
from dagster_joblease.dagster.ops import step_records

__all__ = ["NOT_RUN_STATUSES", "build_not_run_sensors", "not_run_tags_for"]

#: The finished statuses watched: one run-status sensor each.
NOT_RUN_STATUSES = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


def not_run_tags_for(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dict[str, str] | None:
    """The tags to write on a finished ``run`` whose leased step never ran, or ``None`` (leave it).

    ``None`` when the run carries no ``joblease/*`` step tag (no leased step in its job, or nothing copied),
    when a leased step of this run recorded anything (its own tags are true), or when it already says
    ``not-run``. The key count of the copied ``joblease/work`` is kept (a range run of 30 keys: not-run:30).
    """
    if not any(tag in run.tags for tag in metadata.STEP_TAGS):
        return None
    if run.tags.get(metadata.TAG_OUTCOME) == metadata.NOT_RUN:
        return None
    if step_records(instance, run.run_id):
        return None
    try:
        keys = sum(metadata.parse_counts(run.tags.get(metadata.TAG_WORK, "")).values())
    except ValueError:  # a tag a person edited: the count is only informational
        keys = 1
    return metadata.not_run_tags(max(keys, 1))


def build_not_run_sensors(
    *,
    name: str = "joblease_not_run",
    monitored_jobs: Sequence[dg.JobDefinition] | None = None,
    monitor_all_code_locations: bool = False,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> list[dg.SensorDefinition]:
    """Three run-status sensors (success, failure, canceled) that rewrite a finished run's copied
    ``joblease/*`` tags to ``not-run`` when its leased step never ran; see the module docstring.

    Each is named ``<name>_<status>`` (``joblease_not_run_success`` …). Add all three to your
    ``Definitions``; a tick handles the runs that finished since the last one.
    """
    sensors: list[dg.SensorDefinition] = []
    for status in NOT_RUN_STATUSES:
        sensor_name = f"{name}_{status.value.lower()}"

        def _rewrite(context: dg.RunStatusSensorContext) -> dg.SkipReason:
            run = context.dagster_run
            tags = not_run_tags_for(context.instance, run)
            if tags is None:
                return dg.SkipReason(f"run {run.run_id}: its joblease tags are its own (or it has none)")
            context.instance.add_run_tags(run.run_id, tags)
            context.log.info(
                f"run {run.run_id} ({run.status.value}): its leased step never ran; joblease tags "
                f"copied from its parent rewritten to {tags[metadata.TAG_OUTCOME]}"
            )
            return dg.SkipReason(f"run {run.run_id}: tags rewritten to not-run")

        kwargs: dict[str, Any] = {}
        if monitored_jobs is not None:
            kwargs["monitored_jobs"] = list(monitored_jobs)
        sensors.append(
            dg.run_status_sensor(
                run_status=status,
                name=sensor_name,
                minimum_interval_seconds=minimum_interval_seconds,
                default_status=default_status,
                monitor_all_code_locations=monitor_all_code_locations,
                description=(
                    f"{not_run_coverage.DESCRIPTION_PREFIX}{status.value.lower()} runs whose leased step "
                    "never ran (copied from a parent run) to not-run."
                ),
                **kwargs,
            )(_rewrite)
        )
    return sensors
