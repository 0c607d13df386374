"""How a skip is recorded (issue 35 items 9, 11, 12): with Dagster's own backfill daemon, its partition page's
rule and its eager automation condition.

- A backfill whose runs find their keys done by another backfill's runs completes as succeeded: the asset
  backfill daemon (``dagster._daemon.backfill.execute_backfill_iteration``, the loop ``dagster-daemon``
  runs) counts a partition as done only by a materialization recorded by one of its own runs, so a skip in
  an asset backfill's run is materialized (its first entry says ``skipped: done by run X``).
- Outside an asset backfill, a skip of a partition already materialized here is an observation only, with
  labels of its own: the partition page (the latest materialization's entries, overridden by newer
  observations' entries of the same label) still reads the win.
- A run-once (``INITIAL``) asset's skips add no materialization, so an eager asset downstream is not
  requested again.

Real runs: the backfill daemon's iterations launch them (in process, ``SyncInMemoryRunLauncher``) from the
location ``tests/dagster/skip_location.py`` loaded as a code location; the lease database is PostgreSQL.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._daemon.backfill import execute_backfill_iteration
from dagster._time import get_current_timestamp

from dagster_joblease import JobIdentity
from dagster_joblease.dagster import JobLeaseResource, metadata
from dagster_joblease.dagster.metadata import META_OUTCOME, META_SKIPPED, META_WINNER, TAG_OUTCOME, TAG_WINNER
from dagster_joblease.dagster.ops import AssetRecording, asset_recording
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.dagster import skip_location as loc
from tests.dagster.conftest import DagsterPg
from tests.dagster.deployments import deployment

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
MODULE = "tests.dagster.skip_location"
#: A backfill of a few partitions settles in a handful of daemon iterations; 1.12 never settles one whose
#: successful runs materialized nothing (it waits for a materialization forever), so the loop is bounded.
ITERATIONS = 12
LOG = logging.getLogger("test_skip_recording")
SYNC_LAUNCHER = {
    "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "DefaultRunCoordinator"},
    "run_launcher": {
        "module": "dagster._core.launcher.sync_in_memory_run_launcher",
        "class": "SyncInMemoryRunLauncher",
    },
}


def _deployment() -> contextlib.AbstractContextManager[tuple[dg.DagsterInstance, WorkspaceProcessContext]]:
    """A temporary instance whose runs execute in process, with ``skip_location`` loaded as a location."""
    return deployment(MODULE, SYNC_LAUNCHER)


def _backfill(
    instance: dg.DagsterInstance, workspace: WorkspaceProcessContext, asset: dg.AssetKey, keys: Sequence[str]
) -> PartitionBackfill:
    """An asset backfill of ``keys`` (as the UI launches one), run to its end by the daemon's iterations."""
    backfill = PartitionBackfill.from_asset_partitions(
        backfill_id=f"bf{len(instance.get_backfills())}",
        asset_graph=workspace.create_request_context().asset_graph,
        partition_names=list(keys),
        asset_selection=[asset],
        backfill_timestamp=get_current_timestamp(),
        tags={},
        dynamic_partitions_store=instance,
        all_partitions=False,
        title=None,
        description=None,
        run_config=None,
    )
    instance.add_backfill(backfill)
    current = backfill
    for _ in range(ITERATIONS):
        list(execute_backfill_iteration(workspace, LOG))
        found = instance.get_backfill(backfill.backfill_id)
        assert found is not None
        current = found
        if current.status != BulkActionStatus.REQUESTED:
            break
    return current


def _runs(instance: dg.DagsterInstance, backfill_id: str) -> list[dg.DagsterRun]:
    return list(instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id})))


def _effects(url: str, code: str) -> dict[str, tuple[str, int]]:
    """Each key of ``code``: its lease (status, attempt); and that it has exactly one outbox row."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            leases = conn.execute(
                sa.select(lease_table.c.run_key, lease_table.c.status, lease_table.c.attempt).where(
                    lease_table.c.code == code
                )
            ).all()
            keys = {JobIdentity.schedule(code, key).idempotency_key for key, _, _ in leases}
            rows = conn.execute(
                sa.select(outbox_table.c.idempotency_key).where(outbox_table.c.idempotency_key.in_(keys))
            ).all()
    finally:
        engine.dispose()
    assert sorted(r.idempotency_key for r in rows) == sorted(keys), f"not one outbox row per key of {code}"
    return {key: (status, attempt) for key, status, attempt in leases}


def _partition_page(instance: dg.DagsterInstance, asset: dg.AssetKey, key: str | None) -> dict[str, object]:
    """What Dagster's partition page shows under *Metadata*: the latest materialization's entries, each
    overridden by an entry of the same label in an observation recorded after it (the UI's
    ``AssetPartitionDetail`` and ``AssetEventMetadataEntriesTable``: newer observations first, one row per
    label); plus ``run``, the latest materialization's run (its *Run* column)."""
    partitions = None if key is None else [key]
    materialized = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset, asset_partitions=partitions), limit=1
    ).records
    assert materialized, f"{asset.to_user_string()} {key} has no materialization"
    latest = materialized[0]
    observed = instance.fetch_observations(
        dg.AssetRecordsFilter(
            asset_key=asset, asset_partitions=partitions, after_storage_id=latest.storage_id
        ),
        limit=100,
    ).records
    page: dict[str, object] = {}
    for record in [*observed, latest]:  # newest first; the first of a label stands
        event = record.asset_observation or record.asset_materialization
        assert event is not None
        for label, value in event.metadata.items():
            page.setdefault(label, value)
    page["run"] = latest.run_id
    return page


