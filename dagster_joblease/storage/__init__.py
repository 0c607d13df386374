"""Storage: tables, the database clock, engines and migrations, and every statement on each table (one module
per table: :mod:`~dagster_joblease.storage.leases`, :mod:`~dagster_joblease.storage.outbox`,
:mod:`~dagster_joblease.storage.outbox_events`, :mod:`~dagster_joblease.storage.inbox`,
:mod:`~dagster_joblease.storage.route_groups`).

A storage function runs its statement on what it is given, in one of two calling conventions:

* **Fast paths: ``f(db: Statements, ...)``.** Claiming, renewing and finishing a lease, enqueueing an outbox
  row: statements compiled once at import (:class:`~dagster_joblease.storage.driver.Query`) and run through
  :class:`~dagster_joblease.storage.driver.Statements`, which drives a SQLAlchemy connection's DBAPI
  connection directly, or a caller's raw psycopg connection, in the caller's transaction: no statement is
  compiled per call, and ``enqueue_once`` runs on any connection an application already has. The inbox runs
  the same prepared ``Query`` objects of :mod:`~dagster_joblease.storage.inbox` on its async drivers too
  (``Statements`` is synchronous).
* **Operator reads and writes: ``f(conn: sa.Connection, ...)``.** Listing, counting, requeueing, purging,
  reconciliation's pages: statements whose shape depends on their filters, built per call and run on the
  caller's SQLAlchemy connection.

Storage never opens a connection or a transaction of its own: the caller (``admin``, ``delivery_status``, the
services) opens it and decides what one transaction holds. A purge, for one, is a storage function that
deletes one batch on the connection it is given; :mod:`dagster_joblease.admin` runs it one transaction per
batch. SQL fragments shared between statements (a predicate, the database clock) are expressions, not
statements.

One function takes an engine, and says why: :func:`~dagster_joblease.storage.route_groups.paused_now`, the
dispatcher's frequent read of other dispatchers' pauses, runs outside any transaction of the caller's and
picks its connection by driver (on psycopg one prepared statement on the library's own autocommit
connections, which only :func:`~dagster_joblease.storage.driver.statements` hands out; elsewhere a plain
read, since ``statements`` on SQLite would take the write lock for it).
"""

from __future__ import annotations

from dagster_joblease.storage.engine import (
    DATABASE_URL_ENV,
    create_engine,
    default_sqlite_url,
    redact_url,
)
from dagster_joblease.storage.migrate import (
    SchemaDiff,
    check_schema,
    current_revision,
    head_revision,
    migrate,
    require_schema,
    upgrade_warnings,
)
from dagster_joblease.storage.schema import (
    inbox_table,
    lease_table,
    metadata,
    outbox_table,
    route_group_table,
)

__all__ = [
    "DATABASE_URL_ENV",
    "SchemaDiff",
    "check_schema",
    "create_engine",
    "current_revision",
    "default_sqlite_url",
    "head_revision",
    "inbox_table",
    "lease_table",
    "metadata",
    "migrate",
    "outbox_table",
    "route_group_table",
    "redact_url",
    "require_schema",
    "upgrade_warnings",
]
