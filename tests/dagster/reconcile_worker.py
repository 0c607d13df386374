"""A run in its own process: ``python -m tests.dagster.reconcile_worker TARGET START [END]``.

``TARGET`` is an asset of :mod:`tests.dagster.reconcile_assets` (comma-separated for several in one run) or
``job:<name>`` for one of its asset jobs. ``START END`` make a range run (Dagster's range tags, as a
single-run backfill has); ``START`` alone a single-partition run. It runs on the instance in
``$DAGSTER_HOME`` (the joblease database from ``$JOBLEASE_DATABASE_URL``; ``$JOBLEASE_RC_DEPLOYMENT`` names
the deployment) and prints one JSON line: the run id and whether it succeeded. Exit 0 either way; a
signal ends it as Dagster's run termination does, SIGKILL as an OOM kill does.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

DEPLOYMENT_ENV = "JOBLEASE_RC_DEPLOYMENT"
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def run(instance: Any, defs: Any, target: str, extra: dict[str, Any]) -> Any:
    """One run as the daemon launches it: an asset job by name, or the implicit asset job
    (``__ASSET_JOB``) with an asset selection, as a backfill or a sensor's asset request does."""
    if target.startswith("job:"):
        job = defs.resolve_job_def(target.removeprefix("job:"))
        return job.execute_in_process(instance=instance, run_config=QUIET, raise_on_error=False, **extra)
    from tests.dagster import reconcile_assets

    job = defs.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(
        instance=instance,
        asset_selection=[reconcile_assets.ASSETS[name].key for name in target.split(",")],
        run_config=QUIET,
        raise_on_error=False,
        **extra,
    )


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    import dagster as dg

    from dagster_joblease.dagster import JobLeaseResource
    from tests.dagster import reconcile_assets

    target, *keys = argv
    resource = JobLeaseResource(
        deployment=os.environ.get(DEPLOYMENT_ENV), held_wait_ms=int(os.environ.get("JOBLEASE_RC_WAIT", "0"))
    )
    extra: dict[str, Any] = (
        {"partition_key": keys[0]}
        if len(keys) == 1
        else {
            "tags": {
                "dagster/asset_partition_range_start": keys[0],
                "dagster/asset_partition_range_end": keys[1],
            }
        }
    )
    result = run(dg.DagsterInstance.get(), reconcile_assets.definitions(resource), target, extra)
    print(json.dumps({"run_id": result.run_id, "ok": result.success}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