def _first_entry(instance: dg.DagsterInstance, asset: dg.AssetKey, key: str | None) -> tuple[str, object]:
    (record,) = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset, asset_partitions=None if key is None else [key]), limit=1
    ).records
    assert record.asset_materialization is not None
    return next(iter(record.asset_materialization.metadata.items()))


def test_an_asset_backfill_whose_runs_skip_done_keys_completes_succeeded(dagster_pg: DagsterPg) -> None:
    keys = ["2024-05-01", "2024-05-02"]
    with _deployment() as (instance, workspace):
        first = _backfill(instance, workspace, loc.bf_daily.key, keys)
        again = _backfill(instance, workspace, loc.bf_daily.key, keys)  # the same backfill, launched twice
        assert (first.status, again.status) == (
            BulkActionStatus.COMPLETED_SUCCESS,
            BulkActionStatus.COMPLETED_SUCCESS,
        )
        winners = {r.tags["dagster/partition"]: r.run_id for r in _runs(instance, first.backfill_id)}
        skips = _runs(instance, again.backfill_id)
        assert sorted(r.tags["dagster/partition"] for r in skips) == keys
        for run in skips:
            assert run.status == dg.DagsterRunStatus.SUCCESS
            winner = winners[run.tags["dagster/partition"]]
            assert (run.tags[TAG_OUTCOME], run.tags[TAG_WINNER]) == ("skipped-succeeded", winner)
        for key in keys:
            # The backfill's materialization of a skipped key says so first, the winner a run link.
            label, value = _first_entry(instance, loc.bf_daily.key, key)
            assert label == META_SKIPPED
            assert str(getattr(value, "value", value)).startswith(f"skipped: done by run {winners[key]};")
            page = _partition_page(instance, loc.bf_daily.key, key)
            assert page[META_WINNER] == dg.MetadataValue.dagster_run(winners[key])
    assert _effects(dagster_pg.joblease_url, "t-skip-bf") == {k: ("SUCCESS", 1) for k in keys}


def test_a_single_run_backfill_over_done_keys_completes_succeeded(dagster_pg: DagsterPg) -> None:
    keys = ["2024-05-11", "2024-05-12", "2024-05-13"]
    with _deployment() as (instance, workspace):
        first = _backfill(instance, workspace, loc.bf_range.key, keys)
        again = _backfill(instance, workspace, loc.bf_range.key, keys)
        overlapping = _backfill(instance, workspace, loc.bf_range.key, [*keys[1:], "2024-05-14"])
        assert [b.status for b in (first, again, overlapping)] == [BulkActionStatus.COMPLETED_SUCCESS] * 3
        (skip,) = _runs(instance, again.backfill_id)
        assert skip.tags[TAG_OUTCOME] == "skipped-succeeded"
    assert _effects(dagster_pg.joblease_url, "t-skip-range") == {
        k: ("SUCCESS", 1) for k in [*keys, "2024-05-14"]
    }


def _materialize(instance: dg.DagsterInstance, assets: Sequence[dg.AssetsDefinition], **kw: str) -> str:
    result = dg.materialize(
        assets, instance=instance, resources={"joblease": JobLeaseResource()}, run_config=QUIET, **kw
    )
    assert result.success
    return result.run_id


def test_a_skip_outside_a_backfill_leaves_the_partition_page_reading_the_win(dagster_pg: DagsterPg) -> None:
    day = "2024-05-21"
    with dg.instance_for_test() as instance:
        winner = _materialize(instance, [loc.bf_daily], partition_key=day)
        skip = _materialize(instance, [loc.bf_daily], partition_key=day)  # a re-execution, a manual launch
        page = _partition_page(instance, loc.bf_daily.key, day)
        assert (page["run"], page[META_OUTCOME]) == (winner, dg.MetadataValue.text("won"))
        assert page[META_WINNER] == dg.MetadataValue.dagster_run(winner)
        # The skip is on the page too, under its own label, naming the winner.
        skipped = page[META_SKIPPED]
        assert isinstance(skipped, dg.TextMetadataValue)
        assert (skipped.value or "").startswith(f"skipped: done by run {winner};")
        assert instance.get_run_by_id(skip) is not None


