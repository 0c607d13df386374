"""Bulk set-up for the reconciliation tests at scale: lease rows, runs and materializations written as the
lease service and Dagster write them, in one transaction each instead of one connection per row (Dagster's
PostgreSQL storage opens a connection and commits per run and per event: thousands would take minutes)."""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import time
import uuid
from collections.abc import Sequence

import dagster as dg
import sqlalchemy as sa
from dagster._core.events import DagsterEvent, DagsterEventType, StepMaterializationData
from dagster._core.events.log import EventLogEntry
from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID
from dagster._core.storage.dagster_run import DagsterRun
from dagster._core.storage.runs.schema import RunsTable, RunTagsTable
from dagster._core.storage.runs.sql_run_storage import SqlRunStorage
from dagster._serdes import serialize_value
from dagster._time import get_current_datetime

from dagster_joblease import JobIdentity
from dagster_joblease.dagster.sensors import db_clock
from dagster_joblease.storage.schema import lease_table

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def bulk_leases(
    engine: sa.Engine,
    code: str,
    keys: Sequence[str],
    *,
    ago_s: Sequence[float],
    status: str = "FAIL",
    holder: str = "bulk:1",
) -> None:
    """Finished lease rows (attempt 1, ``status``) whose last activity was ``ago_s[i]`` seconds ago on the
    database clock; an existing row of a key is replaced."""
    now = db_clock(engine)
    rows = []
    for key, ago in zip(keys, ago_s, strict=True):
        at = now - dt.timedelta(seconds=ago)
        rows.append(
            {
                "lock_key": JobIdentity.schedule(code, key).idempotency_key,
                "job_type": "SCHEDULE",
                "code": code,
                "run_key": key,
                "status": status,
                "owner_token": secrets.token_hex(16),
                "attempt": 1,
                "lease_ms": 180_000,
                "heartbeat_ms": 10_000,
                "holder": holder,
                "created_at": at,
                "acquired_at": at,
                "heartbeat_at": at,
                "expires_at": at + dt.timedelta(minutes=3),
                "finished_at": at,
                "last_error": "RuntimeError: boom" if status == "FAIL" else None,
            }
        )
    with engine.begin() as conn:
        conn.execute(sa.delete(lease_table).where(lease_table.c.lock_key.in_([r["lock_key"] for r in rows])))
        for offset in range(0, len(rows), 1_000):
            conn.execute(sa.insert(lease_table), rows[offset : offset + 1_000])


def stored_run(
    job_name: str,
    status: dg.DagsterRunStatus,
    tags: dict[str, str],
    asset_selection: frozenset[dg.AssetKey] | None = None,
) -> DagsterRun:
    return DagsterRun(
        job_name=job_name, run_id=str(uuid.uuid4()), status=status, tags=tags, asset_selection=asset_selection
    )


def add_runs(instance: dg.DagsterInstance, runs: Sequence[DagsterRun]) -> None:
    """Store many runs in one transaction, with exactly the rows ``instance.add_run`` writes."""
    storage = instance.run_storage
    assert isinstance(storage, SqlRunStorage)
    now = get_current_datetime()
    backfill_column = storage.has_backfill_id_column()  # a schema reflection: once, not per run
    values = [
        {
            "run_id": r.run_id,
            "pipeline_name": r.job_name,
            "status": r.status.value,
            "run_body": serialize_value(r),
            "snapshot_id": None,
            "partition": r.tags.get("dagster/partition"),
            "partition_set": r.tags.get("dagster/partition_set"),
            "create_timestamp": now,
            **({"backfill_id": None} if backfill_column else {}),
        }
        for r in runs
    ]
    with storage.connect() as conn:
        conn.execute(RunsTable.insert(), values)
        conn.execute(
            RunTagsTable.insert(),
            [
                {"run_id": r.run_id, "key": k, "value": v}
                for r in runs
                for k, v in r.tags_for_storage().items()
            ],
        )


def materialize(instance: dg.DagsterInstance, asset_key: dg.AssetKey, keys: Sequence[str]) -> None:
    """Runless materializations of ``keys``, stored in one batch (what ``report_runless_asset_event``
    stores, one event per key)."""
    entries = [
        EventLogEntry(  # type: ignore[no-untyped-call]
            error_info=None,
            level=logging.INFO,
            user_message="",
            run_id=RUNLESS_RUN_ID,
            timestamp=time.time(),
            dagster_event=DagsterEvent(
                event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
                job_name=RUNLESS_JOB_NAME,
                event_specific_data=StepMaterializationData(
                    dg.AssetMaterialization(asset_key, partition=key)
                ),
            ),
        )
        for key in keys
    ]
    for offset in range(0, len(entries), 1_000):
        instance.event_log_storage.store_event_batch(entries[offset : offset + 1_000])


def analyze(engine: sa.Engine) -> None:
    """The statistics autovacuum keeps on a real deployment: tables filled in bulk have none, and without
    them PostgreSQL plans Dagster's run-tag joins as nested loops over every run."""
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
