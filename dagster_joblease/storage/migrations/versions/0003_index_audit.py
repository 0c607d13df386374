"""Index audit: the two full secondary indexes that every claim and every enqueue wrote are split by state.

``ix_joblease_lease_status_finished_at`` (status, finished_at) held every lease row, however long finished,
for two kinds of reader: ``leases purge`` (finished rows, by ``finished_at``) and the readers of live rows
(reconciliation's FAIL/RUNNING rows of a code, ``leases list --status running|fail`` and ``--expired``).
It becomes two partial indexes:

* ``ix_joblease_lease_live`` on ``code`` WHERE ``status IN ('RUNNING', 'FAIL')``: what claims write, and
  it holds the live rows only, so it stays a few pages however many leases have finished;
* ``ix_joblease_lease_finished_at`` on ``finished_at`` WHERE ``finished_at IS NOT NULL``: written when a
  lease finishes, never by a claim (a claim leaves ``finished_at`` NULL, a reclaim resets it). Any
  ``finished_at < x`` implies the predicate, so a generic prepared plan can use it too.

``ix_joblease_outbox_status_topic`` (status, topic) held every outbox row, so each enqueue (a PENDING row)
wrote an entry; pending rows are read through ``ix_joblease_outbox_due``, and what needed (status, topic)
is the dead-row readers (``delivery_health``, the ``no_dead_rows`` check, ``outbox requeue --topic``,
``outbox list --status dead``). It becomes ``ix_joblease_outbox_dead`` on ``topic`` WHERE
``status = 'DEAD'``, written when a row is dead-lettered: an enqueue writes one index fewer.

``outbox stats`` (counts by topic and status) reads the table instead of that index afterwards: an admin
command, timed at scale by ``benchmarks/indexes.py``.

Existing rows keep working: the new indexes are built from the rows already there. On a large table,
build them by hand first with ``CREATE INDEX CONCURRENTLY`` under the same names and predicates
(docs/operations.md, "Indexes"); the migration then skips them (``IF NOT EXISTS``) and drops the old ones.

Revision ID: 0003
Revises: 0002
Deploy: before or after the code (no query's result changes; only which index serves it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_joblease_lease_live",
        "joblease_lease",
        ["code"],
        postgresql_where=sa.text("status IN ('RUNNING', 'FAIL')"),
        sqlite_where=sa.text("status IN ('RUNNING', 'FAIL')"),
        if_not_exists=True,
    )
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
    op.drop_index("ix_joblease_lease_live", table_name="joblease_lease")
