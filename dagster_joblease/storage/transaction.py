"""The one rule for writing inside the caller's transaction: which connection styles commit our rows with
the caller's, and which are refused.

Every writer of rows that must commit or roll back together with the caller's domain change (the outbox's
``enqueue_once``, a batch enqueue, a check that reads in that transaction) resolves the connection it was
given with :func:`callers_transaction` and writes only through what it returns. Accepted:

* a SQLAlchemy ``Connection`` in ``engine.begin()``, or from ``engine.connect()`` later committed with
  ``conn.commit()``: if SQLAlchemy has not begun its transaction yet, it is begun here (exactly what its
  autobegin would do on the first ``execute``), so the caller's ``commit()`` commits our row and closing
  without committing rolls it back. On psycopg the caller may then write on the driver connection
  (``driver``): SQLAlchemy's transaction is that driver's transaction. Without this, a write on the
  driver of a connection SQLAlchemy had not begun was committed by nobody: ``commit()`` was a no-op and
  the pool's reset-on-return rolled it back, after the writer had reported success;
* a SQLAlchemy ORM ``Session`` (or ``scoped_session``): its ``session.connection()``, which begins the
  session's transaction; ``session.commit()`` commits the row;
* a psycopg 3 ``Connection`` in a transaction (``with conn.transaction():``), or not in autocommit (its
  implicit transaction; the caller commits).

Refused with :class:`InvalidPayloadError` (field ``connection``) before anything is written: a closed or
invalidated connection; one in autocommit outside a transaction block (``isolation_level="AUTOCOMMIT"``,
a psycopg connection with ``autocommit=True``, a sqlite3 connection that would not begin one), where the
row would commit on its own, apart from the domain change; an ``Engine`` or any other object.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
import sqlalchemy as sa
from psycopg.pq import TransactionStatus

from dagster_joblease import errors
from dagster_joblease.storage.engine import is_psycopg

if TYPE_CHECKING:
    from sqlalchemy import orm

__all__ = ["CallersTransaction", "callers_transaction"]

_IDLE = TransactionStatus.IDLE

_AUTOCOMMIT = (
    "is in autocommit outside a transaction, so the row would commit on its own, apart from your domain "
    "change; {fix}"
)
_FIX_PSYCOPG = "enqueue inside `with conn.transaction():` (or use a connection without autocommit)"
_FIX_SQLALCHEMY = (
    "use `with engine.begin() as conn:` (or engine.connect() + conn.commit()) without "
    "isolation_level='AUTOCOMMIT'"
)


class CallersTransaction(NamedTuple):
    """Where to write so the row commits with the caller's transaction (a tuple: it is built on every
    enqueue, and a frozen dataclass costs more to build than the rest of the rule).

    ``connection``: the SQLAlchemy connection, its transaction begun (None for a plain psycopg connection).
    ``driver``: the psycopg connection to write on directly (the fast path; it is the same transaction as
    ``connection``'s), or None: write through ``connection`` (SQLite, other drivers).
    """

    connection: sa.Connection | None
    driver: psycopg.Connection[Any] | None

    @property
    def dialect_name(self) -> str:
        return "postgresql" if self.connection is None else self.connection.dialect.name


def _refuse(rule: str) -> errors.InvalidPayloadError:
    return errors.InvalidPayloadError("connection", rule)


def _check_psycopg(conn: psycopg.Connection[Any], fix: str) -> psycopg.Connection[Any]:
    if conn.closed:
        raise _refuse("is closed; pass the open connection of your transaction")
    if conn.autocommit and conn.info.transaction_status == _IDLE:
        raise _refuse(_AUTOCOMMIT.format(fix=fix))
    return conn


def _from_sqlalchemy(connection: sa.Connection) -> CallersTransaction:
    if connection.closed or connection.invalidated:
        raise _refuse("is closed or invalidated; pass the open connection of your transaction")
    if connection.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        raise _refuse(_AUTOCOMMIT.format(fix=_FIX_SQLALCHEMY))
    if not connection.in_transaction():
        connection.begin()  # what autobegin does on the first execute; the caller's commit() commits it
    raw = connection.connection.driver_connection
    if is_psycopg(connection.dialect):
        assert isinstance(raw, psycopg.Connection), type(raw)
        # Open, since SQLAlchemy's connection is; autocommit here is the engine's or dialect's setting.
        if raw.autocommit and raw.info.transaction_status == _IDLE:
            raise _refuse(_AUTOCOMMIT.format(fix=_FIX_SQLALCHEMY))
        return CallersTransaction(connection, raw)
    if isinstance(raw, sqlite3.Connection) and (
        getattr(raw, "autocommit", None) is True or (raw.isolation_level is None and not raw.in_transaction)
    ):
        raise _refuse(_AUTOCOMMIT.format(fix=_FIX_SQLALCHEMY))
    return CallersTransaction(connection, None)


def callers_transaction(
    connection: sa.Connection | psycopg.Connection[Any] | orm.Session | orm.scoped_session[Any],
    *,
    clause: sa.ClauseElement | None = None,
) -> CallersTransaction:
    """Resolve ``connection`` (see the module docstring for the accepted styles) or refuse it loudly.

    ``clause`` (e.g. the table written) picks a ``Session``'s bind when it has several. Beginning
    SQLAlchemy's transaction here is harmless even if the write is then refused for its input: it is what
    the next ``execute`` would have done.
    """
    if isinstance(connection, sa.Connection):
        return _from_sqlalchemy(connection)
    if isinstance(connection, psycopg.Connection):
        return CallersTransaction(None, _check_psycopg(connection, _FIX_PSYCOPG))
    from sqlalchemy import orm  # only for the ORM path (not imported by `import sqlalchemy`)

    if isinstance(connection, orm.Session | orm.scoped_session):
        bind_arguments = None if clause is None else {"clause": clause}
        return _from_sqlalchemy(connection.connection(bind_arguments=bind_arguments))
    raise _refuse(
        "must be a SQLAlchemy Connection or a psycopg Connection, or a SQLAlchemy Session (the one "
        f"holding your transaction), got {type(connection).__name__}"
    )
