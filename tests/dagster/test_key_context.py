"""KeyContext: the partition answers of one key of a range, everything else the step's own context."""

from __future__ import annotations

import copy
from datetime import UTC, datetime

import dagster as dg
import pytest

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


def test_a_key_context_can_be_copied() -> None:
    view = KeyContext(dg.build_op_context(), "2024-03-02", daily)
    assert copy.copy(view).partition_key == "2024-03-02"
