"""A set of rows sent as a fixed number of statement parameters, so a statement over N keys is compiled
once and costs one round trip whatever N is.

The rows travel as one JSON array of row arrays (SQLite binds at most 32,766 parameters per statement;
psycopg's array dumper is slow in Python), read back in the database as rows.
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
    """A FROM clause named ``k`` with one row per key and the given (name, type) columns, in the order
    of the rows; bind it with :func:`bind_rows` (one JSON text parameter ``k_rows``).

    PostgreSQL reads it with ``jsonb_array_elements`` (one JSON document parses in a few milliseconds
    where psycopg's Python dumper of a 10,000-element text array takes tens); SQLite with ``json_each``.
    ``joined``: the source is joined with a table. SQLite then reads it as a ``MATERIALIZED`` CTE: its
    planner otherwise guesses json_each small and scans it once per table row (quadratic)."""
    rows_param = sa.bindparam("k_rows", type_=sa.Text())
    fields: list[Any]
    if dialect_name == "postgresql":
        each = sa.func.jsonb_array_elements(sa.cast(rows_param, postgresql.JSONB())).table_valued("value")
        fields = [
            sa.cast(each.c.value.op("->>")(sa.literal_column(str(i))), kind)
            for i, (_, kind) in enumerate(columns)
        ]
    else:
        each = sa.func.json_each(rows_param).table_valued("value")
        fields = [
            sa.type_coerce(sa.func.json_extract(each.c.value, f"$[{i}]"), kind)
            for i, (_, kind) in enumerate(columns)
        ]
    rows = sa.select(
        *(field.label(name) for field, (name, _) in zip(fields, columns, strict=True))
    ).select_from(each)
    if dialect_name == "sqlite" and joined:
        return rows.cte("k").prefix_with("MATERIALIZED")
    return rows.subquery("k")


def bind_rows(dialect_name: str, names: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The parameter of a :func:`rows_source` with columns ``names`` for ``rows`` (tuples in that order)."""
    del dialect_name, names  # one layout for every dialect and column set
    return {"k_rows": json.dumps(rows, separators=(",", ":"))}
