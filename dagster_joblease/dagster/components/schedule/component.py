"""The schedule Component: a leased schedule for a job or asset."""

# No `from __future__ import annotations`: Dagster derives the YAML schema from the dataclass fields'
# runtime types (string annotations are not resolved).

import dataclasses
from typing import Any

import dagster as dg
from dagster.components import Component, ComponentLoadContext, Resolvable
from dagster.components import scaffold_with as _scaffold_with

from dagster_joblease import errors
from dagster_joblease.dagster.components.schedule.scaffolder import _ScheduleScaffolder
from dagster_joblease.dagster.components.shared import Status, TargetSpec, _resource_key
from dagster_joblease.dagster.schedules import build_leased_schedule

__all__ = ["LeasedScheduleComponent"]


@_scaffold_with(_ScheduleScaffolder)
@dataclasses.dataclass
class LeasedScheduleComponent(Component, Resolvable):
    """A leased schedule: each tick runs the last complete partition once.

    :func:`build_leased_schedule`: partition key = Dagster run key = lease run key. For an asset target
    the component also defines the asset job it launches (``<asset>_job`` unless ``job_name`` says
    otherwise).

    Attributes:
        target: The job or leased asset it launches (``TargetSpec``).
        code: The lease code of the target's leased step (``@leased_op(code=...)``).
        cron_schedule: When it ticks (default: the partitions' own cadence).
        execution_timezone: The cron's timezone (default: the partitions').
        name: The schedule's name (default ``<job>_schedule``).
        job_name: For an asset target, the name of the asset job it defines (default ``<asset>_job``).
        description: The schedule's description in the UI.
        default_status: ``stopped`` (the default) or ``running``.
        resource_key: The resource a tick reads the partition's lease through (a done partition skips).
    """

    target: TargetSpec
    code: str
    cron_schedule: str | None = None
    execution_timezone: str | None = None
    name: str | None = None
    job_name: str | None = None
    description: str | None = None
    default_status: Status = "stopped"
    #: The resource a tick reads the partition's lease through (a done partition skips, naming its run).
    resource_key: str = "joblease"

    def build_defs(self, context: ComponentLoadContext) -> dg.Definitions:
        where = f"LeasedScheduleComponent {self.name or self.code!r}"
        target = self.target.resolve(context, where)
        jobs: list[Any] = []
        if isinstance(target, dg.AssetsDefinition):
            if not isinstance(target.partitions_def, dg.TimeWindowPartitionsDefinition):
                raise errors.ConfigurationError(
                    f"{where}: {self.target.describe()} needs time-window partitions for a leased schedule"
                )
            asset_job = dg.define_asset_job(
                self.job_name or f"{target.key.to_python_identifier()}_job",
                selection=[target.key],
                partitions_def=target.partitions_def,
            )
            jobs.append(asset_job)
            job: Any = asset_job  # an unresolved asset job: the builder needs only its name and partitions
        else:
            job = target
        schedule = build_leased_schedule(
            job,
            code=self.code,
            cron_schedule=self.cron_schedule,
            execution_timezone=self.execution_timezone,
            name=self.name,
            description=self.description,
            default_status=(
                dg.DefaultScheduleStatus.RUNNING
                if self.default_status == "running"
                else dg.DefaultScheduleStatus.STOPPED
            ),
            job_by_name=True,
            resource_key=_resource_key(where, self.resource_key),
        )
        return dg.Definitions(jobs=jobs, schedules=[schedule])
