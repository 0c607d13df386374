"""The holder's heartbeat interval on the lease row (its lease length is already there, ``lease_ms``).

Whoever judges a holder (a waiting run, the reconciliation sensor, ``joblease leases list/show``) measures
"stale" against the interval the *holder* recorded when it claimed, not its own setting: a waiter with a
1 s heartbeat must not declare a holder that renews every 10 s dead after 3 s. ``NULL`` on rows written
before this migration (and by code older than it): they keep the old rule (the judge's own interval).
``0`` means the holder never heartbeats: it is judged by its lease's expiry only.

Revision ID: 0002
Revises: 0001
Deploy: before the code that uses it (it only adds a nullable column; older code keeps working and writes
NULL, which is judged by the old rule).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("joblease_lease") as batch:
        batch.add_column(sa.Column("heartbeat_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("joblease_lease") as batch:
        batch.drop_column("heartbeat_ms")
