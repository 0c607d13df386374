"""Real Dagster runs on a PostgreSQL-backed instance: concurrent backfills and schedule runs, a
re-execution, a run retry, a single-run backfill of a partitioned asset, and what GraphQL shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql

from dagster_joblease import JobIdentity, LeaseService, create_engine, outbox
from dagster_joblease.dagster import JobLeaseResource
from dagster_joblease.dagster.holders import default_deployment
from dagster_joblease.dagster.metadata import (
    META_ATTEMPT,
    META_CODE,
    META_ERROR,
    META_HOLDER,
    META_IDEMPOTENCY_KEY,
    META_KEYS,
    META_OUTBOX,
    META_OUTCOME,
    META_OUTCOMES,
    META_RUN_KEY,
    META_WINNER,
    STEP_TAGS,
    TAG_OUTCOME,
    TAG_WINNER,
    TAG_WORK,
)
from dagster_joblease.dagster.ops import step_records
from dagster_joblease.receiver import effect_count
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.conftest import wait_until
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg
from tests.receiver_proc import ReceiverProcess

DAYS = [f"2024-02-{d:02d}" for d in range(1, 30)] + ["2024-03-01"]  # 30 daily partitions
SCHEDULED = DAYS[20:]  # the last 10 also get schedule-style runs
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def _outbox_keys(url: str, keys: list[str]) -> dict[str, str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(outbox_table.c.idempotency_key, outbox_table.c.status).where(
                    outbox_table.c.idempotency_key.in_(keys)
                )
            ).all()
    finally:
        engine.dispose()
    return {key: status for key, status in rows}


def _lease(url: str, key: str) -> Any:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(lease_table).where(lease_table.c.lock_key == key)).one()
    finally:
        engine.dispose()


def _due(url: str) -> int:
    engine = create_engine(url)
    try:
        return outbox.due_summary(engine).due
    finally:
        engine.dispose()


def _run_tags(dagster_pg: DagsterPg, run_id: str) -> dict[str, str]:
    run = dagster_pg.instance.get_run_by_id(run_id)
    assert run is not None
    return dict(run.tags)


def _facts(dagster_pg: DagsterPg, run_id: str) -> dict[str, object]:
    """The run's one leased step's record (its metadata: attempt, outbox, holder, error …)."""
    (only,) = step_records(dagster_pg.instance, run_id).values()
    return only


def _key(code: str, day: str) -> str:
    return JobIdentity.schedule(code, day).idempotency_key


@pytest.mark.chaos
def test_two_concurrent_backfills_and_schedule_runs_give_one_effect_per_partition(
    dagster_pg: DagsterPg,
) -> None:
    launches = [
        ("backfill-a", {"dagster/backfill": "bf-a"}, DAYS),
        ("backfill-b", {"dagster/backfill": "bf-b"}, DAYS),
        (
            "schedule",
            {"dagster/schedule_name": "backfill_job_schedule", "dagster/run_key": "{day}"},
            SCHEDULED,
        ),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.dagster.launcher", label, "backfill_job", json.dumps(tags), *days],
            stdout=subprocess.PIPE,
            text=True,
            env=dagster_pg.env(),
        )
        for label, tags, days in launches
    ]
    printed = [proc.communicate(timeout=240)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    lines = [json.loads(line) for out in printed for line in out.splitlines()]
    assert len(lines) == 70 and all(line["ok"] for line in lines)

    runs = dagster_pg.instance.get_runs(dg.RunsFilter(job_name="backfill_job"))
    assert len(runs) == 70
    assert {run.status for run in runs} == {dg.DagsterRunStatus.SUCCESS}
    winners = [run for run in runs if run.tags[TAG_OUTCOME] in ("won", "reclaimed")]
    losers = [run for run in runs if run not in winners]
    assert sorted(run.tags["dagster/partition"] for run in winners) == DAYS
    assert len(losers) == 40
    # A loser that found its partition held waited for the winner: every loser is a recorded skip
    # naming the winner's run, none a green "held" skip.
    assert {run.tags[TAG_OUTCOME] for run in losers} == {"skipped-succeeded"}
    winner_of = {run.tags["dagster/partition"]: run.run_id for run in winners}
    for run in losers:
        assert run.tags[TAG_WINNER] == winner_of[run.tags["dagster/partition"]]
    assert {_facts(dagster_pg, run.run_id)[META_OUTBOX] for run in losers} == {"not-enqueued"}
    assert {_facts(dagster_pg, run.run_id)[META_OUTBOX] for run in winners} == {"inserted"}
    for run in runs:
        facts = _facts(dagster_pg, run.run_id)
        assert facts[META_IDEMPOTENCY_KEY] == _key("t-backfill", run.tags["dagster/partition"])

    keys = [_key("t-backfill", day) for day in DAYS]
    assert _outbox_keys(dagster_pg.joblease_url, keys) == dict.fromkeys(keys, "PENDING")

    dispatch_job = jobs.defs.resolve_job_def("test_dispatch_job")
    with ReceiverProcess(dagster_pg.joblease_url) as receiver:
        os.environ[jobs.RECEIVER_ENV] = receiver.url
        try:
            result = dispatch_job.execute_in_process(instance=dagster_pg.instance, run_config=QUIET)
            for _ in range(5):
                # On a loaded machine a delivery can time out and be retried after a backoff.
                if set(_outbox_keys(dagster_pg.joblease_url, keys).values()) == {"SENT"}:
                    break
                wait_until(lambda: _due(dagster_pg.joblease_url) > 0, timeout=10)
                dispatch_job.execute_in_process(instance=dagster_pg.instance, run_config=QUIET)
        finally:
            os.environ.pop(jobs.RECEIVER_ENV)
    assert result.success
    counts = result.output_for_node("test_dispatch_job_dispatch")
    assert counts["claimed"] >= 30 and counts["sent"] + counts["retried"] >= 30 and counts["dead"] == 0
    assert _outbox_keys(dagster_pg.joblease_url, keys) == dict.fromkeys(keys, "SENT")
    engine = create_engine(dagster_pg.joblease_url)
    try:
        assert [effect_count(engine, idempotency_key=key) for key in keys] == [1] * 30
    finally:
        engine.dispose()


def test_reexecution_of_a_successful_run_skips_without_a_new_effect(dagster_pg: DagsterPg) -> None:
    job = dg.reconstructable(jobs.retry_job)
    day, key = "2024-05-01", _key("t-retry", "2024-05-01")
    tags = {"dagster/partition": day}
    with dg.execute_job(job, dagster_pg.instance, run_config=QUIET, tags=tags) as first:
        assert first.success
    with dg.execute_job(
        job,
        dagster_pg.instance,
        run_config=QUIET,
        tags=tags,
        reexecution_options=dg.ReexecutionOptions(parent_run_id=first.run_id),
    ) as again:
        assert again.success
    child = dagster_pg.instance.get_run_by_id(again.run_id)
    assert child is not None and child.parent_run_id == first.run_id
    assert child.tags[TAG_OUTCOME] == "skipped-succeeded"
    facts = _facts(dagster_pg, again.run_id)
    assert facts[META_ATTEMPT] == 1 and facts[META_IDEMPOTENCY_KEY] == key
    assert child.tags[TAG_WINNER] == first.run_id == facts[META_WINNER]
    assert _outbox_keys(dagster_pg.joblease_url, [key]) == {key: "PENDING"}
    assert _lease(dagster_pg.joblease_url, key).status == "SUCCESS"


def test_a_retry_of_a_failed_run_takes_over_with_the_same_key(dagster_pg: DagsterPg, tmp_path: Path) -> None:
    job = dg.reconstructable(jobs.retry_job)
    day, key = "2024-05-02", _key("t-retry", "2024-05-02")
    marker = tmp_path / "fail-once"
    marker.touch()
    os.environ[jobs.FAIL_ONCE_ENV] = str(marker)
    try:
        with dg.execute_job(
            job, dagster_pg.instance, run_config=QUIET, tags={"dagster/partition": day}
        ) as failed:
            assert not failed.success
        assert _lease(dagster_pg.joblease_url, key).status == "FAIL"
        failed_tags = _run_tags(dagster_pg, failed.run_id)
        assert (failed_tags[TAG_OUTCOME], failed_tags[TAG_WINNER]) == ("failed", "none")
        facts = _facts(dagster_pg, failed.run_id)
        assert (facts[META_ATTEMPT], facts[META_IDEMPOTENCY_KEY]) == (1, key)
        assert (facts[META_CODE], facts[META_RUN_KEY]) == ("t-retry", day)
        assert facts[META_ERROR] == "RuntimeError: failing once on purpose"
        assert _outbox_keys(dagster_pg.joblease_url, [key]) == {}
        with dg.execute_job(
            job,
            dagster_pg.instance,
            run_config=QUIET,
            # As Dagster's run retry copies them from a run the reconciliation sensor launched:
            tags={
                "dagster/partition": day,
                "dagster/retry_number": "1",
                "dagster/sensor_name": "t_retry_reconcile",
                "joblease/relaunch": "1/5",
                "joblease/reconcile_reason": "lease FAIL",
            },
            reexecution_options=dg.ReexecutionOptions.from_failure(failed.run_id, dagster_pg.instance),
        ) as retried:
            assert retried.success
    finally:
        os.environ.pop(jobs.FAIL_ONCE_ENV)
    run = dagster_pg.instance.get_run_by_id(retried.run_id)
    assert run is not None
    assert (run.tags[TAG_OUTCOME], run.tags[TAG_WINNER], run.tags[TAG_WORK]) == (
        "reclaimed",
        retried.run_id,
        "reclaimed:1",
    )
    facts = _facts(dagster_pg, retried.run_id)
    assert facts[META_ERROR] == "none"  # the parent's error does not stand on the retry
    assert (facts[META_ATTEMPT], facts[META_IDEMPOTENCY_KEY], facts[META_OUTBOX]) == (2, key, "inserted")
    # The launch tags it copied say how its root run was launched (the relaunch cap counts only runs
    # without a parent); the step writes only its own three.
    assert run.tags["joblease/relaunch"] == "1/5" and run.parent_run_id == failed.run_id
    row = _lease(dagster_pg.joblease_url, key)
    assert (row.status, row.attempt) == ("SUCCESS", 2)
    assert _outbox_keys(dagster_pg.joblease_url, [key]) == {key: "PENDING"}


def test_single_run_backfill_of_a_partitioned_asset_takes_one_lease_per_key(dagster_pg: DagsterPg) -> None:
    resources = {"joblease": JobLeaseResource()}
    single = dg.materialize(
        [jobs.leased_daily_asset],
        partition_key="2024-01-03",
        instance=dagster_pg.instance,
        resources=resources,
    )
    assert single.success
    ranged = dg.materialize(
        [jobs.leased_daily_asset],
        instance=dagster_pg.instance,
        resources=resources,
        tags={
            "dagster/asset_partition_range_start": "2024-01-01",
            "dagster/asset_partition_range_end": "2024-01-05",
        },
    )
    assert ranged.success
    # Every key is done (four by this run, one by the earlier run), so the output is produced: Dagster
    # records a materialization for every key of the range and downstream steps would run for all of it.
    materialized = ranged.asset_materializations_for_node("leased_daily_asset")
    assert sorted(m.partition or "" for m in materialized) == [f"2024-01-0{d}" for d in range(1, 6)]
    for m in materialized:
        assert m.metadata[META_OUTCOME] == dg.MetadataValue.text("won")  # the range's most severe
        assert m.metadata[META_OUTCOMES] == dg.MetadataValue.json({"won": 4, "skipped-succeeded": 1})
    run = dagster_pg.instance.get_run_by_id(ranged.run_id)
    assert run is not None
    assert run.tags[TAG_OUTCOME] == "won"  # the most severe of the keys' outcomes
    assert run.tags[TAG_WORK] == "won:4,skipped-succeeded:1"
    assert run.tags[TAG_WINNER] == "multiple"  # this run and the single-partition run
    assert [k for k in run.tags if k.startswith("joblease/")] == sorted(STEP_TAGS)
    facts = _facts(dagster_pg, ranged.run_id)
    assert (facts[META_KEYS], facts[META_RUN_KEY]) == (5, "2024-01-01..2024-01-05")
    assert "| 2024-01-03 | skipped-succeeded | 1 |" in str(facts["joblease/results"])
    keys = [_key("t-asset", f"2024-01-0{d}") for d in range(1, 6)]
    assert _outbox_keys(dagster_pg.joblease_url, keys) == dict.fromkeys(keys, "PENDING")


RUN_QUERY = """
query RunQuery($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run {
      status
      tags { key value }
      eventConnection {
        events {
          __typename
          ... on ExecutionStepOutputEvent {
            metadataEntries {
              label
              ... on TextMetadataEntry { text }
              ... on IntMetadataEntry { intValue }
              ... on PipelineRunMetadataEntry { runId }
            }
          }
        }
      }
    }
  }
}
"""


def test_graphql_shows_the_lease_tags_and_metadata(dagster_pg: DagsterPg) -> None:
    job = jobs.defs.resolve_job_def("retry_job")
    day = "2024-07-01"
    result = job.execute_in_process(partition_key=day, instance=dagster_pg.instance, run_config=QUIET)
    assert result.success
    with define_out_of_process_context(jobs.__file__, "defs", dagster_pg.instance) as context:
        response = execute_dagster_graphql(context, RUN_QUERY, {"runId": result.run_id})
    run = response.data["runOrError"]
    assert run["__typename"] == "Run" and run["status"] == "SUCCESS"
    tags = {tag["key"]: tag["value"] for tag in run["tags"]}
    assert (tags[TAG_OUTCOME], tags[TAG_WINNER], tags[TAG_WORK]) == ("won", result.run_id, "won:1")
    assert [t["key"] for t in run["tags"] if t["key"].startswith("joblease/")] == list(STEP_TAGS)
    (output,) = [e for e in run["eventConnection"]["events"] if e["__typename"] == "ExecutionStepOutputEvent"]
    entries = {
        entry["label"]: entry.get("text", entry.get("intValue", entry.get("runId")))
        for entry in output["metadataEntries"]
    }
    assert entries[META_OUTCOME] == "won"
    assert entries[META_WINNER] == result.run_id  # a run link: one click to the winner
    assert entries[META_ATTEMPT] == 1
    assert entries[META_IDEMPOTENCY_KEY] == _key("t-retry", day)
    assert entries[META_OUTBOX] == "inserted"
    assert entries[META_HOLDER] == f"dagster:{default_deployment(dagster_pg.instance)}/{result.run_id}"


def test_copied_parent_tags_are_overwritten_when_the_step_starts(dagster_pg: DagsterPg) -> None:
    """A UI re-execution copies its parent's tags; the leased step replaces every one, 'pending' first."""
    day = "2024-07-02"
    parent = {TAG_OUTCOME: "won", TAG_WINNER: "parent-run", TAG_WORK: "won:5"}
    job = jobs.defs.resolve_job_def("tag_probe_job")
    result = job.execute_in_process(
        partition_key=day, instance=dagster_pg.instance, run_config=QUIET, tags=parent
    )
    assert result.success
    (probe,) = result.output_for_node("tag_probe_op")
    seen = probe.result  # the run's joblease tags while the body ran
    assert seen == {TAG_OUTCOME: "pending", TAG_WINNER: "none", TAG_WORK: "pending:1"}
    tags = _run_tags(dagster_pg, result.run_id)
    assert (tags[TAG_OUTCOME], tags[TAG_WINNER], tags[TAG_WORK]) == ("won", result.run_id, "won:1")
    facts = _facts(dagster_pg, result.run_id)
    assert (facts[META_OUTBOX], facts[META_ATTEMPT], facts[META_ERROR]) == ("inserted", 1, "none")
    assert (facts[META_CODE], facts[META_RUN_KEY], facts[META_IDEMPOTENCY_KEY]) == (
        "t-tags",
        day,
        _key("t-tags", day),
    )


