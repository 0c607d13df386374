"""Storage: tables, the database clock, engines and migrations."""

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
