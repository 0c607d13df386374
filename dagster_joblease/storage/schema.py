"""The package's tables, as SQLAlchemy Core, on one MetaData with a naming convention.

Statuses are VARCHAR with a named CHECK rather than PostgreSQL ENUMs, which cannot drop values and do
not exist on SQLite. Every name starts with ``joblease_`` so the tables can share a database (even a
schema) with Dagster's own storage or the host application.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

__all__ = [
    "HEAD_REVISION",
    "VERSION_TABLE",
    "inbox_table",
    "lease_table",
    "metadata",
    "outbox_table",
]

#: Alembic's version table for this package, distinct from Dagster's and the host's ``alembic_version``.
VERSION_TABLE = "joblease_alembic_version"
#: The newest migration; ``db check`` compares the database against it.
HEAD_REVISION = "0002"

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# SQLite only autoincrements INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_Time = sa.DateTime(timezone=True)

lease_table = sa.Table(
    "joblease_lease",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("lock_key", sa.String(80), nullable=False),
    sa.Column("job_type", sa.String(16), nullable=False),
    sa.Column("code", sa.String(64), nullable=False),
    sa.Column("run_key", sa.String(256), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("owner_token", sa.String(64), nullable=False),
    sa.Column("attempt", sa.Integer(), nullable=False),
    sa.Column("lease_ms", sa.BigInteger(), nullable=False),
    # The holder's heartbeat interval (0: none, judged by expiry only; NULL: written before 0002).
    sa.Column("heartbeat_ms", sa.BigInteger(), nullable=True),
    sa.Column("holder", sa.String(255), nullable=True),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("acquired_at", _Time, nullable=False),
    sa.Column("heartbeat_at", _Time, nullable=False),
    sa.Column("expires_at", _Time, nullable=False),
    sa.Column("finished_at", _Time, nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    sa.Column("result", _Json, nullable=True),
    sa.UniqueConstraint("lock_key"),
    sa.CheckConstraint("status IN ('RUNNING', 'SUCCESS', 'FAIL')", name="status"),
    sa.CheckConstraint("job_type IN ('INITIAL', 'SCHEDULE')", name="job_type"),
    sa.CheckConstraint(
        "(job_type = 'INITIAL' AND run_key IS NULL) OR (job_type = 'SCHEDULE' AND run_key IS NOT NULL)",
        name="run_key_by_type",
    ),
    sa.CheckConstraint("attempt >= 1", name="attempt_positive"),
    sa.Index("ix_joblease_lease_code_run_key", "code", "run_key"),
    sa.Index("ix_joblease_lease_status_finished_at", "status", "finished_at"),
)

outbox_table = sa.Table(
    "joblease_outbox",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("idempotency_key", sa.String(320), nullable=False),
    sa.Column("topic", sa.String(128), nullable=False),
    sa.Column("payload", _Json, nullable=False),
    sa.Column("payload_sha256", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False),
    sa.Column("next_attempt_at", _Time, nullable=False),
    sa.Column("claim_token", sa.String(64), nullable=True),
    sa.Column("claim_expires_at", _Time, nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    sa.Column("last_status", sa.Integer(), nullable=True),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("updated_at", _Time, nullable=False),
    sa.Column("sent_at", _Time, nullable=True),
    sa.UniqueConstraint("idempotency_key"),
    sa.CheckConstraint("status IN ('PENDING', 'SENT', 'DEAD')", name="status"),
    sa.CheckConstraint("attempts >= 0", name="attempts_nonnegative"),
    # Due rows only: the dispatcher's claim and the sensor's probe stay cheap however many rows were sent.
    sa.Index(
        "ix_joblease_outbox_due",
        "next_attempt_at",
        "id",
        postgresql_where=sa.text("status = 'PENDING'"),
        sqlite_where=sa.text("status = 'PENDING'"),
    ),
    sa.Index("ix_joblease_outbox_status_topic", "status", "topic"),
    sa.Index(
        "ix_joblease_outbox_sent_at",
        "sent_at",
        postgresql_where=sa.text("status = 'SENT'"),
        sqlite_where=sa.text("status = 'SENT'"),
    ),
)

inbox_table = sa.Table(
    "joblease_inbox",
    metadata,
    sa.Column("idempotency_key", sa.String(320), primary_key=True),
    sa.Column("payload_sha256", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("lock_token", sa.String(64), nullable=True),
    sa.Column("locked_until", _Time, nullable=True),
    sa.Column("response_status", sa.Integer(), nullable=True),
    sa.Column("response_body", sa.Text(), nullable=True),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("completed_at", _Time, nullable=True),
    sa.CheckConstraint("status IN ('IN_PROGRESS', 'DONE')", name="status"),
    sa.Index("ix_joblease_inbox_completed_at", "completed_at"),
)
