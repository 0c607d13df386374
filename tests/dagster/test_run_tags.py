"""Several leased ops in one run: every op's outcome counts in the run's tags, whatever order they end in.

Each step records its own truth (an engine event of the step); the run's tags are computed from all of
them by ``settle_run_tags``, never read-modified from the tags, which two steps ending at once would race.
"""

from __future__ import annotations

import threading
import uuid

import dagster as dg
from dagster._core.events import EngineEventData

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import metadata
from dagster_joblease.dagster.metadata import TAG_OUTCOME, TAG_WINNER, TAG_WORK
from dagster_joblease.dagster.ops import settle_run_tags, step_records
from tests.dagster import range_assets
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def _joblease_tags(instance: dg.DagsterInstance, run_id: str) -> dict[str, str]:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return {k: v for k, v in run.tags.items() if k.startswith("joblease/")}


def test_two_parallel_leased_ops_both_count_in_the_run_tags(dagster_pg: DagsterPg) -> None:
    """Seen: the counts tag kept only the last writer's value (``held:1`` without the other op's ``won``)."""
    day = "2024-08-01"
    engine = create_engine(dagster_pg.joblease_url)
    try:
        held = LeaseService(engine, holder="worker:3", lease_ms=600_000, heartbeat_ms=0).acquire(
            JobIdentity.schedule("t-agg-a", day)
        )
        assert held is not None
        # Separate step processes (multiprocess executor): the two steps end, and write tags, independently.
        with dg.execute_job(
            dg.reconstructable(_parallel_job),
            dagster_pg.instance,
            run_config=QUIET,
            tags={"dagster/partition": day},
        ) as result:
            assert not result.success
            run_id = result.run_id
    finally:
        engine.dispose()
    assert _joblease_tags(dagster_pg.instance, run_id) == {
        TAG_OUTCOME: "held",
        TAG_WINNER: run_id,
        TAG_WORK: "held:1,won:1",
    }
    records = step_records(dagster_pg.instance, run_id)
    assert {k: r[metadata.META_OUTCOME] for k, r in records.items()} == {"held_op": "held", "won_op": "won"}


def _parallel_job() -> dg.JobDefinition:
    return range_assets.defs.resolve_job_def("two_parallel_ops_job")


def test_concurrent_settles_never_lose_a_steps_outcome(dagster_pg: DagsterPg) -> None:
    """Eight 'steps' record and settle at once (threads); the last write has every step's counts."""
    job = range_assets.daily_job
    run = dagster_pg.instance.create_run_for_job(
        job, run_id=str(uuid.uuid4()), tags={"dagster/partition": "2024-08-02"}
    )
    outcomes = [metadata.WON, metadata.SKIPPED_SUCCEEDED, metadata.HELD, metadata.FAILED] * 2
    barrier = threading.Barrier(len(outcomes))
    errors: list[BaseException] = []

    def step(i: int, outcome: str) -> None:
        try:
            barrier.wait(60)
            dagster_pg.instance.report_engine_event(
                f"{metadata.STEP_EVENT_MESSAGE}: {outcome}:1",
                run,
                EngineEventData(
                    metadata={
                        metadata.META_OUTCOMES: dg.MetadataValue.json({outcome: 1}),
                        metadata.META_WINNER: dg.MetadataValue.text(
                            run.run_id if outcome in metadata.DONE_OUTCOMES else metadata.NONE
                        ),
                    }
                ),
                step_key=f"op_{i}",
            )
            settle_run_tags(dagster_pg.instance, run.run_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=step, args=(i, o)) for i, o in enumerate(outcomes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert _joblease_tags(dagster_pg.instance, run.run_id) == {
        TAG_OUTCOME: "failed",
        TAG_WINNER: run.run_id,
        TAG_WORK: "failed:2,held:2,won:2,skipped-succeeded:2",
    }


def test_a_step_with_no_record_leaves_the_tags_alone(dagster_pg: DagsterPg) -> None:
    run = dagster_pg.instance.create_run_for_job(
        range_assets.daily_job, run_id=str(uuid.uuid4()), tags={TAG_OUTCOME: "pending"}
    )
    assert settle_run_tags(dagster_pg.instance, run.run_id) is None
    assert _joblease_tags(dagster_pg.instance, run.run_id) == {TAG_OUTCOME: "pending"}


def test_metadata_counts_round_trip() -> None:
    counts = {metadata.WON: 364, metadata.SKIPPED_SUCCEEDED: 1, metadata.NOT_ATTEMPTED: 0}
    text = metadata.format_counts(counts)
    assert text == "won:364,skipped-succeeded:1"
    assert metadata.parse_counts(text) == {metadata.WON: 364, metadata.SKIPPED_SUCCEEDED: 1}
    assert metadata.run_tags(counts, None) == {TAG_OUTCOME: "won", TAG_WINNER: "none", TAG_WORK: text}
    assert metadata.not_run_tags(2) == {TAG_OUTCOME: "not-run", TAG_WINNER: "none", TAG_WORK: "not-run:2"}
    assert set(metadata.OUTCOMES) == {
        "won",
        "reclaimed",
        "skipped-succeeded",
        "held",
        "failed",
        "lost",
        "not-attempted",
        "not-run",
        "pending",
    }
