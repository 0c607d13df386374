"""A skip is not a win, on the run page: where Dagster launches a run for a partition another run already
did (a backfill, a re-execution), the run says ``skipped: done by run X`` first.

Real runs on a PostgreSQL-backed instance. An op's skip: its log line and its step's ``joblease step
outcome`` engine event start with the skip and name the winner. An asset's skip is also an asset
*observation* (not a materialization) whose description and first metadata entry say it, the winner a run
link; a win records none.
"""

from __future__ import annotations

import dagster as dg
import pytest

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource, metadata
from dagster_joblease.dagster.holders import encode_holder
from dagster_joblease.dagster.metadata import (
    META_OUTCOME,
    META_SKIPPED,
    META_SKIPPED_DONE_BY,
    META_WINNER,
    STEP_EVENT_MESSAGE,
    TAG_OUTCOME,
    TAG_WINNER,
)
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
ASSET = jobs.leased_daily_asset.key


def _messages(dagster_pg: DagsterPg, run_id: str) -> list[str]:
    """The run's log, in order: each event's message (a user log line's text, a Dagster event's message)."""
    records = dagster_pg.instance.all_logs(run_id)
    return [(r.dagster_event.message if r.dagster_event else r.user_message) or "" for r in records]


def _observations(dagster_pg: DagsterPg, run_id: str) -> list[dg.AssetObservation]:
    records = dagster_pg.instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION
    ).records
    return [r.event_log_entry.asset_observation for r in records if r.event_log_entry.asset_observation]


def _asset_events(dagster_pg: DagsterPg, run_id: str) -> list[dg.DagsterEventType]:
    asset_types = {dg.DagsterEventType.ASSET_OBSERVATION, dg.DagsterEventType.ASSET_MATERIALIZATION}
    return [
        r.dagster_event.event_type
        for r in dagster_pg.instance.all_logs(run_id)
        if r.dagster_event is not None and r.dagster_event.event_type in asset_types
    ]


def _tags(dagster_pg: DagsterPg, run_id: str) -> dict[str, str]:
    run = dagster_pg.instance.get_run_by_id(run_id)
    assert run is not None
    return dict(run.tags)


def test_a_reexecuted_op_says_skipped_done_by_its_parent_before_anything_else(dagster_pg: DagsterPg) -> None:
    job, day = dg.reconstructable(jobs.backfill_job), "2024-10-01"
    with dg.execute_job(job, dagster_pg.instance, run_config=QUIET, tags={"dagster/partition": day}) as won:
        assert won.success
        parent = won.run_id
    options = dg.ReexecutionOptions(parent_run_id=parent)  # what the UI's "Re-execute all" launches
    tags = {"dagster/partition": day}
    with dg.execute_job(
        job, dagster_pg.instance, run_config=QUIET, tags=tags, reexecution_options=options
    ) as again:
        assert again.success  # the partition is done: green, but not a win
        child = again.run_id
    assert (_tags(dagster_pg, child)[TAG_OUTCOME], _tags(dagster_pg, child)[TAG_WINNER]) == (
        "skipped-succeeded",
        parent,
    )
    about_the_key = [m for m in _messages(dagster_pg, child) if f"t-backfill/{day}" in m]
    assert about_the_key and about_the_key[0].startswith(f"skipped: done by run {parent}; t-backfill@{day}")
    outcome = [m for m in _messages(dagster_pg, child) if m.startswith(STEP_EVENT_MESSAGE)]
    assert outcome[-1] == (
        f"{STEP_EVENT_MESSAGE}: skipped-succeeded:1 (skipped: done by run {parent}; t-backfill@{day} was "
        "already done (lease SUCCESS, attempt 1), not done again here)"
    )
    # The winner's own log says nothing of a skip.
    assert not [m for m in _messages(dagster_pg, parent) if "skipped" in m]


def test_an_asset_skip_is_observed_naming_the_winner_and_a_win_is_not(dagster_pg: DagsterPg) -> None:
    day = "2024-10-02"

    def materialize() -> dg.ExecuteInProcessResult:
        return dg.materialize(
            [jobs.leased_daily_asset],
            partition_key=day,
            instance=dagster_pg.instance,
            resources={"joblease": JobLeaseResource()},
            run_config=QUIET,
        )

    winner, skip = materialize(), materialize()  # the second: a manual launch of a done partition
    assert _observations(dagster_pg, winner.run_id) == []
    assert _asset_events(dagster_pg, winner.run_id) == [dg.DagsterEventType.ASSET_MATERIALIZATION]
    (observed,) = _observations(dagster_pg, skip.run_id)
    assert observed.partition == day
    assert observed.description is not None
    assert observed.description.startswith(f"skipped: done by run {winner.run_id}; t-asset@{day}")
    assert next(iter(observed.metadata)) == META_SKIPPED  # the first entry the log row shows
    assert observed.metadata[META_SKIPPED] == dg.MetadataValue.text(observed.description)
    # The winner under a label of its own: the partition page shows a newer observation's entry in place
    # of the materialization's of the same label, and there joblease/winner must stay the win's (#35 item 12).
    assert META_WINNER not in observed.metadata and META_OUTCOME not in observed.metadata
    assert observed.metadata[META_SKIPPED_DONE_BY] == dg.MetadataValue.dagster_run(winner.run_id)
    # Observed, not materialized again: the partition's latest materialization is still the winner's.
    assert _asset_events(dagster_pg, skip.run_id) == [dg.DagsterEventType.ASSET_OBSERVATION]


