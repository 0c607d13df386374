"""KeyContext: the partition answers of one key of a range, everything else the step's own context."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pytest

from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_asset
from dagster_joblease.dagster.key_context import KeyContext, key_time_window

daily = dg.DailyPartitionsDefinition(start_date="2024-01-01")
hourly = dg.HourlyPartitionsDefinition(start_date="2024-01-01-00:00")
static = dg.StaticPartitionsDefinition(["eu", "us"])
multi = dg.MultiPartitionsDefinition({"date": daily, "region": static})
multi_static = dg.MultiPartitionsDefinition({"a": static, "b": dg.StaticPartitionsDefinition(["x"])})


@pytest.mark.parametrize(
    ("partitions_def", "key", "window"),
    [
        (daily, "2024-03-02", (datetime(2024, 3, 2, tzinfo=UTC), datetime(2024, 3, 3, tzinfo=UTC))),
        (
            hourly,
            "2024-03-02-05:00",
            (datetime(2024, 3, 2, 5, tzinfo=UTC), datetime(2024, 3, 2, 6, tzinfo=UTC)),
        ),
        (multi, "2024-03-02|eu", (datetime(2024, 3, 2, tzinfo=UTC), datetime(2024, 3, 3, tzinfo=UTC))),
        (static, "eu", None),
        (multi_static, "eu|x", None),
        (None, "eu", None),
    ],
)
def test_key_time_window(partitions_def: dg.PartitionsDefinition | None, key: str, window: object) -> None:
    found = key_time_window(partitions_def, key)
    assert (None if found is None else (found.start, found.end)) == window


def test_a_key_context_answers_for_its_key_and_delegates_the_rest() -> None:
    base = dg.build_op_context()
    view = KeyContext(base, "2024-03-02", daily)
    assert (view.partition_key, list(view.partition_keys)) == ("2024-03-02", ["2024-03-02"])
    assert view.partition_key_range == dg.PartitionKeyRange("2024-03-02", "2024-03-02")
    assert (view.has_partition_key, view.has_partition_key_range) == (True, False)
    assert view.asset_partition_key_for_output() == "2024-03-02"
    assert view.asset_partitions_time_window_for_output().start == datetime(2024, 3, 2, tzinfo=UTC)
    assert view.op_execution_context is view
    assert view.run_id == base.run_id and view.log is base.log  # the step's own


def test_a_multi_partition_key_is_a_multi_partition_key() -> None:
    view = KeyContext(dg.build_op_context(), "2024-03-02|eu", multi)
    assert view.multi_partition_key.keys_by_dimension == {"date": "2024-03-02", "region": "eu"}


def test_a_partitioning_without_time_gets_dagsters_own_error() -> None:
    # (a run's context raises DagsterInvariantViolationError; an uninvoked test context, its own kind)
    view = KeyContext(dg.build_op_context(partition_key="eu"), "eu", static)
    with pytest.raises(dg.DagsterError):
        _ = view.partition_time_window


def test_an_upstream_question_without_a_per_key_answer_says_so() -> None:
    view = KeyContext(dg.build_op_context(), "2024-03-02", daily)  # an op: no asset, no upstream asset
    for ask in (
        view.asset_partition_keys_for_input,
        view.asset_partition_key_for_input,
        view.asset_partition_key_range_for_input,
        view.asset_partitions_time_window_for_input,
    ):
        with pytest.raises(dg.DagsterInvariantViolationError, match=r"input 'up' has no per-key answer"):
            ask("up")


def test_a_key_context_can_be_copied() -> None:
    view = KeyContext(dg.build_op_context(), "2024-03-02", daily)
    assert copy.copy(view).partition_key == "2024-03-02"


# ---- Upstream questions in a real range run (#35 item 8) --------------------------------------------------

days = dg.DailyPartitionsDefinition(start_date="2024-01-01")
#: What each key's body was told, by key.
SEEN: dict[str, dict[str, object]] = {}


@dg.asset(partitions_def=days)
def up_daily() -> None:
    """A plain daily upstream."""


@leased_asset(
    code="t-key-upstream",
    partitions_def=days,
    backfill_policy=dg.BackfillPolicy.single_run(),
    deps=[dg.AssetDep(up_daily, partition_mapping=dg.TimeWindowPartitionMapping(start_offset=-1))],
)
def reads_yesterday_and_today(run: LeasedRun) -> None:
    """Reads its day and the day before of ``up_daily``; records what its context told it."""
    context = run.context
    window = context.asset_partitions_time_window_for_input("up_daily")
    SEEN[str(run.partition_key)] = {
        "keys": list(context.asset_partition_keys_for_input("up_daily")),
        "range": context.asset_partition_key_range_for_input("up_daily"),
        "window": (window.start.date().isoformat(), window.end.date().isoformat()),
    }
    with pytest.raises(dg.DagsterInvariantViolationError, match=r"no per-key answer.*2 upstream partitions"):
        context.asset_partition_key_for_input("up_daily")  # two days: no single key


def test_a_per_key_body_gets_its_own_keys_upstream_answers(tmp_path: Path) -> None:
    SEEN.clear()
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [up_daily, reads_yesterday_and_today],
            selection=[reads_yesterday_and_today],
            instance=instance,
            resources={"joblease": JobLeaseResource(database_url=f"sqlite:///{tmp_path / 'l.db'}")},
            tags={
                "dagster/asset_partition_range_start": "2024-03-02",
                "dagster/asset_partition_range_end": "2024-03-05",
            },
        )
    assert result.success
    assert SEEN["2024-03-04"] == {
        "keys": ["2024-03-03", "2024-03-04"],
        "range": dg.PartitionKeyRange("2024-03-03", "2024-03-04"),
        "window": ("2024-03-03", "2024-03-05"),
    }
    assert sorted(SEEN) == ["2024-03-02", "2024-03-03", "2024-03-04", "2024-03-05"]
    assert SEEN["2024-03-02"]["keys"] == ["2024-03-01", "2024-03-02"]
