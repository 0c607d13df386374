"""Module-level jobs and definitions for the Dagster tests (``reconstructable`` and subprocesses need them).

Every job reads the joblease URL from ``$JOBLEASE_DATABASE_URL`` (the resource's fallback), so a
subprocess or a re-executed run in another process finds the same database.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import dagster as dg
import sqlalchemy as sa

from dagster_joblease import LeaseService
from dagster_joblease.dagster import (
    JobLeaseResource,
    LeasedRun,
    build_dispatcher_job,
    build_outbox_sensor,
    leased_asset,
    leased_op,
)
from dagster_joblease.dagster.jobs import build_dead_rows_check, outbox_asset_spec
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


def _job(code: str, name: str, held_wait_ms: int | None = None) -> dg.JobDefinition:
    op = leased_op(code=code, name=f"{name}_op", held_wait_ms=held_wait_ms)(write_domain_and_outbox)

    @dg.job(
        name=name,
        partitions_def=days,
        executor_def=dg.in_process_executor,
        resource_defs={"joblease": JobLeaseResource(heartbeat_ms=200, lease_ms=2_000)},
    )
    def _the_job() -> None:
        op()

    return _the_job


#: Leases far longer than any test: a lease freed during a test was freed by its holder or a takeover.
#: A 1 s heartbeat (recorded on the rows it claims).
WAIT_RESOURCE = JobLeaseResource(heartbeat_ms=1_000, lease_ms=600_000, deployment="tests")


def waiting_job() -> dg.JobDefinition:
    """A run that waits up to 60 s for a live holder (long leases: only takeover or the holder frees it)."""
    op = leased_op(code="t-wait", name="waiting_job_op", held_wait_ms=60_000)(write_domain_and_outbox)

    @dg.job(
        name="waiting_job",
        partitions_def=days,
        executor_def=dg.in_process_executor,
        resource_defs={"joblease": WAIT_RESOURCE},
    )
    def _the_job() -> None:
        op()

    return _the_job


def impatient_job() -> dg.JobDefinition:
    """Gives up on a live holder after 0.3 s: the run fails as ``held``."""
    op = leased_op(code="t-wait", name="impatient_job_op", held_wait_ms=300)(write_domain_and_outbox)

    @dg.job(
        name="impatient_job",
        partitions_def=days,
        executor_def=dg.in_process_executor,
        # Its own 5 s heartbeat does not matter when it judges a holder: the holder's recorded one does.
        resource_defs={
            "joblease": JobLeaseResource(heartbeat_ms=5_000, lease_ms=600_000, deployment="tests")
        },
    )
    def _the_job() -> None:
        op()

    return _the_job


READY_ENV = "JOBLEASE_TEST_READY_FILE"  # the blocking op writes "<pid> <run id>" once it holds the lease


@leased_op(code="t-wait", name="blocking_op")
def blocking_op(run: LeasedRun) -> None:
    """Holds the lease (heartbeating) until its process is killed; a test reads the pid from the file."""
    Path(os.environ[READY_ENV]).write_text(f"{os.getpid()} {run.context.run_id}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


#: The blocking holder heartbeats every 5 s: judged by its own interval, a finished run's holder is dead
#: once its heartbeat is 10 s old, so a live but briefly starved holder on a loaded machine is not.
HOLDER_RESOURCE = JobLeaseResource(heartbeat_ms=5_000, lease_ms=600_000, deployment="tests")


def blocking_job() -> dg.JobDefinition:
    """The op runs in its own step process (multiprocess executor), as in a deployed run worker."""

    @dg.job(
        name="blocking_job",
        partitions_def=days,
        executor_def=dg.multiprocess_executor,
        resource_defs={"joblease": HOLDER_RESOURCE},
    )
    def _the_job() -> None:
        blocking_op()

    return _the_job


def backfill_job() -> dg.JobDefinition:
    return _job("t-backfill", "backfill_job")


def retry_job() -> dg.JobDefinition:
    return _job("t-retry", "retry_job")


@leased_asset(code="t-asset", partitions_def=days, backfill_policy=dg.BackfillPolicy.single_run())
def leased_daily_asset(run: LeasedRun) -> str:
    return write_domain_and_outbox(run)


def _seen_tags(run: LeasedRun) -> dict[str, str]:
    """The run's joblease tags as stored while the body runs (after the step's 'pending' overwrite)."""
    stored = run.context.instance.get_run_by_id(run.context.run_id)
    assert stored is not None
    return {k: v for k, v in stored.tags.items() if k.startswith("joblease/")}


@leased_op(code="t-tags", name="tag_probe_op")
def tag_probe_op(run: LeasedRun) -> dict[str, str]:
    seen = _seen_tags(run)
    write_domain_and_outbox(run)
    return seen


@leased_op(code="t-lost", name="lost_op")
def lost_op(run: LeasedRun) -> None:
    """Another worker reclaims the lease mid-body (simulated by failing it): the fenced commit refuses."""
    LeaseService(run.resource.engine).fail(run.lease, "reclaimed by another worker")
    write_domain_and_outbox(run)


first_leased = leased_op(code="t-two-a", name="first_leased")(write_domain_and_outbox)
second_leased = leased_op(code="t-two-b", name="second_leased")(write_domain_and_outbox)


def probe_jobs() -> list[dg.JobDefinition]:
    resources = {"joblease": JobLeaseResource(heartbeat_ms=200, lease_ms=2_000)}

    @dg.job(name="tag_probe_job", partitions_def=days, resource_defs=resources)
    def tag_probe_job() -> None:
        tag_probe_op()

    @dg.job(name="lost_job", partitions_def=days, resource_defs=resources)
    def lost_job() -> None:
        lost_op()

    @dg.job(name="two_leased_ops_job", partitions_def=days, resource_defs=resources)
    def two_leased_ops_job() -> None:
        first_leased()
        second_leased()

    return [tag_probe_job, lost_job, two_leased_ops_job]


def routes() -> dict[str, Route]:
    return {TOPIC: Route(os.environ.get(RECEIVER_ENV, "http://127.0.0.1:9/unset") + "/" + TOPIC)}


dispatch_job = build_dispatcher_job(routes, name="test_dispatch_job")
dispatch_sensor = build_outbox_sensor(dispatch_job, name="test_dispatch_sensor")
dead_rows_check = build_dead_rows_check()

defs = dg.Definitions(
    assets=[outbox_asset_spec, leased_daily_asset],
    asset_checks=[dead_rows_check],
    jobs=[backfill_job(), retry_job(), dispatch_job, *probe_jobs()],
    sensors=[dispatch_sensor],
    resources={"joblease": JobLeaseResource()},
)


NOT_RUN_FAIL_ENV = "JOBLEASE_TEST_NOT_RUN_FAIL"  # a file path: while it exists, plain_op fails


@dg.op(ins={"after": dg.In(dg.Nothing)})
def plain_op() -> None:
    """A step that is not leased; fails while the ``NOT_RUN_FAIL_ENV`` marker file exists."""
    marker = os.environ.get(NOT_RUN_FAIL_ENV)
    if marker and Path(marker).exists():
        raise RuntimeError("failing while the marker exists")


not_run_leased = leased_op(code="t-not-run", name="not_run_leased")(write_domain_and_outbox)
not_run_leased_after = leased_op(
    code="t-not-run-b", name="not_run_leased_after", ins={"after": dg.In(dg.Nothing)}
)(write_domain_and_outbox)


def not_run_after_job() -> dg.JobDefinition:
    """The leased step, then a plain step: a from-failure re-execution runs only the plain one."""

    @dg.job(name="not_run_after_job", partitions_def=days, resource_defs={"joblease": WAIT_RESOURCE})
    def _the_job() -> None:
        plain_op(after=not_run_leased())

    return _the_job


def not_run_before_job() -> dg.JobDefinition:
    """A plain step, then the leased step: when the plain one fails, the leased one never runs."""

    @dg.job(name="not_run_before_job", partitions_def=days, resource_defs={"joblease": WAIT_RESOURCE})
    def _the_job() -> None:
        not_run_leased_after(after=plain_op())

    return _the_job
