"""A launcher process for the tests: ``python -m tests.dagster.launcher LABEL JOB TAGS_JSON DAY...``.

It runs one Dagster run per partition on the instance in ``$DAGSTER_HOME`` (PostgreSQL storage), as a
backfill daemon or a schedule would, and prints one JSON line per run.
"""

from __future__ import annotations

import json
import sys
import warnings


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    import dagster as dg

    from tests.dagster import jobs

    label, job_name, tags_json, *days = argv
    job = jobs.defs.resolve_job_def(job_name)
    instance = dg.DagsterInstance.get()
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    for day in days:
        tags = {k.replace("{day}", day): v.replace("{day}", day) for k, v in json.loads(tags_json).items()}
        result = job.execute_in_process(
            partition_key=day, instance=instance, run_config=quiet, tags=tags, raise_on_error=False
        )
        print(
            json.dumps({"label": label, "day": day, "run_id": result.run_id, "ok": result.success}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
