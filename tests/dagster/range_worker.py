"""A range run in its own process: ``python -m tests.dagster.range_worker ASSET START END``.

It materializes ``START..END`` of the asset (one single-run backfill run) on the instance in
``$DAGSTER_HOME`` and prints one JSON line: the run id and whether it succeeded. Exit 0 either way; a
signal ends it as Dagster's run termination does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def race(asset: str, ranges: Sequence[Sequence[str]], env: Mapping[str, str]) -> list[dict[str, Any]]:
    """Run one range run per range of keys, each in its own process, all at once; their JSON results.
    Fails the test (with the workers' stderr) unless every run succeeded."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.dagster.range_worker", asset, keys[0], keys[-1]],
            cwd=REPO,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for keys in ranges
    ]
    outs = [proc.communicate(timeout=300) for proc in procs]
    results = [json.loads(out.splitlines()[-1]) for out, _err in outs]
    assert [r["ok"] for r in results] == [True] * len(ranges), [err[-2000:] for _out, err in outs]
    return results


def logged_run(instance: Any, keys: Sequence[str], text: str) -> str | None:
    """The id of the range run over ``keys`` once it has logged ``text`` (e.g. that it waits for a key)."""
    import dagster as dg

    tags = {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}
    for run in instance.get_runs(filters=dg.RunsFilter(tags=tags)):
        if any(text in (entry.user_message or "") for entry in instance.all_logs(run.run_id)):
            return str(run.run_id)
    return None


def terminated_while(
    instance: Any, asset: str, keys: Sequence[str], text: str, env: Mapping[str, str]
) -> tuple[str, str]:
    """Run ``asset`` over ``keys`` in a worker process, SIGTERM it once the run has logged ``text`` (or the
    worker ended), and return the run's id and the worker's stderr."""
    import signal

    from tests.conftest import wait_until

    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.dagster.range_worker", asset, keys[0], keys[-1]],
        cwd=REPO,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: logged_run(instance, keys, text) is not None or proc.poll() is not None, timeout=120
        )
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return json.loads(out.splitlines()[-1])["run_id"], err


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    import dagster as dg

    from dagster_joblease.dagster import JobLeaseResource
    from tests.dagster import range_assets

    name, start, end = argv
    asset = {
        "range_asset": range_assets.range_asset,
        "batch_asset": getattr(range_assets, "batch_asset", None),
    }[name]
    assert asset is not None, name
    result = dg.materialize(
        [asset],
        instance=dg.DagsterInstance.get(),
        resources={"joblease": JobLeaseResource()},  # $JOBLEASE_DATABASE_URL
        run_config={"loggers": {"console": {"config": {"log_level": "ERROR"}}}},
        tags={"dagster/asset_partition_range_start": start, "dagster/asset_partition_range_end": end},
        raise_on_error=False,
    )
    print(json.dumps({"run_id": result.run_id, "ok": result.success}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
