"""A partition key outside the job's or asset's partitions definition is refused before any lease.

``dagster job execute --tags '{"dagster/partition": "2024-13-01"}'`` (or any launch that sets the tag by
hand) reaches the step unchecked by Dagster; the leased step fails with a ``dagster.Failure`` naming the
key and the partitions definition, and nothing is leased or enqueued. Dynamic partitions are checked
against the instance's keys.
"""

from __future__ import annotations

from collections.abc import Iterator

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, create_engine
from dagster_joblease.dagster import JobLeaseResource
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.dagster import range_assets
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
RESOURCES = {"joblease": JobLeaseResource()}


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    engine = create_engine(dagster_pg.joblease_url)
    yield engine
    engine.dispose()


def _rows(engine: sa.Engine, key: str) -> tuple[int, int]:
    lock_key = JobIdentity.schedule("t-valid", key).idempotency_key
    with engine.connect() as conn:
        leases = conn.execute(
            sa.select(sa.func.count()).select_from(lease_table).where(lease_table.c.lock_key == lock_key)
        ).scalar_one()
        effects = conn.execute(
            sa.select(sa.func.count())
            .select_from(outbox_table)
            .where(outbox_table.c.idempotency_key == lock_key)
        ).scalar_one()
    return int(leases), int(effects)


def _run(dagster_pg: DagsterPg, job: dg.JobDefinition, key: str) -> dg.ExecuteInProcessResult:
    # As `dagster job execute --tags` would: the partition comes as a tag, not from the definition.
    return job.execute_in_process(
        instance=dagster_pg.instance,
        resources=RESOURCES,
        run_config=QUIET,
        tags={"dagster/partition": key},
        raise_on_error=False,
    )


def _failure(result: dg.ExecuteInProcessResult) -> tuple[str, bool]:
    (event,) = [e for e in result.all_events if e.is_step_failure]
    data = event.step_failure_data
    assert data.error is not None and data.user_failure_data is not None
    return data.error.message, data.error.cls_name == "Failure"


@pytest.mark.parametrize(
    ("job", "key", "named"),
    [
        (range_assets.daily_job, "2024-13-01", "DailyPartitionsDefinition (Daily, starting 2024-01-01 UTC)"),
        (range_assets.daily_job, "2099-01-01", "DailyPartitionsDefinition (Daily, starting 2024-01-01 UTC)"),
        (range_assets.static_job, "mars", "StaticPartitionsDefinition ("),
        (
            range_assets.dynamic_job,
            "acme-unknown",
            'DynamicPartitionsDefinition (Dynamic partitions: "t_tenants")',
        ),
    ],
    ids=["time-window-malformed", "time-window-future", "static", "dynamic"],
)
def test_a_key_outside_the_partitions_definition_is_refused_before_any_lease(
    dagster_pg: DagsterPg, engine: sa.Engine, job: dg.JobDefinition, key: str, named: str
) -> None:
    result = _run(dagster_pg, job, key)
    assert not result.success
    message, is_failure = _failure(result)
    assert is_failure
    assert f"partition key {key!r} of lease code 't-valid' is not a partition of {named}" in message
    assert "nothing was leased or enqueued" in message
    assert _rows(engine, key) == (0, 0)


def test_dynamic_keys_are_checked_against_the_instance(dagster_pg: DagsterPg, engine: sa.Engine) -> None:
    dagster_pg.instance.add_dynamic_partitions("t_tenants", ["acme"])
    result = _run(dagster_pg, range_assets.dynamic_job, "acme")
    assert result.success
    assert _rows(engine, "acme") == (1, 1)
    refused = _run(dagster_pg, range_assets.dynamic_job, "globex")
    message, _ = _failure(refused)
    assert "add it to this instance first" in message
    assert _rows(engine, "globex") == (0, 0)


def test_keys_of_the_definition_are_leased_as_before(dagster_pg: DagsterPg, engine: sa.Engine) -> None:
    assert _run(dagster_pg, range_assets.static_job, "eu").success
    assert _run(dagster_pg, range_assets.daily_job, "2024-05-05").success
    assert _rows(engine, "eu") == (1, 1) and _rows(engine, "2024-05-05") == (1, 1)
