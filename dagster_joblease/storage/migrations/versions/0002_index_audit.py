"""Index audit: the two secondary indexes that every claim and every enqueue paid for become partial.

``ix_joblease_lease_status_finished_at`` (status, finished_at) held every lease row, so each claim's
INSERT (a RUNNING row, ``finished_at`` NULL) wrote an entry no query needs: the only reader by
``finished_at`` is ``leases purge``, which looks for finished rows. It becomes
``ix_joblease_lease_finished_at`` on ``finished_at`` WHERE ``finished_at IS NOT NULL`` (a RUNNING row never
has one: a claim leaves it NULL and a reclaim resets it), written when a lease finishes, not when it is
claimed. Any ``finished_at < x`` comparison implies the predicate, so the planner uses it even in a
generic prepared plan.

``ix_joblease_outbox_status_topic`` (status, topic) held every outbox row, so each enqueue (a PENDING row)
wrote an entry; pending rows are read through ``ix_joblease_outbox_due``, and what needed (status, topic)
is the dead-row readers (``delivery_health``, the ``no_dead_rows`` check, ``outbox requeue --topic``,
``outbox list --status dead``). It becomes ``ix_joblease_outbox_dead`` on ``topic`` WHERE
``status = 'DEAD'``, written when a row is dead-lettered.

Listing RUNNING leases (``leases list --status running`` / ``--expired``) and ``outbox stats`` read the
table instead of an index afterwards: admin commands, measured at 1,000,000 rows in
``benchmarks/indexes.py``; no claim or enqueue pays for them any more.

Existing rows keep working: the new indexes are built from the rows already there. On a large table,
build them by hand first with ``CREATE INDEX CONCURRENTLY`` under the same names and predicates; the
migration then only drops the old ones (``IF NOT EXISTS``).

Revision ID: 0002
Revises: 0001
Deploy: before or after the code (no query's result changes; only which index serves it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_joblease_lease_finished_at",
        "joblease_lease",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
        sqlite_where=sa.text("finished_at IS NOT NULL"),
        if_not_exists=True,
    )
    op.drop_index("ix_joblease_lease_status_finished_at", table_name="joblease_lease")
    op.create_index(
        "ix_joblease_outbox_dead",
        "joblease_outbox",
        ["topic"],
        postgresql_where=sa.text("status = 'DEAD'"),
        sqlite_where=sa.text("status = 'DEAD'"),
        if_not_exists=True,
    )
    op.drop_index("ix_joblease_outbox_status_topic", table_name="joblease_outbox")


def downgrade() -> None:
    op.create_index("ix_joblease_outbox_status_topic", "joblease_outbox", ["status", "topic"])
    op.drop_index("ix_joblease_outbox_dead", table_name="joblease_outbox")
    op.create_index("ix_joblease_lease_status_finished_at", "joblease_lease", ["status", "finished_at"])
    op.drop_index("ix_joblease_lease_finished_at", table_name="joblease_lease")
