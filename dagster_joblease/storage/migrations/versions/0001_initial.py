"""Initial schema: lease, outbox and inbox tables.

Revision ID: 0001
Revises:
Deploy: before the code that uses it (it only creates tables).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _time(name: str, nullable: bool) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "joblease_lease",
        sa.Column("id", _Id, primary_key=True, autoincrement=True),
        sa.Column("lock_key", sa.String(80), nullable=False),
        sa.Column("job_type", sa.String(16), nullable=False),
        sa.Column("code", sa.String(64), nullable=False),
        sa.Column("run_key", sa.String(256), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("owner_token", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("lease_ms", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.String(255), nullable=True),
        _time("created_at", False),
        _time("acquired_at", False),
        _time("heartbeat_at", False),
        _time("expires_at", False),
        _time("finished_at", True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("result", _Json, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_joblease_lease"),
        sa.UniqueConstraint("lock_key", name="uq_joblease_lease_lock_key"),
        sa.CheckConstraint("status IN ('RUNNING', 'SUCCESS', 'FAIL')", name="ck_joblease_lease_status"),
        sa.CheckConstraint("job_type IN ('INITIAL', 'SCHEDULE')", name="ck_joblease_lease_job_type"),
        sa.CheckConstraint(
            "(job_type = 'INITIAL' AND run_key IS NULL) OR (job_type = 'SCHEDULE' AND run_key IS NOT NULL)",
            name="ck_joblease_lease_run_key_by_type",
        ),
        sa.CheckConstraint("attempt >= 1", name="ck_joblease_lease_attempt_positive"),
    )
    op.create_index("ix_joblease_lease_code_run_key", "joblease_lease", ["code", "run_key"])
    op.create_index("ix_joblease_lease_status_finished_at", "joblease_lease", ["status", "finished_at"])

    op.create_table(
        "joblease_outbox",
        sa.Column("id", _Id, primary_key=True, autoincrement=True),
        sa.Column("idempotency_key", sa.String(320), nullable=False),
        sa.Column("topic", sa.String(128), nullable=False),
        sa.Column("payload", _Json, nullable=False),
        sa.Column("payload_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _time("next_attempt_at", False),
        sa.Column("claim_token", sa.String(64), nullable=True),
        _time("claim_expires_at", True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        _time("created_at", False),
        _time("updated_at", False),
        _time("sent_at", True),
        sa.PrimaryKeyConstraint("id", name="pk_joblease_outbox"),
        sa.UniqueConstraint("idempotency_key", name="uq_joblease_outbox_idempotency_key"),
        sa.CheckConstraint("status IN ('PENDING', 'SENT', 'DEAD')", name="ck_joblease_outbox_status"),
        sa.CheckConstraint("attempts >= 0", name="ck_joblease_outbox_attempts_nonnegative"),
    )
    op.create_index(
        "ix_joblease_outbox_due",
        "joblease_outbox",
        ["next_attempt_at", "id"],
        postgresql_where=sa.text("status = 'PENDING'"),
        sqlite_where=sa.text("status = 'PENDING'"),
    )
    op.create_index("ix_joblease_outbox_status_topic", "joblease_outbox", ["status", "topic"])
    op.create_index(
        "ix_joblease_outbox_sent_at",
        "joblease_outbox",
        ["sent_at"],
        postgresql_where=sa.text("status = 'SENT'"),
        sqlite_where=sa.text("status = 'SENT'"),
    )

    op.create_table(
        "joblease_inbox",
        sa.Column("idempotency_key", sa.String(320), nullable=False),
        sa.Column("payload_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lock_token", sa.String(64), nullable=True),
        _time("locked_until", True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("response_body", sa.Text(), nullable=True),
        _time("created_at", False),
        _time("completed_at", True),
        sa.PrimaryKeyConstraint("idempotency_key", name="pk_joblease_inbox"),
        sa.CheckConstraint("status IN ('IN_PROGRESS', 'DONE')", name="ck_joblease_inbox_status"),
    )
    op.create_index("ix_joblease_inbox_completed_at", "joblease_inbox", ["completed_at"])


def downgrade() -> None:
    op.drop_table("joblease_inbox")
    op.drop_table("joblease_outbox")
    op.drop_table("joblease_lease")
