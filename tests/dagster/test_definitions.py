"""The ``definitions`` code location validates, its jobs run, and ``joblease demo`` holds its invariant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from dagster_joblease.demo.runner import demo_days

ROOT = Path(__file__).resolve().parents[2]


NOISY = ("BetaWarning", "ExperimentalWarning", "PreviewWarning")


@pytest.mark.timeout(2400)
def test_definitions_validate_and_the_demo_pass_in_subprocesses(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PYTHONWARNINGS")}
    dagster = Path(sys.executable).with_name("dagster")
    validate = {
        module: subprocess.Popen(
            [str(dagster), "definitions", "validate", "-m", module],
            cwd=tmp_path,  # not the repo root: `dagster` drops a temporary home into the working directory
            env={**env, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for module in ("definitions", "dagster_joblease.demo.location")
    }
    # A real run of the example location with the default (multiprocess) executor: the run and its step
    # subprocess each load the location; none of them may print Dagster's beta/experimental warnings.
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    run = subprocess.Popen(
        [str(dagster), "job", "execute", "-m", "definitions", "-j", "seed_default_settings_job"],
        cwd=tmp_path,
        env={
            **env,
            "PYTHONPATH": str(ROOT),
            "DAGSTER_HOME": str(home),
            "JOBLEASE_DATABASE_URL": f"sqlite:///{tmp_path / 'example.sqlite'}",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dagster_joblease.cli.demo",
            "--partitions",
            "3",
            "--workdir",
            str(tmp_path / "demo"),
            # A generous budget for a loaded CI machine (the default scales with the load average, which
            # lags a sudden burst); a passing run waits no longer.
            "--timeout",
            "1500",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for module, proc in validate.items():
        out = proc.communicate(timeout=180)[0]
        assert proc.returncode == 0, out
        assert f"Validation successful for code location {module}" in out
        assert not [w for w in NOISY if w in out], out
    run_out = run.communicate(timeout=180)[0]
    assert run.returncode == 0, run_out
    assert not [w for w in NOISY if w in run_out], run_out
    # The step's own console lines pass through Dagster's compute-log capture, which can drop them from
    # the pipe on a loaded machine; the run's stored events are what say it succeeded.
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        (stored,) = instance.get_runs()
        assert stored.status == dg.DagsterRunStatus.SUCCESS, run_out
        events = {e.dagster_event.event_type for e in instance.all_logs(stored.run_id) if e.dagster_event}
        assert {dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.RUN_SUCCESS} <= events, run_out
    demo_out = demo.communicate(timeout=1800)[0]
    assert demo.returncode == 0, demo_out
    assert "OK: one effect per partition (3/3)." in demo_out
    header = (
        "| partitions | runs | won | reclaimed | skipped | killed | outbox rows | POSTs | effects applied |"
    )
    assert header in demo_out
    row = demo_out.splitlines()[demo_out.splitlines().index(header) + 2]
    partitions, runs, won, reclaimed, skipped, killed, rows, posts, effects = (
        int(cell) for cell in row.strip("|").split("|")
    )
    assert (partitions, runs, killed, rows, effects) == (3, 5, 1, 3, 3)
    assert won + reclaimed == 3 and reclaimed >= 1 and runs == won + reclaimed + skipped + killed
    assert posts >= 3
    # It keeps its work directory by default, says where its time went, and ends with one command.
    assert "Where the time went (" in demo_out
    assert f"joblease demo-ui {tmp_path / 'demo'}\n" in demo_out

    # What the UI shows afterwards is in the kept Dagster home: a real backfill (the daemon submitted its
    # runs), a run the schedule's evaluation requested, the killed run and the sensor's relaunch.
    days = demo_days(3)
    with dg.DagsterInstance.from_config(str(tmp_path / "demo" / "dagster_home")) as instance:
        (backfill,) = instance.get_backfills()
        runs_ = instance.get_runs()
        by_backfill = [r for r in runs_ if r.tags.get("dagster/backfill") == backfill.backfill_id]
        assert sorted(r.tags["dagster/partition"] for r in by_backfill) == days
        scheduled = [r for r in runs_ if r.tags.get("dagster/schedule_name") == "daily_billing_schedule"]
        assert [r.tags["dagster/partition"] for r in scheduled] == [days[-1]]
        failed = [r for r in runs_ if r.status == dg.DagsterRunStatus.FAILURE]
        assert [r.tags["dagster/partition"] for r in failed] == [days[1]]
        assert failed[0].tags["joblease/outcome"] in ("lost", "pending")
        relaunched = [r for r in runs_ if r.tags.get("dagster/sensor_name") == "daily_invoice_reconcile"]
        assert [(r.tags["dagster/partition"], r.tags["joblease/outcome"]) for r in relaunched] == [
            (days[1], "reclaimed")
        ]
        dispatchers = [r for r in runs_ if r.job_name == "outbox_dispatch_job"]
        assert dispatchers and all(
            r.tags.get("dagster/sensor_name") == "outbox_dispatch_sensor" for r in dispatchers
        )
        assert instance.get_materialized_partitions(dg.AssetKey("daily_invoice")) == set(days)


def test_the_code_location_has_exactly_the_documented_names() -> None:
    import definitions

    defs = definitions.defs
    for job in ["daily_billing_job", "sync_orders_job", "seed_default_settings_job", "outbox_dispatch_job"]:
        assert defs.resolve_job_def(job).name == job
    assert defs.resolve_schedule_def("daily_billing_schedule").cron_schedule == "0 2 * * *"
    assert defs.resolve_schedule_def("sync_orders_schedule").cron_schedule == "*/5 * * * *"
    assert defs.resolve_sensor_def("outbox_dispatch_sensor").job_name == "outbox_dispatch_job"
    for job, sensor in [
        ("daily_billing_job", "daily_billing_reconcile"),
        ("sync_orders_job", "sync_orders_reconcile"),
    ]:
        reconcile = defs.resolve_sensor_def(sensor)
        assert reconcile.job_name == job and reconcile.default_status == dg.DefaultSensorStatus.RUNNING
    checks = {key.name for key in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {"no_dead_rows", "delivery_backlog", "no_unrouted_rows"}
    # The Component half (definitions/defs/): the resource, a leased asset, its schedule and sensor.
    assert set(defs.resources or {}) == {"joblease"}
    assert defs.resolve_schedule_def("daily_revenue_report_schedule").job_name == "daily_revenue_report_job"
    reconcile = defs.resolve_sensor_def("daily_revenue_report_reconcile")
    assert reconcile.default_status == dg.DefaultSensorStatus.RUNNING
    assert reconcile.asset_selection is not None


def test_the_component_style_asset_runs_once_per_partition(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import definitions

    monkeypatch.setenv("JOBLEASE_DATABASE_URL", sqlite_url)
    job = definitions.defs.resolve_job_def("daily_revenue_report_job")
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    with dg.instance_for_test() as instance:
        outcomes = []
        for _ in range(2):
            result = job.execute_in_process(instance=instance, run_config=quiet, partition_key="2024-01-02")
            run = instance.get_run_by_id(result.run_id)
            assert run is not None
            outcomes.append(run.tags["joblease/outcome"])
        materialized = instance.get_materialized_partitions(dg.AssetKey("daily_revenue_report"))
    assert outcomes == ["won", "skipped-succeeded"]
    assert materialized == {"2024-01-02"}


def test_seed_default_settings_job_runs_once(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import definitions

    monkeypatch.setenv("JOBLEASE_DATABASE_URL", sqlite_url)
    job = definitions.defs.resolve_job_def("seed_default_settings_job")
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    with dg.instance_for_test() as instance:
        outcomes = []
        for _ in range(2):
            result = job.execute_in_process(instance=instance, run_config=quiet)
            run = instance.get_run_by_id(result.run_id)
            assert run is not None
            outcomes.append(run.tags["joblease/outcome"])
    assert outcomes == ["won", "skipped-succeeded"]
