"""A key whose lease is taken after its body committed the outbox row says the row was enqueued (#35 item
10): the run is ``lost`` (it could not complete the lease), but its fenced transaction committed, so the
outbox row exists and will be delivered; ``not-enqueued`` said the opposite. A transaction that rolled
back reports nothing enqueued, though ``enqueue_once`` ran inside it (it said ``inserted``).

Real runs on a PostgreSQL-backed instance; "another worker takes the lease" is a fail of it from another
service, as in ``tests/dagster/jobs.lost_op``.
"""

from __future__ import annotations

import dagster as dg
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService
from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_op
from dagster_joblease.dagster.metadata import META_OUTBOX, META_OUTCOME
from dagster_joblease.dagster.ops import step_records
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import outbox_table
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


@leased_op(code="t-lost-after", name="lost_after_commit_op")
def lost_after_commit_op(run: LeasedRun) -> None:
    """Commits the domain row and the outbox row, then another worker takes the lease."""
    jobs.write_domain_and_outbox(run)
    LeaseService(run.resource.engine).fail(run.lease, "taken by another worker after the commit")


@leased_op(code="t-rolled-back", name="rolled_back_op")
def rolled_back_op(run: LeasedRun) -> None:
    """Enqueues inside its transaction, then raises in it: nothing of the transaction is written."""
    with run.transaction() as conn:
        run.enqueue_once(conn, topic=jobs.TOPIC, payload={"partition": run.partition_key})
        raise RuntimeError("failing inside the transaction on purpose")


def _job(op: dg.OpDefinition) -> dg.JobDefinition:
    @dg.job(name=f"{op.name}_job", partitions_def=jobs.days, resource_defs={"joblease": JobLeaseResource()})
    def _the_job() -> None:
        op()

    return _the_job


def _outbox_rows(url: str, key: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).where(outbox_table.c.idempotency_key == key)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def _run(dagster_pg: DagsterPg, op: dg.OpDefinition, day: str) -> dict[str, object]:
    result = _job(op).execute_in_process(
        partition_key=day, instance=dagster_pg.instance, run_config=QUIET, raise_on_error=False
    )
    assert not result.success
    (record,) = step_records(dagster_pg.instance, result.run_id).values()
    return record


def test_a_key_lost_after_its_commit_says_its_outbox_row_was_inserted(dagster_pg: DagsterPg) -> None:
    day = "2024-08-01"
    record = _run(dagster_pg, lost_after_commit_op, day)
    assert (record[META_OUTCOME], record[META_OUTBOX]) == ("lost", "inserted")
    key = JobIdentity.schedule("t-lost-after", day).idempotency_key
    assert _outbox_rows(dagster_pg.joblease_url, key) == 1  # committed: it will be delivered


def test_a_rolled_back_transaction_says_nothing_was_enqueued(dagster_pg: DagsterPg) -> None:
    day = "2024-08-02"
    record = _run(dagster_pg, rolled_back_op, day)
    assert (record[META_OUTCOME], record[META_OUTBOX]) == ("failed", "not-enqueued")
    key = JobIdentity.schedule("t-rolled-back", day).idempotency_key
    assert _outbox_rows(dagster_pg.joblease_url, key) == 0
