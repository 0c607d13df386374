"""The one fast path: a statement spelt once in SQLAlchemy Core, run on the psycopg connection itself.

A :class:`Query` is a statement compiled once for psycopg (positional ``%s`` parameters, their order
known), beside the SQLAlchemy statement it came from. The store modules (:mod:`.leases`,
:mod:`.outbox`, ...) build their queries at import and run them through one of two doors, which give
the same :class:`Statements` whatever the database:

* :func:`statements` (``with driver.statements(engine, "acquire a lease") as db:``): statements that
  are atomic on their own (claims, heartbeats, set writes). On PostgreSQL with psycopg they run on the
  library's own autocommit connections kept beside the engine's pool (no checkout, reset or autocommit
  switch per call: :mod:`dagster_joblease.storage.autocommit`), prepared on the server. On SQLite the
  block is one ``BEGIN IMMEDIATE`` transaction through SQLAlchemy.
* :func:`in_transaction` (``db = driver.in_transaction(callers_transaction(connection))``): the caller's
  own transaction. On PostgreSQL with psycopg the statements run on its driver connection, with cursors
  of our own (one per query and thread, kept on the connection and reused by later calls): tuple rows
  whatever the connection's row factory, ``%s`` placeholders whatever its cursor factory (``RawCursor``,
  ``ClientCursor``), and results read with ``fetchall`` rather than ``description``, so psycopg's
  pipeline mode gets the same answers.

Rows come back as tuples (``Row`` objects on the SQLAlchemy side, which index and unpack alike), in
the order the statement names its columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import psycopg
import sqlalchemy as sa
from psycopg.rows import tuple_row
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from dagster_joblease import errors
from dagster_joblease.storage.autocommit import AutocommitConnections, autocommit_connections
from dagster_joblease.storage.engine import first_line, is_psycopg, translate_errors, translated
from dagster_joblease.storage.transaction import CallersTransaction

__all__ = ["Query", "Statements", "in_transaction", "query", "statements"]

_PSYCOPG = psycopg_dialect.dialect(paramstyle="format")  # type: ignore[no-untyped-call]


@dataclasses.dataclass(frozen=True, eq=False)
class Query:
    """One statement: its SQLAlchemy form per dialect, and its PostgreSQL form compiled for psycopg.

    ``sql`` takes positional ``%s`` parameters in the order of ``names``; :meth:`args` builds them from
    the same mapping SQLAlchemy takes. ``returns_rows``: the statement has a result (a SELECT, or
    RETURNING), read with ``fetchall`` (never ``cursor.description``, which a pipeline leaves empty).
    """

    postgresql: Any
    sqlite: Any
    sql: str
    names: tuple[str, ...]
    returns_rows: bool
    defaults: Mapping[str, Any]
    #: (position, SQLAlchemy's bind processor for psycopg) of the parameters whose type converts the
    #: value (JSON), so a value binds here exactly as it binds through SQLAlchemy.
    processors: tuple[tuple[int, Any], ...] = ()

    def statement(self, dialect_name: str) -> Any:
        """The SQLAlchemy statement for ``dialect_name`` (the SQLite one for any other dialect)."""
        return self.postgresql if dialect_name == "postgresql" else self.sqlite

    def args(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """The positional parameters of :attr:`sql` from named ones (a bound value's default fills in)."""
        if self.defaults:
            params = {**self.defaults, **params}
        if not self.processors:
            return tuple([params[name] for name in self.names])
        args = [params[name] for name in self.names]
        for position, process in self.processors:
            args[position] = process(args[position])
        return tuple(args)


def query(postgresql: Any, sqlite: Any = None) -> Query:
    """Compile ``postgresql`` (a SQLAlchemy Core statement) once for psycopg; ``sqlite`` is the SQLite
    spelling where it differs (default: the same statement).

    Call it once per statement, at import: the compiled form is what every execution reuses. A
    statement whose SQL depends on its parameters (``IN`` over a list, a literal ``LIMIT``) cannot be a
    query: run it through SQLAlchemy.
    """
    form = postgresql.compile(dialect=_PSYCOPG)
    sql = str(form)
    if "POSTCOMPILE" in sql:
        raise ValueError(f"a query's SQL must not depend on its parameters (expanding IN, literals): {sql}")
    names = tuple(form.positiontup or ())
    defaults = {
        name: bind.value
        for name, bind in form.binds.items()
        if name in names and bind.value is not None and not bind.required
    }
    returns_rows = bool(len(getattr(postgresql, "exported_columns", ())))
    processors = []
    for position, name in enumerate(names):
        kind = form.binds[name].type
        process = kind.dialect_impl(_PSYCOPG).bind_processor(_PSYCOPG)
        if process is not None:
            processors.append((position, process))
    return Query(
        postgresql=postgresql,
        sqlite=postgresql if sqlite is None else sqlite,
        sql=sql,
        names=names,
        returns_rows=returns_rows,
        defaults=defaults,
        processors=tuple(processors),
    )


class Statements(Protocol):
    """Where a store module's queries run: the same three calls on every database."""

    @property
    def dialect(self) -> str:
        """``postgresql`` or ``sqlite``: which spelling of a dialect-specific rule applies."""
        ...

    def rows(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        """Every row of ``query`` (which must return rows)."""
        ...

    def first(self, query: Query, params: Mapping[str, Any]) -> Any | None:
        """The first row of ``query``, or None."""
        ...

    def rowcount(self, query: Query, params: Mapping[str, Any]) -> int:
        """Run ``query`` (which returns no rows); how many rows it changed."""
        ...


class _Alchemy:
    """Statements through a SQLAlchemy connection (SQLite; PostgreSQL on another driver)."""

    __slots__ = ("connection", "dialect")

    def __init__(self, connection: sa.Connection) -> None:
        self.connection = connection
        self.dialect = connection.dialect.name

    def rows(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return list(self.connection.execute(query.statement(self.dialect), params).all())

    def first(self, query: Query, params: Mapping[str, Any]) -> Any | None:
        return self.connection.execute(query.statement(self.dialect), params).first()

    def rowcount(self, query: Query, params: Mapping[str, Any]) -> int:
        return int(self.connection.execute(query.statement(self.dialect), params).rowcount)


def lost_plan(exc: BaseException) -> bool:
    """``exc`` says a statement prepared on the server can no longer run as prepared: its result type
    changed under it (0A000 "cached plan must not change result type": a migration retyped a column it
    returns), or the server session does not have it (26000: a pooler moved the session, or someone ran
    ``DEALLOCATE``). Preparing the statement afresh cures both."""
    if isinstance(exc, psycopg.errors.InvalidSqlStatementName):
        return True
    if not isinstance(exc, psycopg.errors.FeatureNotSupported):
        return False
    # 0A000 has other causes too; this one is raised where PostgreSQL revalidates a cached plan. The
    # function name does not depend on the server's lc_messages, the text does.
    return exc.diag.source_function == "RevalidateCachedQuery" or "cached plan" in str(exc)


def forget_prepared(connection: psycopg.Connection[Any]) -> None:
    """Drop every statement psycopg prepared on ``connection`` (an autocommit connection outside a
    transaction, e.g. one of our own): a transaction rolled back at once makes psycopg clear its cache and
    send ``DEALLOCATE ALL``, so the next execution prepares afresh."""
    with connection.transaction(force_rollback=True):
        pass


#: The error a caller's transaction gets when a statement prepared in it before a schema change can no
#: longer run (the transaction is aborted by then: only the caller can roll it back and run it again).
REPLAN_IN_TRANSACTION = (
    "a statement prepared on this connection before a schema change (`joblease db upgrade` retyped a "
    "column) could not run: {error}. Your transaction is aborted and nothing it wrote "
    "will commit; roll it back and retry the transaction (the rollback drops the stale statements, the "
    "retry prepares them afresh)"
)


class _Driver:
    """Statements on a psycopg connection: positional, tuple rows, one cursor per query.

    ``prepare``: ask psycopg to prepare each statement on the server at its first execution (it
    prepares nothing when the connection's ``prepare_threshold`` is None). ``own``: one of our own
    autocommit connections, where each statement is its own transaction: a statement whose prepared form
    was lost (:func:`lost_plan`) is prepared afresh and run once more (a second loss in a row, a pooler in
    transaction mode, is the ConfigurationError of ``translate_errors``). On a caller's connection the
    failure aborted the caller's transaction: a retyped result becomes a :class:`StorageError` saying to
    retry the transaction (its rollback drops psycopg's prepared statements); a statement missing within
    one transaction can only be a pooler's doing, the ConfigurationError naming ``prepare_threshold``.
    """

    __slots__ = ("_cursors", "connection", "own", "prepare")

    dialect = "postgresql"

    def __init__(self, connection: psycopg.Connection[Any], *, prepare: bool, own: bool = False) -> None:
        self.connection = connection
        self.prepare = prepare
        self.own = own
        self._cursors: dict[Query, psycopg.Cursor[tuple[Any, ...]]] = {}

    def _cursor(self, query: Query) -> psycopg.Cursor[tuple[Any, ...]]:
        # psycopg keeps a cursor's result loaders while it runs the same query again: one per query.
        # psycopg.Cursor itself, not connection.cursor(): the connection's cursor factory may bind
        # differently (RawCursor's $1, ClientCursor's client-side binding), its row factory may be dicts.
        cursor = self._cursors.get(query)
        if cursor is None:
            cursor = self._cursors[query] = psycopg.Cursor(self.connection, row_factory=tuple_row)
        return cursor

    def _run(self, query: Query, params: Mapping[str, Any], fetch: bool) -> Any:
        """Execute ``query``; its rows (``fetch``) or its row count. In a pipeline the result (and any
        error) arrives at the fetch: both are inside the one place that handles a lost plan."""
        cursor = self._cursor(query)
        args = query.args(params)
        try:
            cursor.execute(query.sql, args, prepare=self.prepare)
            return cursor.fetchall() if fetch else cursor.rowcount
        except psycopg.Error as exc:
            if not lost_plan(exc):
                raise
            if not self.own:
                if isinstance(exc, psycopg.errors.InvalidSqlStatementName):
                    raise  # in one transaction: a pooler in transaction mode (translate_errors says so)
                raise errors.StorageError(REPLAN_IN_TRANSACTION.format(error=first_line(exc))) from exc
        # Our own autocommit connection: the failed statement was its own transaction and wrote nothing.
        forget_prepared(self.connection)
        cursor.execute(query.sql, args, prepare=self.prepare)
        return cursor.fetchall() if fetch else cursor.rowcount

    def rows(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        rows: list[Any] = self._run(query, params, True)
        return rows

    def first(self, query: Query, params: Mapping[str, Any]) -> Any | None:
        rows = self._run(query, params, True)
        return rows[0] if rows else None

    def rowcount(self, query: Query, params: Mapping[str, Any]) -> int:
        return int(self._run(query, params, False))


def statements(engine: sa.Engine, action: str) -> contextlib.AbstractContextManager[Statements]:
    """A place for statements that are atomic on their own, driver errors translated (naming ``action``).

    PostgreSQL with psycopg: one of the engine's own autocommit connections (each statement is its own
    transaction: one round trip), statements prepared on the server. A connection that saw an error is
    closed, not reused. SQLite: one ``BEGIN IMMEDIATE`` transaction for the block (the write lock held
    throughout: SQLite has no row locks). PostgreSQL on another driver: an autocommit SQLAlchemy
    connection.
    """
    if is_psycopg(engine.dialect):
        return _OwnBlock(engine, action)
    return _alchemy_block(engine, action)


class _OwnBlock:
    """:func:`statements` on one of the engine's own autocommit connections (a small class, not a
    generator: every claim and heartbeat enters one)."""

    __slots__ = ("action", "connections", "engine", "handle")

    def __init__(self, engine: sa.Engine, action: str) -> None:
        self.engine = engine
        self.action = action
        self.connections = _connections(engine)
        self.handle: Any = None

    def __enter__(self) -> Statements:
        with translate_errors(self.action):
            self.handle = self.connections.acquire(self.engine)
        return _own(self.handle)

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.connections.release(self.handle)
            return
        self.connections.release(self.handle, discard=True)
        error = translated(exc, self.action)
        if error is not None:
            raise error from exc


@contextlib.contextmanager
def _alchemy_block(engine: sa.Engine, action: str) -> Iterator[Statements]:
    with translate_errors(action):
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                yield _Alchemy(conn.execution_options(isolation_level="AUTOCOMMIT"))
        else:
            with engine.begin() as conn:
                yield _Alchemy(conn)


def _connections(engine: sa.Engine) -> AutocommitConnections:
    return autocommit_connections(engine)


def _own(handle: Any) -> _Driver:
    """The statements of one of our own autocommit connections, kept with it (its cursors are reused)."""
    own: _Driver | None = getattr(handle, "statements", None)
    if own is None:
        own = handle.statements = _Driver(handle.connection, prepare=True, own=True)
    return own


#: Where :func:`in_transaction` keeps a caller's connection's statements (one :class:`_Driver` per thread:
#: psycopg cursors are not thread-safe, its connections are): on the driver connection itself, a cycle
#: freed with it (a registry keyed by the connection would keep it alive: a cursor refers to it).
_CALLERS = "_joblease_statements"
_MAX_THREADS = 64  #: per connection; more threads than that on one connection: start again


def _callers(connection: psycopg.Connection[Any]) -> _Driver:
    """This thread's statements on the caller's ``connection``, made once and reused: a cursor kept per
    query keeps its adapters and result loaders, where a fresh one per call cost about a fifth of an
    enqueue's client CPU (``benchmarks/client.py``'s ``enqueue psycopg``)."""
    kept: dict[int, _Driver] | None = connection.__dict__.get(_CALLERS)
    if kept is None:
        kept = connection.__dict__.setdefault(_CALLERS, {})
    ident = threading.get_ident()
    found = kept.get(ident)
    if found is None:
        if len(kept) >= _MAX_THREADS:
            kept.clear()
        found = kept[ident] = _Driver(connection, prepare=True)
    return found


def in_transaction(target: CallersTransaction) -> Statements:
    """The statements of the caller's transaction (see
    :func:`~dagster_joblease.storage.transaction.callers_transaction`): on its psycopg driver connection
    when there is one, else through its SQLAlchemy connection. Errors are the caller's to translate."""
    if target.driver is not None:
        return _callers(target.driver)
    assert target.connection is not None
    return _Alchemy(target.connection)


def sqlalchemy_statements(connection: sa.Connection) -> Statements:
    """Statements through a SQLAlchemy connection the caller holds (reads in its transaction)."""
    return _Alchemy(connection)
