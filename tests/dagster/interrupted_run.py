"""A run that is terminated mid-op: ``python -m tests.dagster.interrupted_run DATABASE_URL READY_FILE``.

The leased op signals readiness through a file, then waits; the test sends SIGTERM or SIGINT, as
Dagster's run termination does to a run worker.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path


def main(database_url: str, ready_file: str) -> int:
    warnings.simplefilter("ignore")
    import dagster as dg

    from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_op

    @leased_op(code="t-terminated")
    def wait_for_termination(run: LeasedRun) -> None:
        Path(ready_file).write_text(str(run.lease.id))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)

    @dg.job(partitions_def=dg.DailyPartitionsDefinition(start_date="2024-01-01"))
    def terminated_job() -> None:
        wait_for_termination()

    result = terminated_job.execute_in_process(
        partition_key="2024-01-05",
        resources={"joblease": JobLeaseResource(database_url=database_url, lease_ms=600_000)},
        raise_on_error=False,
    )
    return 0 if result.success else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
