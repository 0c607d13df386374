"""A schedule for a time-partitioned job: the partition key is both the Dagster and the lease run key.

Dagster's ``run_key`` only dedupes a schedule within one tick, and backfills, manual launches,
re-executions and retries never consult it; the lease does the real deduplication. Mapping the tick's
partition key onto the lease's run key is what makes all of those paths one logical run.

**Missed ticks are not caught up** (:data:`NO_CATCH_UP`): ticks missed while the scheduler daemon was
down are not evaluated, only the latest one, so their partitions are not requested. This is Dagster's
own rule for every schedule in 1.12 and 1.13, ``build_schedule_from_partitioned_job``'s included (a
schedule's snapshot carries no partition set, and the scheduler then logs "has no partition set, so not
trying to catch up"): replacing one with this loses nothing. What covers missed partitions is the
reconciliation sensor's ``catch_up_from`` (``build_reconciliation_sensor``), or a backfill.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import dagster as dg

from dagster_joblease import errors, identity
from dagster_joblease.dagster import metadata
from dagster_joblease.dagster.holders import decode_holder
from dagster_joblease.storage import leases
from dagster_joblease.storage.engine import translate_errors

__all__ = ["NO_CATCH_UP", "build_leased_schedule", "partition_for_tick"]

#: Said in every leased schedule's description (the UI's schedule page) and docstring.
NO_CATCH_UP = (
    "Ticks missed while the scheduler daemon was down are not caught up (Dagster evaluates only the "
    "latest, as for every schedule); build_reconciliation_sensor(catch_up_from=...) or a backfill "
    "requests their partitions."
)


def _time_partitions(job: dg.JobDefinition, code: str) -> dg.TimeWindowPartitionsDefinition:
    partitions_def = job.partitions_def
    if not isinstance(partitions_def, dg.TimeWindowPartitionsDefinition):
        raise errors.ConfigurationError(
            f"job {job.name!r} (code {code!r}) has partitions_def {type(partitions_def).__name__}; a leased "
            "schedule needs time-window partitions (DailyPartitionsDefinition, HourlyPartitionsDefinition, "
            "TimeWindowPartitionsDefinition(cron_schedule=...)). Give the job one"
        )
    return partitions_def


def partition_for_tick(
    partitions_def: dg.TimeWindowPartitionsDefinition, tick_time: dt.datetime | None
) -> str | None:
    """The last *complete* partition at ``tick_time`` (``None`` before the first one ends)."""
    with dg.partition_loading_context(effective_dt=tick_time):
        return partitions_def.get_last_partition_key()


def build_leased_schedule(
    job: dg.JobDefinition,
    *,
    code: str,
    cron_schedule: str | None = None,
    execution_timezone: str | None = None,
    name: str | None = None,
    description: str | None = None,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.STOPPED,
    job_by_name: bool = False,
    resource_key: str | None = "joblease",
) -> dg.ScheduleDefinition:
    """A schedule that requests, on each tick, the last complete partition of ``job``.

    Each request is ``RunRequest(run_key=<partition key>, partition_key=<partition key>)`` tagged with
    ``joblease/code``, ``joblease/run_key``, ``joblease/idempotency_key`` and ``joblease/outcome=pending``
    (what a queued run shows until its leased step writes the real outcome). The cron defaults to the
    partitions' own cadence and the time zone to the partitions' time zone; e.g.
    ``cron_schedule="0 2 * * *"`` on daily UTC partitions bills yesterday at 02:00 UTC.

    A tick whose partition's lease is already SUCCESS (done by a backfill, a manual launch or another
    deployment) launches nothing: it skips with a reason naming the run that did it, so the Runs page
    shows no green run that did nothing. That look-up reads the lease through the resource under
    ``resource_key`` (the one the leased step uses); ``resource_key=None`` turns it off (every tick
    requests its partition and the run itself skips, tagged ``skipped-succeeded``). When the look-up
    fails (the database is down), the tick requests the run anyway and logs why: the lease still decides.

    **Missed ticks are not caught up**: when the scheduler daemon was down over several ticks, only the
    latest is evaluated, so only its partition is requested (Dagster's rule for every schedule,
    ``build_schedule_from_partitioned_job``'s included). Give the job's reconciliation sensor
    ``catch_up_from=<first partition key>`` (it requests every never-attempted partition from there), or
    launch a backfill. The schedule's description says so (:data:`NO_CATCH_UP`).

    ``job_by_name=True`` makes the schedule name its job instead of holding it, so the job must be in the
    same ``Definitions``' ``jobs``; the Components use it (a defs folder rebuilds the job objects it loads,
    and a schedule holding the original would be a second job of the same name).
    """
    identity.JobIdentity.initial(code)  # validate the code at definition time
    partitions_def = _time_partitions(job, code)
    cron = cron_schedule or partitions_def.cron_schedule
    timezone = execution_timezone or partitions_def.timezone

    target: dict[str, Any] = {"job_name": job.name} if job_by_name else {"job": job}
    if resource_key is not None:
        target["required_resource_keys"] = {resource_key}

    @dg.schedule(
        cron_schedule=cron,
        name=name or f"{job.name}_schedule",
        description=(
            description or f"Requests the last complete partition of {job.name} under lease code {code!r}."
        )
        + " "
        + NO_CATCH_UP,
        execution_timezone=timezone,
        default_status=default_status,
        tags={metadata.TAG_CODE: identity.JobIdentity.initial(code).code},
        **target,
    )
    def _schedule(context: dg.ScheduleEvaluationContext, **_: Any) -> dg.RunRequest | dg.SkipReason:
        # (**_: a schedule called directly is handed its required resources as keywords too.)
        key = partition_for_tick(partitions_def, context.scheduled_execution_time)
        if key is None:
            return dg.SkipReason(f"no complete partition of {job.name} at this tick yet")
        winner = None
        if resource_key is not None:
            winner = _done_by(getattr(context.resources, resource_key), code, key, context.log)
        if winner is not None:
            return dg.SkipReason(
                f"skipped: {code}@{key} is already done by {winner} (lease SUCCESS); nothing launched"
            )
        return dg.RunRequest(run_key=key, partition_key=key, tags=metadata.schedule_tags(code, key))

    return _schedule


def _done_by(resource: Any, code: str, key: str, log: logging.Logger | dg.DagsterLogManager) -> str | None:
    """Who did ``code@key`` when its lease is SUCCESS (``run <id>`` of a deployment, or the holder), else
    None; None too, logged, when the lease cannot be read (the run then asks the lease itself)."""
    lock_key = identity.JobIdentity.schedule(code, key).idempotency_key
    try:
        with translate_errors("read the partition's lease"), resource.engine.connect() as conn:
            state = leases.states_of(conn, {lock_key: key}).get(key)
    except errors.JobLeaseError as exc:
        log.warning(
            "could not read the lease of %s@%s (%s); requesting the run, which asks it itself", code, key, exc
        )
        return None
    if state is None or state.status != "SUCCESS":
        return None
    holder = decode_holder(state.holder)
    if holder is None:
        return f"holder {state.holder}" if state.holder else "a worker outside Dagster"
    return f"run {holder.run_id} of deployment {holder.deployment!r}"
