"""Inbox answers and fencing: a stored answer's headers and binary body, and the key's fencing number.

The ASGI middleware (``dagster_joblease.inbox.InboxMiddleware``) stores what the wrapped app answered:
its status, the headers it names and its body as bytes. ``response_headers`` holds the headers (a JSON
array of ``[name, value]`` pairs), ``response_content`` a binary body (``response_body`` keeps holding a
text body, as the ``Inbox.process`` API returns one). ``fence`` is the highest fencing number (a lease's
``attempt``, sent in the ``Fencing-Token`` header) the inbox accepted for the key: a request with a lower
one is refused (409), so a stale lease holder that woke up after a reclaim is told so.

All three columns are nullable and added without a default: no table rewrite, a brief ACCESS EXCLUSIVE
lock only.

Revision ID: 0007
Revises: 0006
Deploy: before the code (older code never reads or writes these columns).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("joblease_inbox") as batch:
        batch.add_column(sa.Column("response_headers", sa.Text(), nullable=True))
        batch.add_column(sa.Column("response_content", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("fence", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("joblease_inbox") as batch:
        batch.drop_column("fence")
        batch.drop_column("response_content")
        batch.drop_column("response_headers")
