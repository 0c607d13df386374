"""An asset partition is materialized only by a run whose partition succeeded, and exactly once per instance.

A skip adds no second materialization where the winner's is recorded (nothing downstream re-triggers); a
partition another deployment won shows as materialized here once, pointing at the winner, so Declarative
Automation does not request it again and again; a held partition materializes nothing.
"""

from __future__ import annotations

import uuid

import dagster as dg

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource
from dagster_joblease.dagster.holders import encode_holder
from dagster_joblease.dagster.metadata import (
    META_HELD_BY,
    META_HOLDER,
    META_OUTCOME,
    META_WINNER,
    TAG_OUTCOME,
    TAG_WINNER,
    TAG_WORK,
)
from dagster_joblease.dagster.ops import step_records
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
ASSET = jobs.leased_daily_asset.key


def _materializations(instance: dg.DagsterInstance, partition: str) -> list[dg.AssetMaterialization]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[partition]), limit=10
    ).records
    return [r.asset_materialization for r in records if r.asset_materialization is not None]


def _materialize(dagster_pg: DagsterPg, partition: str, **resource: int) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [jobs.leased_daily_asset],
        partition_key=partition,
        instance=dagster_pg.instance,
        resources={"joblease": JobLeaseResource(**resource)},
        run_config=QUIET,
        raise_on_error=False,
    )


def _tags(dagster_pg: DagsterPg, run_id: str) -> dict[str, str]:
    run = dagster_pg.instance.get_run_by_id(run_id)
    assert run is not None
    return dict(run.tags)


def test_a_partition_won_elsewhere_is_recorded_once_pointing_at_the_winner(dagster_pg: DagsterPg) -> None:
    day, other_run = "2024-03-01", str(uuid.uuid4())
    holder = encode_holder("other-deployment", other_run)
    engine = create_engine(dagster_pg.joblease_url)
    try:
        service = LeaseService(engine, holder=holder)
        won = service.acquire(JobIdentity.schedule("t-asset", day))
        assert won is not None
        service.complete(won)
    finally:
        engine.dispose()
    assert _materializations(dagster_pg.instance, day) == []

    first = _materialize(dagster_pg, day)
    second = _materialize(dagster_pg, day)
    assert first.success and second.success
    (recorded,) = _materializations(dagster_pg.instance, day)  # once, not once per skip
    assert recorded.metadata[META_OUTCOME] == dg.MetadataValue.text("skipped-succeeded")
    assert recorded.metadata[META_WINNER] == dg.MetadataValue.dagster_run(other_run)  # one click away
    assert recorded.metadata[META_HOLDER] == dg.MetadataValue.text(holder)
    assert day in dagster_pg.instance.get_materialized_partitions(ASSET)
    for run in (first, second):
        assert _tags(dagster_pg, run.run_id)[TAG_WINNER] == other_run


def test_a_skip_adds_no_second_materialization_to_the_winners(dagster_pg: DagsterPg) -> None:
    day = "2024-03-02"
    winner = _materialize(dagster_pg, day)
    skip = _materialize(dagster_pg, day)
    assert winner.success and skip.success
    (recorded,) = _materializations(dagster_pg.instance, day)
    assert recorded.metadata[META_OUTCOME] == dg.MetadataValue.text("won")
    assert skip.asset_materializations_for_node("leased_daily_asset") == []
    tags = _tags(dagster_pg, skip.run_id)
    assert (tags[TAG_OUTCOME], tags[TAG_WINNER], tags[TAG_WORK]) == (
        "skipped-succeeded",
        winner.run_id,
        "skipped-succeeded:1",
    )


def test_a_held_partition_fails_and_materializes_nothing(dagster_pg: DagsterPg) -> None:
    day = "2024-03-03"
    engine = create_engine(dagster_pg.joblease_url)
    try:
        held = LeaseService(engine, lease_ms=600_000, heartbeat_ms=0, holder="worker:7").acquire(
            JobIdentity.schedule("t-asset", day)
        )
        assert held is not None
        result = _materialize(dagster_pg, day, held_wait_ms=200)
    finally:
        engine.dispose()
    assert not result.success
    assert _materializations(dagster_pg.instance, day) == []
    assert day not in dagster_pg.instance.get_materialized_partitions(ASSET)
    tags = _tags(dagster_pg, result.run_id)
    assert (tags[TAG_OUTCOME], tags[TAG_WINNER], tags[TAG_WORK]) == ("held", "none", "held:1")
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert failure.step_failure_data.user_failure_data is not None
    assert failure.step_failure_data.user_failure_data.metadata[META_HOLDER] == dg.MetadataValue.text(
        "worker:7"
    )


def test_a_held_run_links_the_run_holding_its_partition(dagster_pg: DagsterPg) -> None:
    """The holder is one click away in the failure's metadata, as a skip's winner is (#40 item 6)."""
    day, holder_run = "2024-03-04", str(uuid.uuid4())
    engine = create_engine(dagster_pg.joblease_url)
    try:
        service = LeaseService(
            engine, lease_ms=600_000, heartbeat_ms=0, holder=encode_holder("other-deployment", holder_run)
        )
        assert service.acquire(JobIdentity.schedule("t-asset", day)) is not None
        result = _materialize(dagster_pg, day, held_wait_ms=200)
    finally:
        engine.dispose()
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert failure.step_failure_data.user_failure_data is not None
    held_by = failure.step_failure_data.user_failure_data.metadata[META_HELD_BY]
    assert held_by == dg.MetadataValue.dagster_run(holder_run)
    records = step_records(dagster_pg.instance, result.run_id)
    assert [r[META_HELD_BY] for r in records.values()] == [holder_run]


def test_a_range_run_records_the_keys_it_did_even_when_one_is_held(dagster_pg: DagsterPg) -> None:
    engine = create_engine(dagster_pg.joblease_url)
    try:
        held = LeaseService(engine, lease_ms=600_000, heartbeat_ms=0, holder="worker:8").acquire(
            JobIdentity.schedule("t-asset", "2024-03-11")
        )
        assert held is not None
        result = dg.materialize(
            [jobs.leased_daily_asset],
            instance=dagster_pg.instance,
            resources={"joblease": JobLeaseResource(held_wait_ms=200)},
            run_config=QUIET,
            raise_on_error=False,
            tags={
                "dagster/asset_partition_range_start": "2024-03-10",
                "dagster/asset_partition_range_end": "2024-03-12",
            },
        )
    finally:
        engine.dispose()
    assert not result.success
    assert [
        len(_materializations(dagster_pg.instance, d)) for d in ("2024-03-10", "2024-03-11", "2024-03-12")
    ] == [
        1,
        0,
        1,
    ]
    tags = _tags(dagster_pg, result.run_id)
    assert (tags[TAG_OUTCOME], tags[TAG_WORK]) == ("held", "held:1,won:2")
