"""The demo's UI path (docs/quickstart.md), end to end, from a wheel installed outside the checkout.

Build the wheel (``pip wheel --no-deps``), install it into a fresh venv in a temporary directory, run
``joblease demo`` there (it keeps its work directory), then the one command it prints, ``joblease
demo-ui DIR`` (a receiver and ``dg dev -m dagster_joblease.demo.location``). The UI's own GraphQL
API must then show the demo's partitions of ``daily_invoice`` materialized (what the asset's partition
bar shows).

To avoid a full reinstall, the fresh venv sees this venv's site-packages through a ``.pth`` line (appended
after its own site-packages, so the wheel's ``dagster_joblease`` wins, and ``.pth`` files there, like the
editable install's, are not processed). ``bin/dagster`` is a two-line stand-in for the console script pip
would install with ``dagster-dg-cli``: ``bin/dg``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dagster_joblease.demo.runner import demo_days

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS_QUERY = """
query($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    __typename
    ... on AssetNode {
      assetPartitionStatuses {
        __typename
        ... on TimePartitionStatuses { ranges { status startKey endKey } }
      }
    }
  }
}
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _graphql(port: int, query: str, variables: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query, "variables": variables}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        data: dict[str, object] = json.loads(response.read())["data"]
        return data


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DAGSTER_HOME", "PYTHONWARNINGS")}
    env.pop("JOBLEASE_DATABASE_URL", None)
    return env


@pytest.mark.chaos
@pytest.mark.timeout(2700)
def test_the_demo_runs_from_a_wheel_and_its_partitions_show_materialized(tmp_path: Path) -> None:
    env = _clean_env()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("dagster_joblease-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "_joblease_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        env=env,
    )
    (venv / "bin" / "dg").write_text(
        f"#!{python}\nimport sys\nfrom dagster_dg_cli.cli import main\nsys.exit(main())\n"
    )
    (venv / "bin" / "dg").chmod(0o755)

    where = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util, dagster_joblease; print(dagster_joblease.__file__); "
            "print(importlib.util.find_spec('definitions'))",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout.split()
    assert where[0].startswith(site) and where[1] == "None"  # the wheel's package; no definitions/

    work = tmp_path / "demo"
    demo = subprocess.run(
        # The work directory is kept by default; a generous budget for a loaded CI machine (the default
        # scales with the load average, which lags a sudden burst); a passing run waits no longer.
        [
            str(venv / "bin" / "joblease"),
            "demo",
            "--partitions",
            "3",
            "--workdir",
            str(work),
            "--timeout",
            "1500",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=1800,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "OK: one effect per partition (3/3)." in demo.stdout
    (ui_cmd,) = [
        line.strip() for line in demo.stdout.splitlines() if line.startswith("  ") and "demo-ui" in line
    ]
    assert ui_cmd == f"{venv}/bin/joblease demo-ui {work}"

    # The printed command serves the UI (and a receiver) on the demo's runs; here on a free port.
    port = _free_port()
    ui = subprocess.Popen(
        [*ui_cmd.split(), "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        days = demo_days(3)
        deadline = time.monotonic() + 900
        ranges: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            assert ui.poll() is None, ui.communicate()[1][-3000:]
            try:
                data = _graphql(port, PARTITIONS_QUERY, {"key": {"path": ["daily_invoice"]}})
            except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError):
                time.sleep(1)
                continue
            node: dict[str, object] = data["assetNodeOrError"]  # type: ignore[assignment]
            if node["__typename"] == "AssetNode":
                statuses: dict[str, object] = node["assetPartitionStatuses"]  # type: ignore[assignment]
                assert statuses["__typename"] == "TimePartitionStatuses", statuses
                ranges = statuses["ranges"]  # type: ignore[assignment]
                break
            time.sleep(1)
        # The demo's days, and nothing before them, are materialized (each once, by the run that did it).
        assert ranges == [{"status": "MATERIALIZED", "startKey": days[0], "endKey": days[-1]}], ranges
        assert (work / "receiver-ui.log").exists()  # the receiver came up beside the UI
    finally:
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGTERM)
            try:
                ui.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(ui.pid, signal.SIGKILL)  # anything dg dev left behind in the session
        except ProcessLookupError:
            pass
        ui.wait(timeout=10)


def test_readmes_first_command_installs_what_its_ui_step_needs() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert len(commands) == 2  # the set-up section stays two commands
    assert commands[0].strip() == (
        "python3 -m venv .venv && .venv/bin/pip install -q -e '.[ui]' && .venv/bin/joblease demo"
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (dagster_range,) = [d for d in project["dependencies"] if re.match(r"dagster[<>=]", d)]
    # A range, never a patch pin (issue 31: a create-dagster project pins its own patch release).
    assert re.fullmatch(r"dagster>=1\.\d+\.\d+,<1\.\d+", dagster_range), dagster_range
    assert project["optional-dependencies"]["ui"] == [
        dagster_range.replace("dagster", "dagster-webserver"),
        dagster_range.replace("dagster", "dagster-dg-cli"),
        dagster_range.replace("dagster", "create-dagster"),  # docs/components.md's first command
        "dagster-joblease[receiver]",  # the demo's receiver: Starlette on uvicorn
    ]
    assert not [
        d for d in project["dependencies"] if d.startswith("dagster-webserver")
    ]  # not for run workers
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    demo = quickstart.split("## See it work: the demo", 1)[1].split("\n## ", 1)[0]
    first, ui = re.findall(r"```bash\n(.*?)```", demo, re.S)
    assert first == commands[0]
    assert ui.splitlines() == [
        ".venv/bin/joblease demo --workdir /tmp/jl-demo",
        ".venv/bin/joblease demo-ui /tmp/jl-demo",
    ]
