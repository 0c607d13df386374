"""Module-level jobs and definitions for the Dagster tests (``reconstructable`` and subprocesses need them).

Every job reads the joblease URL from ``$JOBLEASE_DATABASE_URL`` (the resource's fallback), so a
subprocess or a re-executed run in another process finds the same database.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import sqlalchemy as sa

from dagster_joblease.dagster import (
    JobLeaseResource,
    LeasedRun,
    build_dead_rows_check,
    build_dispatcher_job,
    build_outbox_sensor,
    leased_asset,
    leased_op,
    outbox_asset_spec,
)
from dagster_joblease.dispatch import Route

TOPIC = "test.billing"
FAIL_ONCE_ENV = "JOBLEASE_TEST_FAIL_ONCE"  # a file path: while it exists, the body deletes it and fails
RECEIVER_ENV = "JOBLEASE_TEST_RECEIVER_URL"

days = dg.DailyPartitionsDefinition(start_date="2024-01-01")
domain = sa.MetaData()
domain_table = sa.Table(
    "test_domain_row",
    domain,
    sa.Column("code", sa.String(64), primary_key=True),
    sa.Column("partition_key", sa.String(32), primary_key=True),
    sa.Column("attempt", sa.Integer, nullable=False),
)


def write_domain_and_outbox(run: LeasedRun) -> str:
    """The body every test job runs: a domain row and an outbox row, in one fenced transaction."""
    marker = os.environ.get(FAIL_ONCE_ENV)
    if marker and Path(marker).exists():
        Path(marker).unlink()
        raise RuntimeError("failing once on purpose")
    key = run.partition_key or "initial"
    with run.transaction() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(4242)"))
        domain.create_all(conn, checkfirst=True)
        conn.execute(
            domain_table.insert().values(
                code=run.lease.identity.code, partition_key=key, attempt=run.lease.attempt
            )
        )
        run.enqueue_once(conn, topic=TOPIC, payload={"partition": key, "code": run.lease.identity.code})
    return key


def _job(code: str, name: str) -> dg.JobDefinition:
    op = leased_op(code=code, name=f"{name}_op")(write_domain_and_outbox)

    @dg.job(
        name=name,
        partitions_def=days,
        executor_def=dg.in_process_executor,
        resource_defs={"joblease": JobLeaseResource(heartbeat_ms=200, lease_ms=2_000)},
    )
    def _the_job() -> None:
        op()

    return _the_job


def backfill_job() -> dg.JobDefinition:
    return _job("t-backfill", "backfill_job")


def retry_job() -> dg.JobDefinition:
    return _job("t-retry", "retry_job")


@leased_asset(code="t-asset", partitions_def=days, backfill_policy=dg.BackfillPolicy.single_run())
def leased_daily_asset(run: LeasedRun) -> str:
    return write_domain_and_outbox(run)


def routes() -> dict[str, Route]:
    return {TOPIC: Route(os.environ.get(RECEIVER_ENV, "http://127.0.0.1:9/unset") + "/" + TOPIC)}


dispatch_job = build_dispatcher_job(routes, name="test_dispatch_job")
dispatch_sensor = build_outbox_sensor(dispatch_job, name="test_dispatch_sensor")
dead_rows_check = build_dead_rows_check()

defs = dg.Definitions(
    assets=[outbox_asset_spec, leased_daily_asset],
    asset_checks=[dead_rows_check],
    jobs=[backfill_job(), retry_job(), dispatch_job],
    sensors=[dispatch_sensor],
    resources={"joblease": JobLeaseResource()},
)
