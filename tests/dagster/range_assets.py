"""Leased assets and jobs for the range-run tests (module level: subprocesses import them).

Every body writes one outbox row per key in its fenced transaction. Environment variables steer a body
from the test: ``JOBLEASE_RANGE_FAIL`` (comma-separated keys whose body raises), ``JOBLEASE_RANGE_BLOCK``
(a key whose body writes ``JOBLEASE_RANGE_READY`` and then waits until the file ``JOBLEASE_RANGE_RELEASE``
exists, or up to 120 s, for a test to act meanwhile or terminate the run) and ``JOBLEASE_RANGE_LOG``
(a file each body call appends its keys to, one line per call).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import dagster as dg

from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_asset, leased_op
from dagster_joblease.dagster.ops import LeasedBatch

FAIL_ENV = "JOBLEASE_RANGE_FAIL"
BLOCK_ENV = "JOBLEASE_RANGE_BLOCK"
READY_ENV = "JOBLEASE_RANGE_READY"
RELEASE_ENV = "JOBLEASE_RANGE_RELEASE"
LOG_ENV = "JOBLEASE_RANGE_LOG"
TOPIC = "test.range"

days = dg.DailyPartitionsDefinition(start_date="2024-01-01")
SINGLE_RUN = dg.BackfillPolicy.single_run()


def _steer(keys: list[str]) -> None:
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(",".join(keys) + "\n")
    failing = set(filter(None, os.environ.get(FAIL_ENV, "").split(",")))
    if failing & set(keys):
        raise RuntimeError(f"failing {sorted(failing & set(keys))} on purpose")
    if os.environ.get(BLOCK_ENV) in keys:
        Path(os.environ[READY_ENV]).write_text(str(os.getpid()))
        release = os.environ.get(RELEASE_ENV)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (release and os.path.exists(release)):
            time.sleep(0.05)


def enqueue_day(run: LeasedRun) -> str:
    key = run.partition_key or "initial"
    _steer([key])
    with run.transaction() as conn:
        run.enqueue_once(conn, topic=TOPIC, payload={"day": key, "code": run.lease.identity.code})
    return key


range_asset = leased_asset(
    code="t-range", name="range_asset", partitions_def=days, backfill_policy=SINGLE_RUN
)(enqueue_day)


def enqueue_days(run: LeasedBatch) -> int:
    """Batch mode: every key this call won, in one fenced transaction with one multi-row outbox INSERT."""
    keys = [k or "initial" for k in run.partition_keys]
    _steer(keys)
    with run.transaction() as conn:
        run.enqueue_many(
            conn, topic=TOPIC, payloads={k: {"day": k, "code": "t-batch"} for k in run.partition_keys}
        )
    return len(keys)


batch_asset = leased_asset(
    code="t-batch", name="batch_asset", partitions_def=days, backfill_policy=SINGLE_RUN, batch=True
)(enqueue_days)


# Seen case 1 of the range issue: a leased asset and a leased, eager downstream, both single-run. Static
# keys (named like days): AutomationCondition.eager() looks only at a time partitioning's latest window, and
# every key of a static one is in view.
january = dg.StaticPartitionsDefinition([f"2024-01-{d:02d}" for d in range(1, 32)])
up = leased_asset(code="t-up", name="up", partitions_def=january, backfill_policy=SINGLE_RUN)(enqueue_day)
down = leased_asset(
    code="t-down",
    name="down",
    partitions_def=january,
    backfill_policy=SINGLE_RUN,
    deps=[up],
    automation_condition=dg.AutomationCondition.eager(),
)(enqueue_day)

# Partition-key validation: one op job per kind of partitions definition.
static_parts = dg.StaticPartitionsDefinition(["eu", "us"])
tenants = dg.DynamicPartitionsDefinition(name="t_tenants")
validated_op = leased_op(code="t-valid", name="validated_op")(enqueue_day)


@dg.job(partitions_def=days)
def daily_job() -> None:
    validated_op()


@dg.job(partitions_def=static_parts)
def static_job() -> None:
    validated_op()


@dg.job(partitions_def=tenants)
def dynamic_job() -> None:
    validated_op()


held_op = leased_op(code="t-agg-a", name="held_op", held_wait_ms=0)(enqueue_day)
won_op = leased_op(code="t-agg-b", name="won_op")(enqueue_day)


@dg.job(
    partitions_def=days,
    executor_def=dg.multiprocess_executor,
    resource_defs={"joblease": JobLeaseResource()},  # $JOBLEASE_DATABASE_URL, in every step process
)
def two_parallel_ops_job() -> None:
    """Two leased ops with no dependency between them: separate step processes, at the same time."""
    held_op()
    won_op()


defs = dg.Definitions(
    assets=[range_asset, batch_asset, up, down],
    jobs=[daily_job, static_job, dynamic_job, two_parallel_ops_job],
    resources={"joblease": JobLeaseResource()},
)
