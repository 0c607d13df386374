"""Alembic environment: runs only on a connection handed over by dagster_joblease.storage.migrate."""

from __future__ import annotations

from alembic import context

from dagster_joblease.storage import schema

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "dagster-joblease migrations run through `joblease db upgrade` or dagster_joblease.migrate(engine), "
        "not the alembic command line"
    )

context.configure(
    connection=connection,
    target_metadata=schema.metadata,
    version_table=schema.VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
    transactional_ddl=True,
)
with context.begin_transaction():
    context.run_migrations()
