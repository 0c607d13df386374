"""Deleting old rows in short batches: the mechanism behind ``leases purge`` and ``outbox purge`` (the
store modules say which rows; :mod:`dagster_joblease.admin` says whether the window is allowed and runs
one transaction per batch)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from dagster_joblease.storage.clock import db_now_plus_ms

__all__ = ["PURGE_BATCH", "batch", "cutoff"]

PURGE_BATCH = 5_000


def cutoff(window_ms: int) -> sa.ScalarSelect[Any]:
    """Database now minus ``window_ms``, as a scalar subquery: evaluated once per statement, so the
    comparison is an index range condition (``clock_timestamp()`` itself is volatile, which would make
    the planner read the whole table rather than the finished or sent rows' partial index)."""
    return sa.select(db_now_plus_ms(sa.literal(-window_ms, sa.BigInteger()))).scalar_subquery()


def batch(
    conn: sa.Connection, table: sa.Table, where: sa.ColumnElement[bool], *, dry_run: bool, limit: int
) -> int:
    """Delete at most ``limit`` rows of ``table`` matching ``where`` on ``conn``; how many. ``dry_run``:
    count every matching row instead and delete nothing. The caller commits each batch (a purge runs one
    transaction per batch of :data:`PURGE_BATCH`, so it never holds long locks) and stops after a batch
    short of its limit.

    The DELETE repeats ``where`` on the rows it deletes, not just their ids: under READ COMMITTED a row
    that changed after the batch was selected (a FAIL lease reclaimed to RUNNING) is re-checked against
    its new version, and skipped. Matching on ``id`` alone would delete a live lease (two holders).
    """
    ids = sa.select(table.c.id).where(where)
    if dry_run:
        return int(conn.execute(sa.select(sa.func.count()).select_from(ids.subquery())).scalar_one())
    if limit <= 0:
        return 0
    # correlate(None): the subquery reads the same table the DELETE targets.
    chosen = ids.limit(limit).correlate(None).scalar_subquery()
    return int(conn.execute(sa.delete(table).where(table.c.id.in_(chosen), where)).rowcount)
