"""The Dagster integration: the only part of dagster-joblease that imports Dagster.

- :class:`JobLeaseResource`: engine, lease service, outbox and a fenced domain+outbox transaction.
- :func:`build_leased_schedule`: partition key = Dagster run key = lease run key.
- :func:`leased_op` / :func:`leased_asset` / :func:`run_leased`: bodies under ``run_exclusive``; skips
  succeed and are recorded (``joblease/...`` run tags and output metadata).
- :func:`build_outbox_sensor` / :func:`build_dispatcher_job` / :class:`OutboxHealth`: delivery and its checks.
- :func:`build_reconciliation_sensor`: relaunches partitions left undone (failed, expired, dead holder, held).
- :func:`build_not_run_sensors`: run-status sensors rewriting copied tags of runs whose leased step never ran.
- :func:`run_partition_twice`: for your tests, a partition run twice at once (backfill + schedule).
"""

from __future__ import annotations

from dagster_joblease.dagster.holders import (
    DagsterHolder,
    decode_holder,
    encode_holder,
    holder_run_finished,
    holder_run_status,
)
from dagster_joblease.dagster.jobs import (
    BACKLOG_CHECK,
    DEAD_ROWS_CHECK,
    OUTBOX_ASSET_KEY,
    UNROUTED_CHECK,
    DispatchConfig,
    OutboxHealth,
    build_dead_rows_check,
    build_dispatcher_job,
    dead_rows_evaluation,
    outbox_asset_spec,
)
from dagster_joblease.dagster.metadata import (
    FAILED,
    HELD,
    LOST,
    NOT_ATTEMPTED,
    NOT_RUN,
    PENDING,
    RECLAIMED,
    SKIPPED_SUCCEEDED,
    STEP_TAGS,
    TAG_CODE,
    TAG_OUTCOME,
    TAG_RECONCILE_REASON,
    TAG_RELAUNCH,
    TAG_WINNER,
    TAG_WORK,
    WON,
    LeasedResult,
    schedule_tags,
)
from dagster_joblease.dagster.ops import (
    LeasedBatch,
    LeasedRun,
    leased_asset,
    leased_op,
    run_leased,
    settle_run_tags,
)
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.run_status import build_not_run_sensors
from dagster_joblease.dagster.schedules import build_leased_schedule, partition_for_tick
from dagster_joblease.dagster.sensors import NOT_FINISHED_STATUSES, build_outbox_sensor
from dagster_joblease.dagster.testing import PartitionRun, run_partition_twice

__all__ = [
    "BACKLOG_CHECK",
    "DEAD_ROWS_CHECK",
    "FAILED",
    "HELD",
    "LOST",
    "NOT_ATTEMPTED",
    "NOT_FINISHED_STATUSES",
    "NOT_RUN",
    "OUTBOX_ASSET_KEY",
    "PENDING",
    "RECLAIMED",
    "SKIPPED_SUCCEEDED",
    "STEP_TAGS",
    "TAG_CODE",
    "TAG_OUTCOME",
    "TAG_RECONCILE_REASON",
    "TAG_RELAUNCH",
    "TAG_WINNER",
    "TAG_WORK",
    "UNROUTED_CHECK",
    "WON",
    "DagsterHolder",
    "DispatchConfig",
    "JobLeaseResource",
    "LeasedBatch",
    "LeasedResult",
    "LeasedRun",
    "OutboxHealth",
    "PartitionRun",
    "build_dead_rows_check",
    "build_dispatcher_job",
    "build_leased_schedule",
    "build_not_run_sensors",
    "build_outbox_sensor",
    "build_reconciliation_sensor",
    "dead_rows_evaluation",
    "decode_holder",
    "encode_holder",
    "holder_run_finished",
    "holder_run_status",
    "leased_asset",
    "leased_op",
    "outbox_asset_spec",
    "partition_for_tick",
    "run_leased",
    "run_partition_twice",
    "schedule_tags",
    "settle_run_tags",
]
