"""The database clock, the same on every node: SQL expressions for "now" and "now plus N ms".

Two nodes that must agree on time (lease expiry, claim expiry, backoff) compare against the database's
clock, never their own. SQLite's CURRENT_TIMESTAMP has whole-second resolution, so SQLite uses
``strftime('%f')`` (milliseconds) in the same text layout SQLAlchemy stores.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

__all__ = ["claim_now", "db_now", "db_now_plus_ms", "ms_until", "readable_ts"]

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"


class db_now(FunctionElement[Any]):
    """The database's current time (timestamp with time zone on PostgreSQL)."""

    type = sa.DateTime(timezone=True)
    inherit_cache = True


@compiles(db_now, "postgresql")
def _db_now_pg(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # clock_timestamp(), not now(): now() is frozen at transaction start, which would shorten a lease
    # taken late in a long transaction.
    return "clock_timestamp()"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return _SQLITE_NOW


class claim_now(FunctionElement[Any]):
    """The database clock as one claim statement reads it, the same value for every row it claims (and
    for ``first_attempt_at`` it stamps): ``now()`` on PostgreSQL (its transaction's start, never later
    than the claim), the statement's time on SQLite."""

    type = sa.DateTime(timezone=True)
    inherit_cache = True


@compiles(claim_now, "postgresql")
def _claim_now_pg(element: claim_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "now()"


@compiles(claim_now, "sqlite")
def _claim_now_sqlite(element: claim_now, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(db_now(), **kw)


class db_now_plus_ms(FunctionElement[Any]):
    """The database's current time plus a number of milliseconds (an int or a column)."""

    type = sa.DateTime(timezone=True)
    inherit_cache = True


@compiles(db_now_plus_ms, "postgresql")
def _plus_pg(element: db_now_plus_ms, compiler: SQLCompiler, **kw: Any) -> str:
    (ms,) = list(element.clauses)
    return f"(clock_timestamp() + ({compiler.process(ms, **kw)}) * INTERVAL '1 millisecond')"


@compiles(db_now_plus_ms, "sqlite")
def _plus_sqlite(element: db_now_plus_ms, compiler: SQLCompiler, **kw: Any) -> str:
    (ms,) = list(element.clauses)
    # julianday arithmetic keeps sub-second precision; format back to SQLAlchemy's stored text layout.
    return (
        "strftime('%Y-%m-%d %H:%M:%f', julianday('now') + "
        f"(CAST(({compiler.process(ms, **kw)}) AS REAL) / 86400000.0))"
    )


class ms_until(FunctionElement[Any]):
    """Milliseconds from the database's now until a timestamp column (negative when past)."""

    type = sa.BigInteger()
    inherit_cache = True


@compiles(ms_until, "postgresql")
def _until_pg(element: ms_until, compiler: SQLCompiler, **kw: Any) -> str:
    (col,) = list(element.clauses)
    return f"CAST(EXTRACT(EPOCH FROM ({compiler.process(col, **kw)} - clock_timestamp())) * 1000 AS BIGINT)"


@compiles(ms_until, "sqlite")
def _until_sqlite(element: ms_until, compiler: SQLCompiler, **kw: Any) -> str:
    (col,) = list(element.clauses)
    return f"CAST((julianday({compiler.process(col, **kw)}) - julianday('now')) * 86400000.0 AS INTEGER)"


# Bounds a timestamp read for display is clamped into: a day inside what Python's datetime holds, so a
# conversion to any session time zone stays in range.
_READABLE_MAX = "9999-12-30 00:00:00"
_READABLE_MIN = "0001-01-02 00:00:00"


class readable_ts(FunctionElement[Any]):
    """A timestamp column clamped into Python's datetime range (NULL stays NULL).

    Validation keeps new rows far inside it, but a row written by an older version (an expiry in year
    287453), by hand, or ``infinity`` would make every listing of the table fail to decode; admin reads
    show such a value as the nearest bound instead.
    """

    type = sa.DateTime(timezone=True)
    inherit_cache = True


@compiles(readable_ts, "postgresql")
def _readable_pg(element: readable_ts, compiler: SQLCompiler, **kw: Any) -> str:
    (col,) = list(element.clauses)
    c = compiler.process(col, **kw)
    hi, lo = f"TIMESTAMPTZ '{_READABLE_MAX}+00'", f"TIMESTAMPTZ '{_READABLE_MIN}+00'"
    return f"(CASE WHEN {c} > {hi} THEN {hi} WHEN {c} < {lo} THEN {lo} ELSE {c} END)"


@compiles(readable_ts, "sqlite")
def _readable_sqlite(element: readable_ts, compiler: SQLCompiler, **kw: Any) -> str:
    (col,) = list(element.clauses)
    c = compiler.process(col, **kw)
    hi, lo = f"'{_READABLE_MAX}.000000'", f"'{_READABLE_MIN}.000000'"
    # Text that is not a date SQLite can read (julianday NULL: a year past 9999) reads as the upper bound.
    return (
        f"(CASE WHEN {c} IS NULL THEN NULL WHEN julianday({c}) IS NULL OR julianday({c}) > julianday({hi}) "
        f"THEN {hi} WHEN julianday({c}) < julianday({lo}) THEN {lo} ELSE {c} END)"
    )
