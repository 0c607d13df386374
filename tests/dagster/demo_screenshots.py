"""README's screenshots, taken from a kept demo with real headless Chromium (not a test; run by hand).

::

    .venv/bin/joblease demo --keep --workdir /tmp/jl-demo
    .venv/bin/python -m tests.dagster.demo_screenshots /tmp/jl-demo docs/img

It starts ``dg dev`` on the demo's Dagster home (127.0.0.1 only, a free port), waits for the UI, and saves
the runs page (``demo-runs.png``), the backfill's page (``demo-backfill.png``) and the page of a
skipped run, whose step names its winner as a link (``demo-skip.png``), and for docs/dagster.md's "Where
to look on a run page" that run's green header above its step's asset observation alone (the events
filtered to ``type:ASSET_OBSERVATION``), at a smaller size (``dagster-skip-events.png``); then it stops
``dg dev``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import httpx

from tests.dagster.acceptance_harness import free_port, screenshot, wait_for

LOCATION = "dagster_joblease.demo.location"
#: What a person dismisses once: the UI's "Join the Dagster community" dialog on 127.0.0.1.
PREFS = {"communityNux": True}


def main(work: Path, out: Path) -> int:
    home = work / "dagster_home"
    with dg.DagsterInstance.from_config(str(home)) as instance:
        (backfill,) = instance.get_backfills()
        skipped = [r for r in instance.get_runs() if r.tags.get("joblease/outcome", "").startswith("skipped")]
    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "JOBLEASE_DATABASE_URL": f"sqlite:///{work / 'joblease.sqlite'}",
        "PYTHONWARNINGS": "ignore",
    }
    dg_bin = Path(sys.executable).with_name("dg")
    dev = subprocess.Popen(
        [str(dg_bin), "dev", "-m", LOCATION, "-p", str(port), "-h", "127.0.0.1"],
        cwd=work,
        env=env,
        stdout=(work / "ui.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/server_info", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("the UI", up, 300)
        screenshot(
            f"{url}/runs?view=runs",
            out / "demo-runs.png",
            shows=["skipped-succeeded", "reclaimed", "Failure"],
            local_storage=PREFS,
            height=1400,
        )
        screenshot(
            f"{url}/runs/b/{backfill.backfill_id}?tab=runs",
            out / "demo-backfill.png",
            shows=["won"],
            local_storage=PREFS,
            height=1000,
        )
        if skipped:
            screenshot(
                f"{url}/runs/{skipped[0].run_id}",
                out / "demo-skip.png",
                shows=["skipped-succeeded"],
                local_storage=PREFS,
                height=1000,
            )
            screenshot(
                f"{url}/runs/{skipped[0].run_id}?logs=type%3AASSET_OBSERVATION",
                out / "dagster-skip-events.png",
                shows=["joblease/skipped_done_by"],
                local_storage=PREFS,
                width=1280,
                height=720,
            )
    finally:
        os.killpg(dev.pid, signal.SIGINT)
        try:
            dev.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait(timeout=10)
    print(f"screenshots saved under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()))
