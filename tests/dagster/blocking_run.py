"""A run whose leased op blocks in its own step process: ``python -m tests.dagster.blocking_run DAY READY``.

The run uses the multiprocess executor on the instance in ``$DAGSTER_HOME``, as a deployed run worker
does; the op writes ``<step pid> <run id>`` to READY once it holds the lease, and the test SIGKILLs that
step process (an OOM kill, a lost node) or marks the run canceled while the step lives on.
"""

from __future__ import annotations

import json
import os
import sys
import warnings


def main(day: str, ready_file: str) -> int:
    warnings.simplefilter("ignore")
    import dagster as dg

    from tests.dagster import jobs

    os.environ[jobs.READY_ENV] = ready_file
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    with dg.execute_job(
        dg.reconstructable(jobs.blocking_job),
        dg.DagsterInstance.get(),
        run_config=quiet,
        tags={"dagster/partition": day},
    ) as result:
        print(json.dumps({"run_id": result.run_id, "ok": result.success}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
