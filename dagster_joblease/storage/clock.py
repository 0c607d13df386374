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

__all__ = ["db_now", "db_now_plus_ms", "ms_until"]

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
