"""The reconciliation Component: a reconciliation sensor for a job or asset."""

# No `from __future__ import annotations`: Dagster derives the YAML schema from the dataclass fields'
# runtime types (string annotations are not resolved).

import dataclasses
import datetime as dt

import dagster as dg
from dagster.components import Component, ComponentLoadContext, Resolvable
from dagster.components import scaffold_with as _scaffold_with

from dagster_joblease import checks
from dagster_joblease.dagster.components.reconciliation.scaffolder import _ReconcileScaffolder
from dagster_joblease.dagster.components.shared import Status, TargetSpec, _resource_key, _sensor_status
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.reconcile.sensor import RECONCILE_INTERVAL_S

__all__ = ["ReconciliationSensorComponent"]


@_scaffold_with(_ReconcileScaffolder)
@dataclasses.dataclass
class ReconciliationSensorComponent(Component, Resolvable):
    """Relaunches partitions whose lease failed, expired, lost its holder or ended held.

    :func:`build_reconciliation_sensor` for a partitioned job or leased asset; durations in seconds.

    Attributes:
        target: The job or leased asset whose partitions it relaunches (``TargetSpec``).
        code: The lease code of the target's leased step.
        name: The sensor's name (default from the code).
        resource_key: The joblease resource it reads the leases through.
        lookback_seconds: Only leases active, and runs created, within this window are considered.
        catch_up_from: A partition key: never-attempted partitions from it on are requested too.
        max_requests_per_tick: At most this many run requests per evaluation (relaunches first).
        max_relaunches: Relaunches per partition before it gives up and says so.
        backoff_seconds: The second relaunch waits this long after the lease's last activity, doubling.
        max_backoff_seconds: The cap of that wait.
        relaunch_canceled: Relaunch a partition whose latest run was canceled (default: leave it).
        holder_stale_ms: May only lengthen how old a RUNNING holder's heartbeat must be to count as dead.
        minimum_interval_seconds: Seconds between two evaluations.
        description: The sensor's description in the UI.
        default_status: ``running`` (the default: it is the safety net) or ``stopped``.
    """

    target: TargetSpec
    code: str
    name: str | None = None
    resource_key: str = "joblease"
    lookback_seconds: int = 7 * 86_400
    catch_up_from: str | None = None
    max_requests_per_tick: int = 10
    max_relaunches: int = 5
    backoff_seconds: int = 120
    max_backoff_seconds: int = 3_600
    relaunch_canceled: bool = False
    holder_stale_ms: int | None = None
    minimum_interval_seconds: int = RECONCILE_INTERVAL_S
    description: str | None = None
    default_status: Status = "running"

    def build_defs(self, context: ComponentLoadContext) -> dg.Definitions:
        where = f"ReconciliationSensorComponent {self.name or self.code!r}"
        target = self.target.resolve(context, where)
        for label, value in (
            ("lookback_seconds", self.lookback_seconds),
            ("backoff_seconds", self.backoff_seconds),
            ("max_backoff_seconds", self.max_backoff_seconds),
        ):
            checks.integer(f"{where}: {label}", value, minimum=0, unit="seconds")
        sensor = build_reconciliation_sensor(
            target,
            code=self.code,
            name=self.name,
            lookback=dt.timedelta(seconds=self.lookback_seconds),
            catch_up_from=self.catch_up_from,
            max_requests_per_tick=self.max_requests_per_tick,
            max_relaunches=self.max_relaunches,
            backoff=dt.timedelta(seconds=self.backoff_seconds),
            max_backoff=dt.timedelta(seconds=self.max_backoff_seconds),
            relaunch_canceled=self.relaunch_canceled,
            holder_stale_ms=self.holder_stale_ms,
            minimum_interval_seconds=self.minimum_interval_seconds,
            resource_key=_resource_key(where, self.resource_key),
            default_status=_sensor_status(self.default_status),
            description=self.description,
        )
        return dg.Definitions(sensors=[sensor])
