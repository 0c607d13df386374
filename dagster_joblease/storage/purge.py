"""Deleting old rows in short batches: the mechanism behind ``leases purge`` and ``outbox purge`` (the
store modules say which rows; :mod:`dagster_joblease.admin` says whether the window is allowed)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from dagster_joblease.storage.clock import db_now_plus_ms
from dagster_joblease.storage.engine import translate_errors

__all__ = ["PURGE_BATCH", "cutoff", "in_batches"]

PURGE_BATCH = 5_000


def cutoff(window_ms: int) -> sa.ScalarSelect[Any]:
    """Database now minus ``window_ms``, as a scalar subquery: evaluated once per statement, so the
    comparison is an index range condition (``clock_timestamp()`` itself is volatile, which would make
    the planner read the whole table rather than the finished or sent rows' partial index)."""
    return sa.select(db_now_plus_ms(sa.literal(-window_ms, sa.BigInteger()))).scalar_subquery()


def in_batches(
    engine: sa.Engine, table: sa.Table, where: sa.ColumnElement[bool], action: str, *, dry_run: bool
) -> int:
    """Delete the rows of ``table`` matching ``where`` in batches of :data:`PURGE_BATCH`, each its own
    transaction, so a large purge never holds long locks; how many (or, ``dry_run``, how many would be).

    The DELETE repeats ``where`` on the rows it deletes, not just their ids: under READ COMMITTED a row
    that changed after the batch was selected (a FAIL lease reclaimed to RUNNING) is re-checked against
    its new version, and skipped. Matching on ``id`` alone would delete a live lease (two holders).
    """
    ids = sa.select(table.c.id).where(where)
    with translate_errors(action):
        if dry_run:
            with engine.connect() as conn:
                return int(conn.execute(sa.select(sa.func.count()).select_from(ids.subquery())).scalar_one())
        total = 0
        while True:
            with engine.begin() as conn:
                # correlate(None): the subquery reads the same table the DELETE targets.
                batch = ids.limit(PURGE_BATCH).correlate(None).scalar_subquery()
                deleted = conn.execute(sa.delete(table).where(table.c.id.in_(batch), where)).rowcount
            total += deleted
            if deleted < PURGE_BATCH:
                return total
