"""Finding 11 of issue 29, end to end in a default deployment: a re-execution whose leased step never ran
shows ``not-run``, not the ``won`` Dagster copied from its parent, in a plain-Python location written as
the quickstart shows it and in a Components location where the user declared no sensor at all.

The re-executions are Dagster's own: ``DagsterInstance.create_reexecuted_run(use_parent_run_tags=True)``,
what the UI's re-execution (GraphQL ``launchRunReexecution``) and the run-retry daemon call, with the
location loaded as a code location, so the parent's tags are copied by Dagster's code, not by the test.
The run then executes for real (multiprocess executor, PostgreSQL-backed instance), and each of the
location's own run-status sensors is evaluated on the run's finish event, as the daemon evaluates it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.reconstruct import ReconstructableRepository
from dagster._core.execution.api import execute_run
from dagster._core.execution.plan.resume_retry import ReexecutionStrategy
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.remote_representation.code_location import CodeLocation
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import BaseWorkspaceRequestContext, WorkspaceProcessContext
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
from dagster.components.core.component_tree import ComponentTree

from dagster_joblease.dagster import build_not_run_sensors
from dagster_joblease.dagster.metadata import TAG_OUTCOME
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
MODULE = "tests.dagster.not_run_locations"
REPO_ROOT = Path(__file__).resolve().parents[2]
FINISHED = {
    dg.DagsterRunStatus.SUCCESS: dg.DagsterEventType.RUN_SUCCESS,
    dg.DagsterRunStatus.FAILURE: dg.DagsterEventType.RUN_FAILURE,
}


@contextlib.contextmanager
def _location(
    instance: dg.DagsterInstance, attribute: str
) -> Iterator[tuple[BaseWorkspaceRequestContext, CodeLocation, ReconstructableRepository]]:
    """``tests.dagster.not_run_locations:<attribute>`` loaded as Dagster loads a code location."""
    origin = InProcessCodeLocationOrigin(
        loadable_target_origin=LoadableTargetOrigin(
            module_name=MODULE, attribute=attribute, working_directory=str(REPO_ROOT)
        ),
        location_name=attribute,
    )
    with WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin)) as workspace:
        request = workspace.create_request_context()
        yield (
            request,
            request.get_code_location(attribute),
            ReconstructableRepository.for_module(MODULE, attribute, str(REPO_ROOT)),
        )


def _reexecute(
    instance: dg.DagsterInstance, attribute: str, parent_id: str, strategy: ReexecutionStrategy
) -> dg.DagsterRun:
    """Dagster's re-execution of ``parent_id`` (tags copied by Dagster), run to its end."""
    parent = instance.get_run_by_id(parent_id)
    assert parent is not None
    with _location(instance, attribute) as (request, location, recon):
        (repository,) = location.get_repositories().values()
        run = instance.create_reexecuted_run(
            parent_run=parent,
            request_context=request,
            code_location=location,
            remote_job=repository.get_full_job(parent.job_name),
            strategy=strategy,
            use_parent_run_tags=True,  # what the UI and the run-retry daemon pass
        )
        execute_run(recon.get_reconstructable_job(parent.job_name), run, instance)
    finished = instance.get_run_by_id(run.run_id)
    assert finished is not None
    return finished


def _run(instance: dg.DagsterInstance, attribute: str, job_name: str, day: str) -> dg.DagsterRun:
    recon = ReconstructableRepository.for_module(MODULE, attribute, str(REPO_ROOT))
    with dg.execute_job(
        recon.get_reconstructable_job(job_name), instance, run_config=QUIET, tags={"dagster/partition": day}
    ) as result:
        run = instance.get_run_by_id(result.run_id)
    assert run is not None
    return run


def _location_sensors_see_it_finish(
    instance: dg.DagsterInstance, defs: dg.Definitions, run: dg.DagsterRun
) -> dict[str, str]:
    """Every run-status sensor of the location, evaluated on ``run``'s finish event as the daemon does
    (a run-status sensor ignores events of another status); the run's joblease tags after."""
    (record,) = instance.get_records_for_run(run.run_id, of_type=FINISHED[run.status]).records
    event = record.event_log_entry.dagster_event
    assert event is not None
    evaluated = 0
    for sensor in defs.get_repository_def().sensor_defs:
        if not isinstance(sensor, dg.RunStatusSensorDefinition):
            continue
        if not sensor.name.endswith(f"_{run.status.value.lower()}"):
            continue
        context = dg.build_run_status_sensor_context(
            sensor_name=sensor.name, dagster_event=event, dagster_instance=instance, dagster_run=run
        )
        sensor(context)  # type: ignore[operator]
        evaluated += 1
    assert evaluated == 1, f"the location has {evaluated} run-status sensors for {run.status.value}"
    after = instance.get_run_by_id(run.run_id)
    assert after is not None
    return {k: v for k, v in after.tags.items() if k.startswith("joblease/")}


