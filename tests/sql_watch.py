"""Watch the SQL a library call sends, on either path: SQLAlchemy's cursor events (SQLite) or psycopg's
``Cursor.execute`` (PostgreSQL, where the store modules' statements run on the driver connection and
SQLAlchemy's own executions go through psycopg's cursors too, so each statement is seen once)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import event

Hook = Callable[[str], None]


def watch_sql(
    monkeypatch: pytest.MonkeyPatch, engine: sa.Engine, before: Hook, after: Hook | None = None
) -> Callable[[], None]:
    """Call ``before(sql)`` before each statement ``engine``'s work sends and ``after(sql)`` once it
    ended (also on an error); returns a function that stops watching."""
    done = after or (lambda _sql: None)
    if engine.dialect.name == "postgresql":
        real_execute = psycopg.Cursor.execute

        def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            sql = query if isinstance(query, str) else str(query)
            before(sql)
            try:
                return real_execute(self, query, *args, **kwargs)
            finally:
                done(sql)

        monkeypatch.setattr(psycopg.Cursor, "execute", execute)
        return lambda: monkeypatch.setattr(psycopg.Cursor, "execute", real_execute)

    def on_before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        before(statement)

    def on_after(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        done(statement)

    def on_error(context: Any) -> None:
        done(context.statement or "")

    event.listen(engine, "before_cursor_execute", on_before)
    event.listen(engine, "after_cursor_execute", on_after)
    event.listen(engine, "handle_error", on_error)

    def stop() -> None:
        event.remove(engine, "before_cursor_execute", on_before)
        event.remove(engine, "after_cursor_execute", on_after)
        event.remove(engine, "handle_error", on_error)

    return stop


def recorded_sql(monkeypatch: pytest.MonkeyPatch, engine: sa.Engine) -> Iterator[list[str]]:
    """A fixture body: every statement sent while the test runs, in order."""
    sent: list[str] = []
    stop = watch_sql(monkeypatch, engine, sent.append)
    yield sent
    stop()
