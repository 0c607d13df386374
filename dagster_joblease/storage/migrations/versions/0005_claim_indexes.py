"""Claim indexes: a new claim no longer writes the full (code, run_key) index.

Every claim inserted an entry into ``ix_joblease_lease_code_run_key`` (code, run_key), which held every
lease row, however long finished. Its readers look up a code's rows of any status: reconciliation's
catch-up (which run keys of a code have a row), ``leases list --code``, ``leases show CODE`` (the count of
its SCHEDULE rows) and the near-match hint of a lookup that found nothing. The live rows of a code are
already in ``ix_joblease_lease_live`` (code, WHERE status IN ('RUNNING', 'FAIL')), which a claim writes
anyway; only the succeeded rows need another index. So the full index becomes
``ix_joblease_lease_succeeded`` on (code, run_key) WHERE ``status = 'SUCCESS'``: written when a lease
succeeds (a finish writes an entry in every index whose predicate it meets, as it did in the full one),
never by a claim, a reclaim or a failure. Those readers ask for ``status IN ('RUNNING', 'FAIL') OR status
= 'SUCCESS'`` besides the code (every row, by the status CHECK), which PostgreSQL reads as a BitmapOr of
the two partial indexes (``benchmarks/indexes.py`` prints the plans).

Existing rows keep working: the new index is built from the rows already there. On a large table, build
it by hand first with ``CREATE INDEX CONCURRENTLY ix_joblease_lease_succeeded ON joblease_lease (code,
run_key) WHERE status = 'SUCCESS'`` (docs/operations.md, "Indexes"); the migration then skips it
(``IF NOT EXISTS``) and drops the old one.

Revision ID: 0005
Revises: 0004
Deploy: before the code (older code's queries by code then read the table instead of an index: correct,
slower at scale; the new code's queries are served by the new indexes only once they exist).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_joblease_lease_succeeded",
        "joblease_lease",
        ["code", "run_key"],
        postgresql_where=sa.text("status = 'SUCCESS'"),
        sqlite_where=sa.text("status = 'SUCCESS'"),
        if_not_exists=True,
    )
    op.drop_index("ix_joblease_lease_code_run_key", table_name="joblease_lease")


def downgrade() -> None:
    op.create_index("ix_joblease_lease_code_run_key", "joblease_lease", ["code", "run_key"])
    op.drop_index("ix_joblease_lease_succeeded", table_name="joblease_lease")