def _requested(instance: dg.DagsterInstance, cursor: object) -> tuple[set[dg.AssetKey], object]:
    """One evaluation of the location's automation conditions (Dagster's own evaluator): what it requests."""
    result = dg.evaluate_automation_conditions(
        defs=loc.defs,
        instance=instance,
        cursor=cursor,  # type: ignore[arg-type]
    )
    keys = {key for key in (loc.once.key, loc.after_once.key) if result.get_requested_partitions(key)}
    return keys, result.cursor


def test_an_initial_assets_skips_add_no_materialization_nor_an_eager_request(dagster_pg: DagsterPg) -> None:
    with dg.instance_for_test() as instance:
        requested, cursor = _requested(instance, None)
        assert requested == set()
        winner = _materialize(instance, [loc.once])
        requested, cursor = _requested(instance, cursor)
        assert requested == {loc.after_once.key}  # eager: the upstream was updated
        _materialize(instance, [loc.after_once])
        requested, cursor = _requested(instance, cursor)
        assert requested == set()
        skips = [_materialize(instance, [loc.once]) for _ in range(2)]
        records = instance.fetch_materializations(loc.once.key, limit=10).records
        assert [r.run_id for r in records] == [winner]  # 1 win + 2 skips: 1 materialization
        requested, cursor = _requested(instance, cursor)
        assert requested == set()  # nothing new upstream: the skips do not request after_once again
        page = _partition_page(instance, loc.once.key, None)
        assert (page["run"], page[META_OUTCOME]) == (winner, dg.MetadataValue.text("won"))
        for run_id in skips:
            run = instance.get_run_by_id(run_id)
            assert run is not None and run.tags[TAG_OUTCOME] == "skipped-succeeded"


def _key(outcome: str, key: str | None) -> metadata.LeasedResult:
    return metadata.LeasedResult(
        code="c", partition_key=key, idempotency_key=f"v2:{key}", outcome=outcome, attempt=1, outbox="-"
    )


WON_A, SKIP_B, SKIP_C, FAILED_D = (
    _key("won", "a"),
    _key("skipped-succeeded", "b"),
    _key("skipped-succeeded", "c"),
    _key("failed", "d"),
)
SKIP_INITIAL = _key("skipped-succeeded", None)


@pytest.mark.parametrize(
    ("results", "all_done", "here", "downstream", "backfill", "expected"),
    [
        # A win: the output (it materializes the key).
        ([WON_A], True, set(), False, False, AssetRecording(True, (), ())),
        # A skip of a key materialized here, nothing downstream, no asset backfill: observed only.
        ([SKIP_B], True, {"b"}, False, False, AssetRecording(False, (), ("b",))),
        ([SKIP_INITIAL], True, {None}, False, False, AssetRecording(False, (), (None,))),
        # ... materialized as well in an asset backfill's run, where the winner ran elsewhere, or for
        # a downstream step of the run.
        ([SKIP_B], True, {"b"}, False, True, AssetRecording(True, (), ("b",))),
        ([SKIP_INITIAL], True, set(), False, False, AssetRecording(True, (), (None,))),
        ([SKIP_B], True, {"b"}, True, False, AssetRecording(True, (), ("b",))),
        # A range: its output materializes every key.
        ([WON_A, SKIP_B], True, {"b"}, False, False, AssetRecording(True, (), ("b",))),
        ([SKIP_B, SKIP_C], True, {"b", "c"}, False, False, AssetRecording(False, (), ("b", "c"))),
        ([SKIP_B, SKIP_C], True, {"b"}, False, False, AssetRecording(True, (), ("b", "c"))),
        # A key not done: no output; what this run did, and the skips that need a materialization.
        ([WON_A, SKIP_B, FAILED_D], False, {"b"}, True, False, AssetRecording(False, ("a",), ("b",))),
        ([WON_A, SKIP_B, FAILED_D], False, {"b"}, False, True, AssetRecording(False, ("a", "b"), ("b",))),
        ([SKIP_C, FAILED_D], False, set(), False, False, AssetRecording(False, ("c",), ("c",))),
    ],
)
def test_asset_recording(
    results: list[metadata.LeasedResult],
    all_done: bool,
    here: set[str | None],
    downstream: bool,
    backfill: bool,
    expected: AssetRecording,
) -> None:
    found = asset_recording(
        results,
        all_done=all_done,
        materialized_here=here,
        downstream_in_run=downstream,
        asset_backfill=backfill,
    )
    assert found == expected
