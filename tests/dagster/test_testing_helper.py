"""run_partition_twice: two concurrent in-process runs of one partition, on both backends."""

from __future__ import annotations

import threading

import dagster as dg
import pytest

from dagster_joblease import create_engine, errors
from dagster_joblease.admin import list_outbox
from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_op, metadata
from dagster_joblease.dagster.testing import first_cause, run_partition_twice

days = dg.DailyPartitionsDefinition(start_date="2024-01-01")


@leased_op(code="kit-twice")
def enqueue_day(run: LeasedRun) -> None:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="kit", payload={"day": run.partition_key})


@leased_op(code="kit-broken")
def broken_day(run: LeasedRun) -> None:
    raise RuntimeError("the body broke")


@dg.job(partitions_def=days)
def twice_job() -> None:
    enqueue_day()


@dg.job(partitions_def=days)
def broken_job() -> None:
    broken_day()


def test_each_partition_has_one_winner_and_one_recorded_skip(db_url: str) -> None:
    resources = {"joblease": JobLeaseResource(database_url=db_url)}
    partitions = ["2024-01-01", "2024-01-02", "2024-01-03", "2024-01-04"]
    for partition in partitions:
        runs = run_partition_twice(twice_job, partition, resources=resources)
        assert [run.launched_as for run in runs] == ["backfill", "schedule"]
        assert all(run.success and run.error is None for run in runs)
        (winner,) = [run for run in runs if run.won]
        (loser,) = [run for run in runs if not run.won]
        assert winner.outcome == metadata.WON
        assert winner.record[metadata.META_OUTBOX] == metadata.OUTBOX_INSERTED
        assert loser.outcome is not None
        assert loser.record[metadata.META_OUTBOX] == metadata.OUTBOX_NOT_ENQUEUED
        assert loser.tags[metadata.TAG_WINNER] == winner.run_id
        assert winner.run_id != loser.run_id
    engine = create_engine(db_url)
    try:
        assert len(list_outbox(engine)) == len(partitions)
    finally:
        engine.dispose()


def test_failed_runs_are_reported_with_their_error(db_url: str) -> None:
    resources = {"joblease": JobLeaseResource(database_url=db_url)}
    runs = run_partition_twice(broken_job, "2024-01-01", resources=resources)
    ran = [run for run in runs if run.outcome == metadata.FAILED or run.won]
    assert ran, "at least one run took the lease and ran the body"
    for run in runs:
        if not run.success:
            assert run.error is not None and "the body broke" in run.error
            assert run.outcome == metadata.FAILED and "the body broke" in str(run.record[metadata.META_ERROR])
    assert not all(run.success for run in runs)


def test_bad_arguments_are_refused_before_any_run() -> None:
    with pytest.raises(errors.ConfigurationError, match="JobDefinition"):
        run_partition_twice(enqueue_day, "2024-01-01")  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigurationError, match="non-blank"):
        run_partition_twice(twice_job, " ")


BROKEN_A, BROKEN_B = threading.BrokenBarrierError(), threading.BrokenBarrierError()
CONFIG, OTHER = ValueError("bad config"), KeyError("x")


@pytest.mark.parametrize(
    ("raised", "cause"),
    [
        ([], None),
        ([CONFIG], CONFIG),
        ([BROKEN_A, CONFIG], CONFIG),  # the launch whose failure broke the barrier for the other
        ([CONFIG, BROKEN_A], CONFIG),
        ([OTHER, CONFIG], OTHER),  # the first real error
        ([BROKEN_A, BROKEN_B], BROKEN_A),  # only broken barriers: the first (a barrier timeout)
    ],
)
def test_first_cause_is_the_error_that_broke_the_barrier(
    raised: list[BaseException], cause: BaseException | None
) -> None:
    assert first_cause(raised) is cause
