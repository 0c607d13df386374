"""Alembic migrations run in code, on the caller's engine, with the package's own version table.

``migrate`` is idempotent and safe when several processes call it at once: PostgreSQL serializes them
with a transaction-scoped advisory lock, SQLite with ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from sqlalchemy.dialects import postgresql

from dagster_joblease import errors
from dagster_joblease.storage import engine as engine_module
from dagster_joblease.storage import schema
from dagster_joblease.storage.engine import APPLICATION_NAME, translate_errors

__all__ = [
    "SchemaDiff",
    "check_schema",
    "current_revision",
    "head_revision",
    "migrate",
    "require_schema",
    "upgrade_warnings",
]

logger = logging.getLogger(__name__)

_MIGRATIONS = Path(__file__).with_name("migrations")
# An arbitrary constant: "joblease" as a 64-bit int, the advisory lock that serializes migrations.
_ADVISORY_LOCK_ID = 0x6A6F626C65617365


def _config(connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def _current(connection: sa.Connection) -> str | None:
    ctx = MigrationContext.configure(connection, opts={"version_table": schema.VERSION_TABLE})
    return ctx.get_current_revision()


def migrate(engine: sa.Engine, revision: str = "head", *, warn: bool = True) -> str | None:
    """Upgrade the joblease tables to ``revision`` (default: the newest). Returns the revision before.

    ``warn``: log :func:`upgrade_warnings`' text (logger ``dagster_joblease.storage.migrate``, WARNING)
    before a migration that retypes columns runs while other sessions of the library are connected: what
    a ``JobLeaseResource`` that upgrades on first use, in a deployment whose workers are running, says.
    ``joblease db upgrade`` prints it itself and passes False.
    """
    with translate_errors("migrate the joblease schema"), engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _ADVISORY_LOCK_ID})
        before = _current(connection)
        if warn:
            for warning in _warnings(connection, before, revision):
                logger.warning("%s", warning, extra={"action": "upgrade_warning"})
        command.upgrade(_config(connection), revision)
        return before


def retyping_revisions(current: str | None, target: str = "head") -> list[str]:
    """The revisions an upgrade from ``current`` to ``target`` would run that retype columns (their
    module says ``RETYPES_COLUMNS = True``), oldest first."""
    script = ScriptDirectory.from_config(_config())
    pending = script.iterate_revisions(target, current)  # newest first, ``current`` left out
    return [rev.revision for rev in reversed(list(pending)) if getattr(rev.module, "RETYPES_COLUMNS", False)]


#: Other sessions of the library on this database (its engines name themselves APPLICATION_NAME).
_OTHER_SESSIONS = sa.text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND application_name = :name AND pid <> pg_backend_pid()"
)


def upgrade_warnings(engine: sa.Engine, target: str = "head") -> list[str]:
    """What an operator should know before upgrading ``engine``'s database to ``target``: on PostgreSQL,
    when a pending migration retypes columns while other sessions of the library are connected (workers,
    dispatchers, receivers; seen in ``pg_stat_activity`` by their ``application_name``). Empty when
    there is nothing to say."""
    if engine.dialect.name != "postgresql":
        return []
    with translate_errors("read the joblease schema revision"), engine.connect() as connection:
        return _warnings(connection, _current(connection), target)


def _warnings(connection: sa.Connection, current: str | None, target: str) -> list[str]:
    if connection.dialect.name != "postgresql" or current is None:
        return []  # a fresh install creates the tables: nothing to rewrite, nobody using them yet
    try:
        retyping = retyping_revisions(current, target)
    except RevisionError:
        return []  # not an upgrade (the target is behind): Alembic's own error says so
    if not retyping:
        return []
    others = int(connection.execute(_OTHER_SESSIONS, {"name": APPLICATION_NAME}).scalar_one())
    if not others:
        return []
    return [
        f"{others} other session(s) of dagster-joblease (application_name {APPLICATION_NAME!r}) are "
        f"connected and migration {', '.join(retyping)} retypes columns: it holds an ACCESS EXCLUSIVE lock "
        "on the tables it rewrites (claims, enqueues, inbox keys and deliveries wait meanwhile; "
        "docs/operations.md says for how long). Workers of this version prepare their statements again and "
        "go on; a worker of an older dagster-joblease may fail statements with 'cached plan must not change "
        "result type' until it reconnects: restart those after the upgrade."
    ]


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the database is at, or ``None`` when the joblease tables were never installed."""
    with translate_errors("read the joblease schema revision"), engine.connect() as connection:
        return _current(connection)


@dataclasses.dataclass(frozen=True)
class SchemaDiff:
    """How the live schema differs from the package's models (empty when it matches)."""

    db_revision: str | None
    head_revision: str
    differences: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.db_revision == self.head_revision and not self.differences


def _include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    # Only our own tables: the database may hold Dagster's storage or the host application's tables.
    if type_ == "table":
        return name in schema.metadata.tables
    return True


def _compare_type(
    context: MigrationContext,
    inspected_column: sa.Column[Any],
    metadata_column: sa.Column[Any],
    inspected_type: sa.types.TypeEngine[Any],
    metadata_type: sa.types.TypeEngine[Any],
) -> bool | None:
    """Alembic's type comparison, told about 0006's domains: a column of ``schema.PG_DOMAINS`` matches
    when it has its domain over the model's type; any other column, Alembic's own comparison (None)."""
    if context.dialect.name != "postgresql":
        return None
    expected = schema.PG_DOMAINS.get((str(metadata_column.table.name), str(metadata_column.name)))
    if expected is None and not isinstance(inspected_type, postgresql.DOMAIN):
        return None
    if not isinstance(inspected_type, postgresql.DOMAIN) or inspected_type.name != expected:
        return True
    # SQLAlchemy reflects a domain's base type without its length (VARCHAR, not VARCHAR(16)): compare the
    # kind of type, and the length where one was reflected.
    base = inspected_type.data_type
    if base._type_affinity is not metadata_type._type_affinity:
        return True
    length = getattr(base, "length", None)
    return length is not None and length != getattr(metadata_type, "length", None)


def check_schema(engine: sa.Engine) -> SchemaDiff:
    """Compare the live schema with the package's models (Alembic's autogenerate comparison)."""
    with translate_errors("compare the joblease schema"), engine.connect() as connection:
        ctx = MigrationContext.configure(
            connection,
            opts={
                "version_table": schema.VERSION_TABLE,
                "include_object": _include_object,
                "compare_type": _compare_type,
            },
        )
        diffs = compare_metadata(ctx, schema.metadata)
        db_rev = ctx.get_current_revision()
    return SchemaDiff(
        db_revision=db_rev, head_revision=head_revision(), differences=tuple(_describe(d) for d in diffs)
    )


def _describe(diff: Any) -> str:
    if isinstance(diff, list):
        return "; ".join(_describe(d) for d in diff)
    if isinstance(diff, tuple) and diff:
        kind = diff[0]
        rest = [getattr(x, "name", None) or str(x) for x in diff[1:] if x is not None]
        return f"{kind}: " + ", ".join(str(r) for r in rest[:4])
    return str(diff)


def require_schema(engine: sa.Engine) -> None:
    """Raise :class:`SchemaNotAtHeadError` unless the database is at this package's head revision."""
    current = current_revision(engine)
    head = head_revision()
    if current != head:
        raise errors.SchemaNotAtHeadError(
            db_revision=current,
            head_revision=head,
            database=engine_module.describe_database(engine.url),
            advice=engine_module.upgrade_advice(engine.url),
        )
