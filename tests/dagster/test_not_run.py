"""Tags never lie: a run whose leased step never ran carries no joblease outcome copied from its parent.

Real runs on a PostgreSQL-backed instance: a parent run in which the leased step won, then a re-execution
in which it did not run (from failure: only the later, failed step ran; all steps: an earlier step failed
so the leased one was skipped). Dagster copies the parent's tags at launch; the run-status sensor,
evaluated on the run's own finish event as the daemon evaluates it, rewrites them to not-run.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from dagster_joblease.dagster import build_not_run_sensors
from dagster_joblease.dagster.metadata import TAG_OUTCOME
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def _evaluate(dagster_pg: DagsterPg, run_id: str) -> dict[str, str]:
    """Run the matching sensor on the run's finish event, as the daemon does; the run's tags after."""
    instance = dagster_pg.instance
    run = instance.get_run_by_id(run_id)
    assert run is not None
    kind = {
        dg.DagsterRunStatus.SUCCESS: dg.DagsterEventType.RUN_SUCCESS,
        dg.DagsterRunStatus.FAILURE: dg.DagsterEventType.RUN_FAILURE,
    }[run.status]
    (record,) = instance.get_records_for_run(run_id, of_type=kind).records
    event = record.event_log_entry.dagster_event
    assert event is not None
    (sensor,) = [s for s in build_not_run_sensors() if s.name.endswith(run.status.value.lower())]
    context = dg.build_run_status_sensor_context(
        sensor_name=sensor.name, dagster_event=event, dagster_instance=instance, dagster_run=run
    )
    sensor(context)  # type: ignore[operator]
    after = instance.get_run_by_id(run_id)
    assert after is not None
    return {k: v for k, v in after.tags.items() if k.startswith("joblease/")}


def _run(
    dagster_pg: DagsterPg, job: dg.ReconstructableJob, day: str, options: dg.ReexecutionOptions | None = None
) -> str:
    tags = {"dagster/partition": day}
    if options is not None:
        # What the UI's re-execution (and a run retry) does: the parent's tags come along, joblease's too.
        parent = dagster_pg.instance.get_run_by_id(options.parent_run_id)
        assert parent is not None
        tags = {
            k: v for k, v in parent.tags.items() if not k.startswith("dagster/") or k == "dagster/partition"
        }
    with dg.execute_job(
        job, dagster_pg.instance, run_config=QUIET, tags=tags, reexecution_options=options
    ) as result:
        return result.run_id


def test_a_reexecution_from_failure_in_which_only_a_later_step_ran_says_not_run(
    dagster_pg: DagsterPg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "fail"
    marker.write_text("")
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    job = dg.reconstructable(jobs.not_run_after_job)
    parent = _run(dagster_pg, job, "2024-09-01")
    assert _evaluate(dagster_pg, parent)[TAG_OUTCOME] == "won"  # its own truth: left alone
    marker.unlink()
    child = _run(
        dagster_pg, job, "2024-09-01", dg.ReexecutionOptions.from_failure(parent, dagster_pg.instance)
    )
    copied = dagster_pg.instance.get_run_by_id(child)
    assert copied is not None and copied.status == dg.DagsterRunStatus.SUCCESS
    assert copied.tags[TAG_OUTCOME] == "won"  # what Dagster copied from the parent: untrue here
    tags = _evaluate(dagster_pg, child)
    assert (tags[TAG_OUTCOME], tags["joblease/winner"], tags["joblease/work"]) == (
        "not-run",
        "none",
        "not-run:1",
    )


def test_an_all_steps_reexecution_failing_before_the_leased_step_says_not_run(
    dagster_pg: DagsterPg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "fail"
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    job = dg.reconstructable(jobs.not_run_before_job)
    parent = _run(dagster_pg, job, "2024-09-02")
    assert _evaluate(dagster_pg, parent)[TAG_OUTCOME] == "won"
    marker.write_text("")  # now the earlier step fails: the leased one is skipped
    child = _run(dagster_pg, job, "2024-09-02", dg.ReexecutionOptions(parent_run_id=parent))
    copied = dagster_pg.instance.get_run_by_id(child)
    assert copied is not None and copied.status == dg.DagsterRunStatus.FAILURE
    assert copied.tags[TAG_OUTCOME] == "won"
    assert _evaluate(dagster_pg, child)[TAG_OUTCOME] == "not-run"
