"""Per-key ordering: the outbox row's optional ``ordering_key``, and the index that finds a key's head.

``enqueue_once(..., ordering_key=...)`` (and ``enqueue_many``) store the key; a dispatcher claims a row
that has one only when no row of the same key with a smaller id is PENDING (due, retry-scheduled or in
flight) or DEAD (:func:`dagster_joblease.storage.outbox.head_of_its_key`). That test is one probe of
``ix_joblease_outbox_ordering`` (ordering_key, id) WHERE the row has a key and is PENDING or DEAD: rows
without a key (every row written before this revision) have no entry in it, and a key's entries leave the
predicate as its rows are sent, so the index holds the live rows of keyed traffic only.

Locks, with workers running:

* ``ADD COLUMN ordering_key`` (nullable, no default): a catalog change, no table rewrite; a brief ACCESS
  EXCLUSIVE lock (it waits for the transactions using the table, and they wait behind it, for a moment).
* ``CREATE INDEX``: Alembic runs every migration in the one transaction ``migrate`` holds (with its
  advisory lock), where ``CREATE INDEX CONCURRENTLY`` cannot run. The plain build holds a SHARE lock on
  joblease_outbox until the migration commits: reads go on, enqueues, claims and outcome writes wait for
  the build. The index only covers keyed rows, and before this revision there are none, so the build
  reads the table once and writes nothing: about a second per million rows on a 2-CPU machine. On a
  large table, build it by hand first, without blocking writers::

      CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_joblease_outbox_ordering ON joblease_outbox
          (ordering_key, id) WHERE ordering_key IS NOT NULL AND status IN ('PENDING', 'DEAD');

  (and ``ALTER TABLE joblease_outbox ADD COLUMN ordering_key VARCHAR(128)`` before it); the migration
  then skips both (``IF NOT EXISTS``).

SQLite: ``ALTER TABLE ADD COLUMN`` and ``CREATE INDEX`` in the migration's write transaction; SQLite
serializes writers anyway.

Revision ID: 0008
Revises: 0007
Deploy: before the code (this code's claim and enqueue name the column; older code never reads it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: The predicate of the index and of the claim's probe (statuses as literals: a generic plan proves them).
LIVE_KEYED = "ordering_key IS NOT NULL AND status IN ('PENDING', 'DEAD')"


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("ALTER TABLE joblease_outbox ADD COLUMN IF NOT EXISTS ordering_key VARCHAR(128)")
    elif "ordering_key" not in {c["name"] for c in sa.inspect(bind).get_columns("joblease_outbox")}:
        op.add_column("joblease_outbox", sa.Column("ordering_key", sa.String(128), nullable=True))
    op.create_index(
        "ix_joblease_outbox_ordering",
        "joblease_outbox",
        ["ordering_key", "id"],
        postgresql_where=sa.text(LIVE_KEYED),
        sqlite_where=sa.text(LIVE_KEYED),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_joblease_outbox_ordering", table_name="joblease_outbox")
    op.execute("ALTER TABLE joblease_outbox DROP COLUMN ordering_key")  # SQLite 3.35+ drops in place
