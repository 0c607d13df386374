"""The ``definitions`` code location validates, its jobs run, and ``joblease demo`` holds its invariant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_definitions_validate_and_the_demo_pass_in_subprocesses(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("DAGSTER_HOME", None)
    dagster = Path(sys.executable).with_name("dagster")
    validate = subprocess.Popen(
        [str(dagster), "definitions", "validate", "-m", "definitions"],
        cwd=tmp_path,  # not the repo root: `dagster` drops a temporary home into the working directory
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dagster_joblease.dagster.demo",
            "--partitions",
            "4",
            "--workdir",
            str(tmp_path / "demo"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    validate_out = validate.communicate(timeout=120)[0]
    demo_out = demo.communicate(timeout=120)[0]
    assert validate.returncode == 0, validate_out
    assert "Validation successful for code location definitions" in validate_out
    assert demo.returncode == 0, demo_out
    assert "OK: one effect per partition (4/4)." in demo_out
    header = "| partitions | runs | winners | skips | outbox rows | POSTs | effects applied |"
    assert header in demo_out
    row = demo_out.splitlines()[demo_out.splitlines().index(header) + 2]
    cells = [int(cell) for cell in row.strip("|").split("|")]
    assert cells[:5] == [4, 8, 4, 4, 4] and cells[5] >= 4 and cells[6] == 4


def test_the_code_location_has_exactly_the_documented_names() -> None:
    import definitions

    defs = definitions.defs
    for job in ["daily_billing_job", "sync_orders_job", "seed_default_settings_job", "outbox_dispatch_job"]:
        assert defs.resolve_job_def(job).name == job
    assert defs.resolve_schedule_def("daily_billing_schedule").cron_schedule == "0 2 * * *"
    assert defs.resolve_schedule_def("sync_orders_schedule").cron_schedule == "*/5 * * * *"
    assert defs.resolve_sensor_def("outbox_dispatch_sensor").job_name == "outbox_dispatch_job"


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
