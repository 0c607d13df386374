"""Trace context on every outbox row: the W3C ``traceparent`` and ``tracestate`` of the span that enqueued it.

``enqueue_once`` / ``enqueue_many`` write them in the same INSERT as the row when an OpenTelemetry span is
active (:mod:`dagster_joblease.tracing`); the dispatcher links its send span to them and carries them in
the message's headers, so the consumer continues the producer's trace. Rows without a trace (no span
active, OpenTelemetry not installed, every row written before this revision) hold NULL.

Locks, with workers running: two ``ADD COLUMN`` of nullable columns without a default, a catalog change
each (no table rewrite, no index); a brief ACCESS EXCLUSIVE lock on joblease_outbox that waits for the
transactions using the table (and they wait behind it, for a moment).

SQLite: ``ALTER TABLE ADD COLUMN`` in the migration's write transaction.

Revision ID: 0010
Revises: 0009
Deploy: before the code (this code's enqueue names the columns when a span is active, and its claim
returns them; older code never reads them).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

#: The columns and their lengths (dagster_joblease.storage.schema.TRACEPARENT_LENGTH / TRACESTATE_LENGTH).
COLUMNS = (("traceparent", 128), ("tracestate", 512))


def upgrade() -> None:
    bind = op.get_bind()
    existing = {c["name"] for c in sa.inspect(bind).get_columns("joblease_outbox")}
    for name, length in COLUMNS:
        if bind.dialect.name == "postgresql":
            op.execute(f"ALTER TABLE joblease_outbox ADD COLUMN IF NOT EXISTS {name} VARCHAR({length})")
        elif name not in existing:
            op.add_column("joblease_outbox", sa.Column(name, sa.String(length), nullable=True))


def downgrade() -> None:
    for name, _length in reversed(COLUMNS):
        op.execute(f"ALTER TABLE joblease_outbox DROP COLUMN {name}")  # SQLite 3.35+ drops in place