def test_a_run_that_lost_its_lease_says_lost(dagster_pg: DagsterPg) -> None:
    day = "2024-07-03"
    job = jobs.defs.resolve_job_def("lost_job")
    result = job.execute_in_process(
        partition_key=day, instance=dagster_pg.instance, run_config=QUIET, raise_on_error=False
    )
    assert not result.success
    tags = _run_tags(dagster_pg, result.run_id)
    assert (tags[TAG_OUTCOME], tags[TAG_WINNER], tags[TAG_WORK]) == ("lost", "none", "lost:1")
    facts = _facts(dagster_pg, result.run_id)
    assert (facts[META_ATTEMPT], facts[META_IDEMPOTENCY_KEY]) == (1, _key("t-lost", day))
    error = str(facts[META_ERROR])
    assert error.startswith("LostLeaseError: cannot ") and "no longer owns it" in error
    assert len(error) <= 200
    assert _outbox_keys(dagster_pg.joblease_url, [_key("t-lost", day)]) == {}


def test_a_job_with_two_leased_ops_tags_the_worst_and_keeps_each_ops_record(
    dagster_pg: DagsterPg, tmp_path: Path
) -> None:
    day = "2024-07-04"
    job = jobs.defs.resolve_job_def("two_leased_ops_job")
    first = job.execute_in_process(partition_key=day, instance=dagster_pg.instance, run_config=QUIET)
    tags = _run_tags(dagster_pg, first.run_id)
    assert (tags[TAG_OUTCOME], tags[TAG_WINNER], tags[TAG_WORK]) == ("won", first.run_id, "won:2")
    records = step_records(dagster_pg.instance, first.run_id)
    assert {k: r[META_OUTCOME] for k, r in records.items()} == {"first_leased": "won", "second_leased": "won"}
    # Next day: the first op's partition was already done elsewhere, the second op's body fails.
    day = "2024-07-05"
    engine = create_engine(dagster_pg.joblease_url)
    try:
        done = LeaseService(engine, holder="worker:1").acquire(JobIdentity.schedule("t-two-a", day))
        assert done is not None
        LeaseService(engine).complete(done)
    finally:
        engine.dispose()
    marker = tmp_path / "fail-once"
    marker.touch()
    os.environ[jobs.FAIL_ONCE_ENV] = str(marker)
    try:
        again = job.execute_in_process(
            partition_key=day, instance=dagster_pg.instance, run_config=QUIET, tags=tags, raise_on_error=False
        )
    finally:
        os.environ.pop(jobs.FAIL_ONCE_ENV)
    assert not again.success
    tags = _run_tags(dagster_pg, again.run_id)
    assert (tags[TAG_OUTCOME], tags[TAG_WORK]) == ("failed", "failed:1,skipped-succeeded:1")
    assert tags[TAG_WINNER] == "worker:1"  # the one done key's winner (not a Dagster run: its holder)
    records = step_records(dagster_pg.instance, again.run_id)
    assert records["first_leased"][META_OUTCOME] == "skipped-succeeded"
    assert records["second_leased"][META_OUTCOME] == "failed"
    assert records["second_leased"][META_ERROR] == "RuntimeError: failing once on purpose"
