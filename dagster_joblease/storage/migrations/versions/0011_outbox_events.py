"""The CDC hand-over: ``joblease_outbox_event``, events in the shape of Debezium's Outbox Event Router.

``dagster_joblease.cdc.enqueue_event`` writes one row per idempotency key, insert-only, in the caller's
transaction: ``id`` (the key), ``aggregatetype`` (the topic), ``aggregateid`` (the ordering key, else the
key: the Kafka key), ``type`` (the topic), ``payload`` (JSON; jsonb on PostgreSQL), ``tracingspancontext``
(the W3C trace context as java.util.Properties text), ``payload_sha256`` and ``created_at``. A change-data
capture connector reads the INSERTs from the WAL; the dispatcher never reads the table. Retention
(``purge_events``) deletes rows older than a window; the router ignores DELETEs.

Locks: a new table and its index, nothing else touched (no lock on the existing tables).

Revision ID: 0011
Revises: 0010
Deploy: before the code that enqueues events (older code never reads the table).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    op.create_table(
        "joblease_outbox_event",
        sa.Column("id", sa.String(320), nullable=False),
        sa.Column("aggregatetype", sa.String(128), nullable=False),
        sa.Column("aggregateid", sa.String(320), nullable=False),
        sa.Column("type", sa.String(128), nullable=False),
        sa.Column("payload", json, nullable=False),
        sa.Column("tracingspancontext", sa.Text(), nullable=True),
        sa.Column("payload_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_joblease_outbox_event"),
    )
    op.create_index(
        "ix_joblease_outbox_event_created_at",
        "joblease_outbox_event",
        ["created_at"],
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_joblease_outbox_event_created_at", table_name="joblease_outbox_event")
    op.drop_table("joblease_outbox_event")