def test_a_range_observes_only_its_skipped_key_and_says_how_many(dagster_pg: DagsterPg) -> None:
    other_run = "0b5e7a3e-0000-4000-8000-000000000001"
    engine = create_engine(dagster_pg.joblease_url)
    try:
        service = LeaseService(engine, holder=encode_holder("other-deployment", other_run))
        done = service.acquire(JobIdentity.schedule("t-asset", "2024-10-11"))
        assert done is not None
        service.complete(done)
    finally:
        engine.dispose()
    result = dg.materialize(
        [jobs.leased_daily_asset],
        instance=dagster_pg.instance,
        resources={"joblease": JobLeaseResource()},
        run_config=QUIET,
        tags={
            "dagster/asset_partition_range_start": "2024-10-10",
            "dagster/asset_partition_range_end": "2024-10-12",
        },
    )
    assert result.success
    (observed,) = _observations(dagster_pg, result.run_id)
    assert observed.partition == "2024-10-11"
    assert observed.description is not None
    assert observed.description.startswith(f"skipped: done by run {other_run}; t-asset@2024-10-11")
    # The observation comes first; the range's output then materializes all three keys.
    assert (
        _asset_events(dagster_pg, result.run_id)
        == [dg.DagsterEventType.ASSET_OBSERVATION] + [dg.DagsterEventType.ASSET_MATERIALIZATION] * 3
    )
    outcome = [m for m in _messages(dagster_pg, result.run_id) if m.startswith(STEP_EVENT_MESSAGE)]
    assert outcome[-1] == (
        f"{STEP_EVENT_MESSAGE}: won:2,skipped-succeeded:1 (skipped 1 of 3 keys: done by run {other_run})"
    )


def _result(outcome: str, key: str | None = "2024-10-20", **extra: str | None) -> metadata.LeasedResult:
    return metadata.LeasedResult(
        code="c",
        partition_key=key,
        idempotency_key=f"v2:{key}",
        outcome=outcome,
        attempt=1,
        outbox="-",
        **extra,
    )


RUN_A, RUN_B = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"


@pytest.mark.parametrize(
    ("results", "summary"),
    [
        ([], None),
        ([_result("won", winner_run_id=RUN_A)], None),
        ([_result("held", holder="worker:7")], None),
        (
            [_result("skipped-succeeded", winner_run_id=RUN_A, holder=f"dagster:d/{RUN_A}")],
            f"skipped: done by run {RUN_A}; c@2024-10-20 was already done (lease SUCCESS, attempt 1), "
            "not done again here",
        ),
        (  # a winner outside Dagster: its holder
            [_result("skipped-succeeded", holder="worker:7")],
            "skipped: done by worker:7; c@2024-10-20 was already done (lease SUCCESS, attempt 1), "
            "not done again here",
        ),
        (  # an INITIAL job
            [_result("skipped-succeeded", key=None, winner_run_id=RUN_A)],
            f"skipped: done by run {RUN_A}; c (initial) was already done (lease SUCCESS, attempt 1), "
            "not done again here",
        ),
        (
            [
                _result("won", key="2024-10-20", winner_run_id=RUN_B),
                _result("skipped-succeeded", key="2024-10-21", winner_run_id=RUN_A),
                _result("skipped-succeeded", key="2024-10-22", winner_run_id=RUN_A),
            ],
            f"skipped 2 of 3 keys: done by run {RUN_A}",
        ),
        (
            [
                _result("skipped-succeeded", key="2024-10-21", winner_run_id=RUN_A),
                _result("skipped-succeeded", key="2024-10-22", winner_run_id=RUN_B),
            ],
            "skipped 2 of 2 keys: done by 2 other runs",
        ),
        (
            [
                _result("skipped-succeeded", key="2024-10-21", holder="worker:7"),
                _result("failed", key="2024-10-22"),
            ],
            "skipped 1 of 2 keys: done by worker:7",
        ),
    ],
)
def test_skip_summary(results: list[metadata.LeasedResult], summary: str | None) -> None:
    assert metadata.skip_summary(results) == summary
    observed = metadata.skip_observations(ASSET, results)
    assert [o.partition for o in observed] == [r.partition_key for r in results if r.skipped]