def _warned(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """The step log's warnings that the location has no not-run sensors."""
    return [
        e.user_message
        for e in instance.all_logs(run_id)
        if e.level == logging.WARNING and "no not-run sensors" in e.user_message
    ]


def _defs(attribute: str) -> dg.Definitions:
    from tests.dagster import not_run_locations

    defs = getattr(not_run_locations, attribute)
    assert isinstance(defs, dg.Definitions)
    return defs


LOCATIONS = ["plain", "components"]


@pytest.mark.parametrize("attribute", LOCATIONS)
def test_a_reexecution_from_failure_that_runs_only_a_later_step_says_not_run(
    attribute: str, dagster_pg: DagsterPg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = dagster_pg.instance
    marker = tmp_path / "fail"
    marker.write_text("")
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    day = {"plain": "2024-10-01", "components": "2024-10-02"}[attribute]
    parent = _run(instance, attribute, "not_run_after_job", day)
    assert parent.status == dg.DagsterRunStatus.FAILURE and parent.tags[TAG_OUTCOME] == "won"
    assert _warned(instance, parent.run_id) == []  # the location has them: its leased step says nothing
    marker.unlink()

    child = _reexecute(instance, attribute, parent.run_id, ReexecutionStrategy.FROM_FAILURE)
    assert child.status == dg.DagsterRunStatus.SUCCESS
    assert list(child.step_keys_to_execute or []) == ["plain_op"]
    assert child.tags[TAG_OUTCOME] == "won"  # Dagster's copy of the parent's: untrue of this run

    tags = _location_sensors_see_it_finish(instance, _defs(attribute), child)
    assert (tags[TAG_OUTCOME], tags["joblease/winner"], tags["joblease/work"]) == (
        "not-run",
        "none",
        "not-run:1",
    )
    kept = instance.get_run_by_id(parent.run_id)
    assert kept is not None and kept.tags[TAG_OUTCOME] == "won"  # the parent's own truth stays
    # The parent's own finish, seen by the same sensors, leaves its tags alone.
    assert _location_sensors_see_it_finish(instance, _defs(attribute), kept)[TAG_OUTCOME] == "won"


@pytest.mark.parametrize("attribute", LOCATIONS)
def test_a_reexecution_whose_earlier_step_fails_says_not_run(
    attribute: str, dagster_pg: DagsterPg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = dagster_pg.instance
    marker = tmp_path / "fail"
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    day = {"plain": "2024-10-03", "components": "2024-10-04"}[attribute]
    parent = _run(instance, attribute, "not_run_before_job", day)
    assert parent.status == dg.DagsterRunStatus.SUCCESS and parent.tags[TAG_OUTCOME] == "won"
    marker.write_text("")  # now the earlier, plain step fails: the leased one is skipped

    child = _reexecute(instance, attribute, parent.run_id, ReexecutionStrategy.ALL_STEPS)
    assert child.status == dg.DagsterRunStatus.FAILURE
    assert child.tags[TAG_OUTCOME] == "won"  # Dagster's copy

    tags = _location_sensors_see_it_finish(instance, _defs(attribute), child)
    assert (tags[TAG_OUTCOME], tags["joblease/winner"], tags["joblease/work"]) == (
        "not-run",
        "none",
        "not-run:1",
    )


# -- the component's sensors and a location's own: never two of one name ----------------------------------

COMPONENT_YAML = """type: dagster_joblease.dagster.components.JobLeaseResourceComponent

attributes:
  resource_key: joblease
{extra}"""


def _component_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str) -> dg.Definitions:
    package = tmp_path / f"jl_not_run_{abs(hash((str(tmp_path), extra))) % 10**8}"
    (package / "joblease").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "joblease" / "defs.yaml").write_text(COMPONENT_YAML.format(extra=extra))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(package.name)
    try:
        return ComponentTree.from_module(defs_module=module, project_root=tmp_path).build_defs()
    finally:
        sys.modules.pop(package.name, None)


def test_the_resource_component_brings_the_not_run_sensors_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_sensors = _component_location(tmp_path / "a", monkeypatch, "")
    sensors = with_sensors.get_repository_def().sensor_defs
    assert sorted(s.name for s in sensors) == [
        "joblease_not_run_canceled",
        "joblease_not_run_failure",
        "joblease_not_run_success",
    ]
    assert {s.default_status for s in sensors} == {dg.DefaultSensorStatus.RUNNING}

    without = _component_location(tmp_path / "b", monkeypatch, "  not_run_sensors: false\n")
    assert without.get_repository_def().sensor_defs == []
    # A location whose Python code builds them itself, merged with that component: one of each.
    merged = dg.Definitions.merge(without, dg.Definitions(sensors=build_not_run_sensors()))
    assert len(merged.get_repository_def().sensor_defs) == 3


def test_a_location_with_the_component_and_its_own_not_run_sensors_is_refused_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    component = _component_location(tmp_path, monkeypatch, "")
    both = dg.Definitions.merge(component, dg.Definitions(sensors=build_not_run_sensors()))
    with pytest.raises(
        dg.DagsterInvalidDefinitionError, match="Duplicate definition found for joblease_not_run_"
    ):
        both.get_repository_def()


def test_a_leased_step_in_a_location_without_not_run_sensors_says_so_in_its_log(
    dagster_pg: DagsterPg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain-Python location with no sensors at all: nothing of the library runs in a re-execution that
    does not run the leased step, so nothing can correct Dagster's copy there; the leased step's own log
    says so (and how to fix it) in every run, where the person reading the run looks."""
    instance = dagster_pg.instance
    marker = tmp_path / "fail"
    marker.write_text("")
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    parent = _run(instance, "bare", "not_run_after_job", "2024-10-05")
    assert parent.tags[TAG_OUTCOME] == "won"
    (warning,) = _warned(instance, parent.run_id)
    assert "build_not_run_sensors()" in warning and "not_run_sensors: false" in warning
    marker.unlink()
    child = _reexecute(instance, "bare", parent.run_id, ReexecutionStrategy.FROM_FAILURE)
    # What the warning is about: the copy stands (no sensor of the location exists to correct it).
    assert child.status == dg.DagsterRunStatus.SUCCESS and child.tags[TAG_OUTCOME] == "won"
    assert _defs("bare").get_repository_def().sensor_defs == []
