"""A project made by ``create-dagster`` installs this checkout and loads its Components (issue 31).

The project pins ``dagster==X`` (create-dagster pins the release it belongs to). The package declares
``dagster`` as a range, so it must install beside that pin with no resolver error:

- ``create-dagster`` from this environment (the release CI tests here: the newest the resolver picks in
  the main venv, the lowest in ``.ci/run``'s second venv) makes the project; a fresh venv in it gets the
  project and the checkout with ``[ui]`` (``dg``, the webserver) in one ``pip install``; that venv's
  ``dg scaffold defs`` writes the joblease resource, a leased schedule targets a leased job, and ``dg check
  defs`` / ``dg list defs`` load them.
- A project pinning the newest ``dagster`` on the package index (today's ``create-dagster`` makes such a
  project) resolves with the checkout too (``pip install --dry-run``: the resolver's answer, no install).

Packages come from the configured index (the local mirror in CI), through pip's cache.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPONENTS = "dagster_joblease.dagster.components"

BILLING_PY = """
import dagster as dg

from dagster_joblease.dagster import LeasedRun, leased_op


@leased_op(code="daily-billing")
def bill_day(run: LeasedRun) -> None:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="billing.daily", payload={"billingDate": run.partition_key})


@dg.job(partitions_def=dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="UTC"))
def daily_billing_job() -> None:
    bill_day()
"""

SCHEDULE_YAML = """
type: dagster_joblease.dagster.components.LeasedScheduleComponent

attributes:
  target:
    defs_path: billing.py
    job: daily_billing_job
  code: daily-billing
  cron_schedule: "0 2 * * *"
"""


def _env(tmp_path: Path, venv: Path | None = None) -> dict[str, str]:
    drop = ("PYTHONPATH", "DAGSTER_HOME", "PYTHONWARNINGS", "VIRTUAL_ENV", "JOBLEASE_DATABASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        DAGSTER_HOME=str(tmp_path / "dagster_home"),
        DAGSTER_DG_UPDATE_CHECK_ENABLED="0",  # no look-up for a newer create-dagster / dg
        DAGSTER_DISABLE_TELEMETRY="1",
        COLUMNS="250",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    (tmp_path / "dagster_home").mkdir(exist_ok=True)
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _new_project(tmp_path: Path) -> tuple[Path, str]:
    """``create-dagster project`` (this environment's); the project and the ``dagster`` release it pins."""
    _run(
        [str(BIN / "create-dagster"), "project", "--no-uv-sync", "my_project"], tmp_path, _env(tmp_path), 300
    )
    root = tmp_path / "my_project"
    (pin,) = [
        d
        for d in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
        if "dagster" in d
    ]
    assert re.fullmatch(r"dagster==\d+\.\d+\.\d+", pin), pin  # the patch pin that broke the old package
    return root, pin.removeprefix("dagster==")


@pytest.mark.chaos
@pytest.mark.timeout(1500)
def test_a_create_dagster_project_installs_the_checkout_and_loads_its_components(tmp_path: Path) -> None:
    root, pinned = _new_project(tmp_path)
    assert pinned == importlib.metadata.version("dagster")  # create-dagster belongs to this release
    venv = root / ".venv"
    _run([sys.executable, "-m", "venv", str(venv)], root, _env(tmp_path), 120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-e", str(root), "-e", f"{ROOT}[ui]"],
        cwd=root,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert "ResolutionImpossible" not in install.stderr, install.stderr[-4000:]
    assert install.returncode == 0, install.stderr[-4000:]
    versions = _run(
        [
            python,
            "-c",
            "import importlib.metadata as m; print(m.version('dagster'), m.version('dagster-dg-cli'))",
        ],
        root,
        _env(tmp_path),
        60,
    ).stdout.split()
    assert versions == [pinned, pinned]  # the project's pin stands; dg came at the same release

    env = _env(tmp_path, venv)
    dg = str(venv / "bin" / "dg")
    _run(
        [dg, "scaffold", "defs", f"{COMPONENTS}.JobLeaseResourceComponent", "joblease/resource"],
        root,
        env,
        300,
    )
    defs = root / "src" / "my_project" / "defs"
    (defs / "billing.py").write_text(BILLING_PY)
    (defs / "billing_schedule").mkdir()
    (defs / "billing_schedule" / "defs.yaml").write_text(SCHEDULE_YAML)

    checked = _run([dg, "check", "defs"], root, env, 300)
    assert "All definitions loaded successfully" in checked.stdout + checked.stderr
    listed = _run([dg, "list", "defs", "--json"], root, env, 300).stdout
    loaded = json.loads(listed[listed.index("{") :])
    assert [r["name"] for r in loaded["resources"]] == ["joblease"]
    assert [r["type"] for r in loaded["resources"]] == ["dagster_joblease.dagster.resource.JobLeaseResource"]
    assert "daily_billing_job" in [j["name"] for j in loaded["jobs"]]
    assert [s["name"] for s in loaded["schedules"]] == ["daily_billing_job_schedule"]


def test_ci_tests_the_lowest_releases_the_ranges_admit() -> None:
    """.ci/run's second venv installs .ci/dagster-lowest.txt: the lower bounds pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [
        *project["dependencies"],
        *(r for rs in project["optional-dependencies"].values() for r in rs),
    ]
    lower = {
        m.group(1): m.group(2)
        for r in requirements
        if (m := re.fullmatch(r"(dagster[a-z-]*|create-dagster)>=([\d.]+),<[\d.]+", r))
    }
    pins = dict(
        line.split("==")
        for line in (ROOT / ".ci" / "dagster-lowest.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(lower) == {
        "dagster",
        "dagster-webserver",
        "dagster-dg-cli",
        "dagster-postgres",
        "create-dagster",
    } | ({"dagster-graphql"})
    assert {name: pins[name] for name in lower} == lower
    minor = int(lower["dagster"].split(".")[1])
    assert lower["dagster-postgres"] == f"0.{minor + 16}.{lower['dagster'].split('.')[2]}"


def _newest_dagster_on_the_index(env: dict[str, str]) -> str:
    found = _run([sys.executable, "-m", "pip", "index", "versions", "dagster"], ROOT, env, 300).stdout
    match = re.search(r"^dagster \((\d+\.\d+\.\d+)\)", found, re.M)
    assert match, found
    return match.group(1)


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_a_project_pinning_the_newest_dagster_resolves_with_the_checkout(tmp_path: Path) -> None:
    env = _env(tmp_path)
    newest = _newest_dagster_on_the_index(env)
    project = tmp_path / "today"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "today"\nversion = "0.1.0"\ndependencies = ["dagster=={newest}"]\n'
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        "[tool.hatch.build.targets.wheel]\nbypass-selection = true\n"
    )
    report = tmp_path / "report.json"
    resolved = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            str(project),
            str(ROOT),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert "ResolutionImpossible" not in resolved.stderr, resolved.stderr[-4000:]
    assert resolved.returncode == 0, resolved.stderr[-4000:]
    chosen = {
        i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert chosen["dagster"] == newest and "dagster-joblease" in chosen
