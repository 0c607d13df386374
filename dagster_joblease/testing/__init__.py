"""A fault-injection kit to prove *your* jobs are replay-safe: lost leases, crashes, duplicate deliveries.

- :class:`RecordingDownstream`: the reference receiver in-process; counts POSTs and effects per key, and
  fails, drops or delays the next N requests on demand.
- :func:`reclaim_now`: another holder takes the run over at once, as if the lease had expired.
- :func:`crash_run_exclusive`: SIGKILL a ``run_exclusive`` worker (a real process) at a chosen point and
  see what the database holds; :func:`expire_now` lets the re-run reclaim at once.
- :func:`drain_outbox`: dispatch until nothing is pending.
- :func:`throwaway_database`: a migrated SQLite file, or a PostgreSQL database created and dropped.

Installing the package enables a pytest plugin with the fixtures ``joblease_engine``,
``joblease_database_url``, ``joblease_service`` and ``joblease_downstream``. Nothing here imports Dagster;
the Dagster helper is :func:`dagster_joblease.dagster.testing.run_partition_twice`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dagster_joblease.testing.crash import CrashPoint, CrashResult, crash_point, crash_run_exclusive
from dagster_joblease.testing.database import (
    TEST_PG_URL_ENV,
    clear_joblease_tables,
    throwaway_database,
)
from dagster_joblease.testing.delivery import drain_outbox
from dagster_joblease.testing.leases import expire_now, reclaim_now

if TYPE_CHECKING:
    from dagster_joblease.testing.downstream import RecordingDownstream

__all__ = [
    "TEST_PG_URL_ENV",
    "CrashPoint",
    "CrashResult",
    "RecordingDownstream",
    "clear_joblease_tables",
    "crash_point",
    "crash_run_exclusive",
    "drain_outbox",
    "expire_now",
    "reclaim_now",
    "throwaway_database",
]


def __getattr__(name: str) -> object:
    # RecordingDownstream runs the reference receiver (Starlette, uvicorn: the `receiver` extra): imported
    # on first use, so the rest of the kit works without them.
    if name == "RecordingDownstream":
        from dagster_joblease.testing.downstream import RecordingDownstream

        return RecordingDownstream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
