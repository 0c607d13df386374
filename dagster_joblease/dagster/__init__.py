"""The Dagster integration: the only part of dagster-joblease that imports Dagster.

- :class:`JobLeaseResource`: engine, lease service, outbox and a fenced domain+outbox transaction.
- :func:`build_leased_schedule`: partition key = Dagster run key = lease run key.
- :func:`leased_op` / :func:`leased_asset` / :func:`run_leased`: bodies under ``run_exclusive``; skips
  succeed and are recorded (``joblease/...`` run tags and output metadata).
- :func:`build_outbox_sensor` / :func:`build_dispatcher_job` /
  :class:`~dagster_joblease.dagster.jobs.OutboxHealth`: delivery and its checks.
- :func:`build_reconciliation_sensor`: relaunches partitions left undone (failed, expired, dead holder, held).
- :func:`build_not_run_sensors`: run-status sensors rewriting copied tags of runs whose leased step never ran.
- the Components (:mod:`~dagster_joblease.dagster.components`): the same in ``defs.yaml``.
- :func:`~dagster_joblease.dagster.testing.run_partition_twice`: for your tests, a partition run
  twice at once (backfill + schedule).

Run tags, outcome names and metadata keys live in :mod:`dagster_joblease.dagster.metadata`; the
delivery checks in :mod:`~dagster_joblease.dagster.jobs`; the holder helpers in
:mod:`~dagster_joblease.dagster.holders`; the test helper in :mod:`~dagster_joblease.dagster.testing`.
"""

from __future__ import annotations

from dagster_joblease.dagster.components import (
    JobLeaseDeliveryComponent,
    JobLeaseResourceComponent,
    LeasedScheduleComponent,
    ReconciliationSensorComponent,
)
from dagster_joblease.dagster.jobs import build_dispatcher_job
from dagster_joblease.dagster.ops import LeasedRun, leased_asset, leased_op, run_leased
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.run_status import build_not_run_sensors
from dagster_joblease.dagster.schedules import build_leased_schedule
from dagster_joblease.dagster.sensors import build_outbox_sensor

__all__ = [
    "JobLeaseDeliveryComponent",
    "JobLeaseResource",
    "JobLeaseResourceComponent",
    "LeasedRun",
    "LeasedScheduleComponent",
    "ReconciliationSensorComponent",
    "build_dispatcher_job",
    "build_leased_schedule",
    "build_not_run_sensors",
    "build_outbox_sensor",
    "build_reconciliation_sensor",
    "leased_asset",
    "leased_op",
    "run_leased",
]
