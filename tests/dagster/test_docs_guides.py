"""The guides, run as printed, in projects made by ``create-dagster`` (issue 40, "Done when").

- The Quickstart's install line makes the project and its virtualenv (``/path/to/dagster-joblease`` is
  this checkout; its ``.venv/bin/`` is this environment's).
- docs/components.md's "Add them to a project", step by step in its printed order: each bash line runs in
  the project with its virtualenv active, each Python block is written to the file the step names, and
  every ``dg check defs`` must pass where the guide says it does.
- docs/dagster.md's first example, saved where the page says in a second project (the first one already
  declares the ``joblease`` resource), and its one partition launched from the CLI as printed, twice: a
  win, then a green skip naming the first run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dagster.test_new_project import _env

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEP = re.compile(r"^\*\*(?P<n>\d+)\.\*\*", re.M)
BLOCK = re.compile(r"```(?P<lang>bash|python)\n(?P<code>.*?)```", re.S)
DEFS_FILE = re.compile(r"`(src/my_project/defs/[\w/]+\.py)`")


def _section(page: str, heading: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def _printed(command: str) -> str:
    """A command of the docs as it runs here: the checkout and its virtualenv are this ones."""
    return command.replace("/path/to/dagster-joblease/.venv/bin/", f"{BIN}/").replace(
        "/path/to/dagster-joblease", str(ROOT)
    )


def _shell(script: str, cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script}\nexited {proc.returncode}:\n{output[-6000:]}"
    return output


def _install(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The Quickstart's install line, as printed: the project and its virtualenv."""
    (block,) = re.findall(
        r"```bash\n(.*?)```", _section("quickstart.md", "## Add it to your Dagster project"), re.S
    )
    script = _printed(block).replace("pip install -e", "pip install -q -e")
    _shell(script, tmp_path, _env(tmp_path), 1500)
    root = tmp_path / "my_project"
    return root, _env(tmp_path, root / ".venv")


def _components_steps() -> list[tuple[int, str, list[tuple[str, str]]]]:
    """(step, its text, its blocks) of the Components guide, up to the step that starts `dg dev`."""
    section = _section("components.md", "## Add them to a project")
    starts = [m.start() for m in STEP.finditer(section)]
    steps = []
    for begin, end in zip(starts, [*starts[1:], len(section)], strict=True):
        text = section[begin:end]
        blocks = [(m["lang"], m["code"]) for m in BLOCK.finditer(text)]
        steps.append((int(STEP.match(text)["n"]), text, blocks))  # type: ignore[index]
    return steps


@pytest.mark.chaos
@pytest.mark.timeout(2400)
def test_the_guides_run_as_printed_in_create_dagster_projects(tmp_path: Path) -> None:
    root, env = _install(tmp_path)
    steps = _components_steps()
    assert [n for n, _, _ in steps] == list(range(1, len(steps) + 1))
    checks = 0
    for number, text, blocks in steps:
        if "dg dev" in "".join(code for _, code in blocks):
            break  # the UI: not run here
        for lang, code in blocks:
            if lang == "python":
                (target,) = DEFS_FILE.findall(text)
                (root / target).write_text(code)
                continue
            for line in code.strip().splitlines():
                output = _shell(_printed(line), root, env, 600)
                if line.split("#")[0].strip() == "dg check defs":
                    assert "All definitions loaded successfully" in output, (number, output[-4000:])
                    checks += 1
    assert checks >= 4  # one per step the guide says ends with a passing check

    # The Components project's partition runs as the guide's step 4 says.
    launch = re.search(r"`(dg launch --job [^`]+)`", _section("components.md", "## Add them to a project"))
    assert launch
    _shell(launch[1], root, env, 600)

    # docs/dagster.md's first example in a project of its own, one partition launched from the CLI.
    first = _section("dagster.md", "## A leased asset, and one partition of it")
    (python,) = re.findall(r"```python\n(.*?)```", first, re.S)
    (command,) = re.findall(r"```bash\n(.*?)```", first, re.S)
    _shell(f"{BIN}/create-dagster project reports_project", tmp_path, env, 300)
    reports = tmp_path / "reports_project"
    _shell("pip install -q --no-deps -e .", reports, env, 600)
    target = DEFS_FILE.findall(first)[0].replace("my_project", "reports_project")
    (reports / target).write_text(python)
    won = _shell(command.strip(), reports, env, 600)
    assert "joblease daily-report/2024-01-01: won (attempt 1, outbox inserted" in won, won[-4000:]
    again = _shell(command.strip(), reports, env, 600)
    assert "skipped: done by run " in again, again[-4000:]
    shown = json.loads(
        _shell("joblease leases show --code daily-report --run-key 2024-01-01 --json", reports, env, 120)
    )
    assert shown["status"] == "SUCCESS", shown
