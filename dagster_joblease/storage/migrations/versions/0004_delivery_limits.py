"""Delivery limits: a limit group table (global caps, rate, pauses) and three outbox columns.

``joblease_outbox`` gains ``first_attempt_at`` (the start of the key's retention window at the
downstream), ``claim_group`` (the limit group an unexpired claim holds capacity of, with a partial index
over non-NULL values) and ``deferrals`` (attempts a downstream's ``Retry-After`` pause deferred without
counting them). ``joblease_route_group`` holds one row per limit group.

Rows written before this migration keep working: a row already attempted gets ``first_attempt_at =
created_at``, the earliest its first attempt can have been, so a retention window never measures from later
than the truth (a row can only be dead-lettered early, never re-sent after the downstream forgot its key).

Revision ID: 0004
Revises: 0003
Deploy: before the code that uses it (it adds a table and nullable or defaulted columns; older code ignores
them).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_Time = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("joblease_outbox") as batch:
        batch.add_column(sa.Column("first_attempt_at", _Time, nullable=True))
        batch.add_column(sa.Column("claim_group", sa.String(255), nullable=True))
        batch.add_column(sa.Column("deferrals", sa.Integer(), nullable=False, server_default=sa.text("0")))
    op.execute("UPDATE joblease_outbox SET first_attempt_at = created_at WHERE attempts > 0")
    op.create_index(
        "ix_joblease_outbox_claim_group",
        "joblease_outbox",
        ["claim_group", "claim_expires_at"],
        postgresql_where=sa.text("claim_group IS NOT NULL"),
        sqlite_where=sa.text("claim_group IS NOT NULL"),
    )
    op.create_table(
        "joblease_route_group",
        sa.Column("limit_group", sa.String(255), nullable=False),
        sa.Column("max_in_flight", sa.Integer(), nullable=True),
        sa.Column("max_in_flight_until", _Time, nullable=True),
        sa.Column("rate", sa.Integer(), nullable=True),
        sa.Column("rate_until", _Time, nullable=True),
        sa.Column("rate_next_at", _Time, nullable=True),
        sa.Column("paused_until", _Time, nullable=True),
        sa.Column("pause_reason", sa.Text(), nullable=True),
        sa.Column("failures", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("updated_at", _Time, nullable=False),
        sa.PrimaryKeyConstraint("limit_group", name="pk_joblease_route_group"),
        sa.CheckConstraint(
            "max_in_flight IS NULL OR max_in_flight >= 1",
            name="ck_joblease_route_group_max_in_flight_positive",
        ),
        sa.CheckConstraint("rate IS NULL OR rate >= 1", name="ck_joblease_route_group_rate_positive"),
    )


def downgrade() -> None:
    op.drop_table("joblease_route_group")
    op.drop_index("ix_joblease_outbox_claim_group", table_name="joblease_outbox")
    with op.batch_alter_table("joblease_outbox") as batch:
        batch.drop_column("deferrals")
        batch.drop_column("claim_group")
        batch.drop_column("first_attempt_at")
