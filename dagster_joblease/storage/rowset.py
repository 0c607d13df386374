"""A set of rows sent as a fixed number of statement parameters, so a statement over N keys is compiled
once and costs one round trip whatever N is.

PostgreSQL receives one array per column, unnested into rows; SQLite (which binds at most 32,766
parameters per statement) one JSON array of row arrays, read with ``json_each``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

__all__ = ["MAX_ROWS", "ROWS_PER_STATEMENT", "bind_rows", "rows_source"]

#: The most rows (keys) one batch call takes (claims, set writes, outbox rows): split larger sets.
MAX_ROWS = 100_000
#: Rows per statement: a larger call runs several statements, in key order.
ROWS_PER_STATEMENT = 10_000


def rows_source(dialect_name: str, columns: Sequence[tuple[str, Any]], *, joined: bool = True) -> Any:
    """A FROM clause named ``k`` with one row per key and the given (name, type) columns; bind it with
    :func:`bind_rows` (``k_<name>`` arrays on PostgreSQL, one JSON text ``k_rows`` on SQLite).

    ``joined``: the source is joined with a table. SQLite then reads it as a ``MATERIALIZED`` CTE: its
    planner otherwise guesses json_each small and scans it once per table row (quadratic)."""
    if dialect_name == "postgresql":
        arrays = [sa.cast(sa.bindparam(f"k_{name}"), postgresql.ARRAY(kind)) for name, kind in columns]
        return (
            sa.func.unnest(*arrays).table_valued(*(sa.column(n, k) for n, k in columns)).render_derived("k")
        )
    each = sa.func.json_each(sa.bindparam("k_rows", type_=sa.Text())).table_valued("value")
    rows = sa.select(
        *(
            sa.type_coerce(sa.func.json_extract(each.c.value, f"$[{i}]"), kind).label(name)
            for i, (name, kind) in enumerate(columns)
        )
    ).select_from(each)
    return rows.cte("k").prefix_with("MATERIALIZED") if joined else rows.subquery("k")


def bind_rows(dialect_name: str, names: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The parameters of a :func:`rows_source` with columns ``names`` for ``rows`` (tuples in that order)."""
    if dialect_name == "postgresql":
        return {f"k_{name}": [row[i] for row in rows] for i, name in enumerate(names)}
    return {"k_rows": json.dumps([list(row) for row in rows], separators=(",", ":"))}
