"""The outbox status ``SKIPPED``: a person decided this row is never sent (``joblease outbox skip ID``).

Until now a skipped row stayed DEAD (without its ordering key), so it counted as dead forever (the
``no_dead_rows`` check stayed red) and a DEAD row nobody wants sent had no way out but a requeue, which
sends it, or SQL. SKIPPED is terminal for the dispatcher (never claimed), holds no ordering key back (it is
not in ``ix_joblease_outbox_ordering``'s predicate, PENDING or DEAD), is counted apart from DEAD, and
``outbox purge`` deletes it once it was skipped longer ago than its window. This revision only widens the
status rule to admit the value; no row changes.

PostgreSQL: the rule is the domain ``joblease_outbox_status``'s CHECK (0006). The migration drops it and
adds the wider one ``NOT VALID`` (a catalog change: no scan), then ``VALIDATE CONSTRAINT`` checks the rows
already there. Locks, with workers running, all held until the migration commits (one transaction):

* ``ALTER DOMAIN ... DROP/ADD CONSTRAINT``: locks the domain's type only (no table lock); statements that
  write the column meanwhile check the values against the new rule.
* ``ALTER DOMAIN ... VALIDATE CONSTRAINT``: one sequential read of joblease_outbox under a SHARE lock
  (PostgreSQL's validateDomainConstraint): reads go on; enqueues, claims and outcome writes wait until
  the migration commits. The scan only reads (no rewrite, no index build); every row passes, since the
  new rule admits every value the old one did. Measured on a 2-CPU machine (load average about 4): the
  whole migration took 0.13 s on 500,000 outbox rows just written (the table in the server's cache).

SQLite: the rule is a table CHECK in ``CREATE TABLE``, which SQLite cannot alter; the table is rebuilt
(create the new table from the stored ``CREATE TABLE`` with the wider CHECK, copy the rows, drop, rename,
recreate the indexes from their stored SQL) in the migration's write transaction. Fine for the embedded
default; SQLite serializes writers anyway.

Downgrade: SKIPPED rows become what the previous build made of a skip (DEAD, without the ordering key, so
that it holds no key back there), then the narrower rule is put back.

Revision ID: 0009
Revises: 0008
Deploy: before the code (this code writes SKIPPED; older code never does, and counts a SKIPPED row as no
status it knows: not dead, not pending).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

DOMAIN = "joblease_outbox_status"
#: The name PostgreSQL gave 0006's unnamed CHECK on the domain, kept for the wider one.
DOMAIN_CHECK = "joblease_outbox_status_check"
OLD_VALUES = "'PENDING', 'SENT', 'DEAD'"
NEW_VALUES = "'PENDING', 'SENT', 'DEAD', 'SKIPPED'"
TABLE = "joblease_outbox"


def _replace_domain_check(values: str) -> None:
    op.execute(f"ALTER DOMAIN {DOMAIN} DROP CONSTRAINT {DOMAIN_CHECK}")
    op.execute(f"ALTER DOMAIN {DOMAIN} ADD CONSTRAINT {DOMAIN_CHECK} CHECK (VALUE IN ({values})) NOT VALID")
    op.execute(f"ALTER DOMAIN {DOMAIN} VALIDATE CONSTRAINT {DOMAIN_CHECK}")


def _rebuild_sqlite_table(old: str, new: str) -> None:
    """Rebuild the SQLite table with its status CHECK's ``IN (old)`` list made ``IN (new)``; everything else
    (columns, other constraints, indexes) as stored."""
    bind = op.get_bind()
    table_sql = bind.execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :t"), {"t": TABLE}
    ).scalar_one()
    index_sql = [
        str(sql)
        for (sql,) in bind.execute(
            sa.text(
                "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = :t AND sql IS NOT NULL"
            ),
            {"t": TABLE},
        )
    ]
    check = f"status IN ({old})"
    if str(table_sql).count(check) != 1:
        raise RuntimeError(f"{TABLE}: expected one CHECK ({check}) in its CREATE TABLE, found {table_sql!r}")
    rebuilt = str(table_sql).replace(check, f"status IN ({new})")
    head = f'CREATE TABLE "{TABLE}"'
    if not rebuilt.startswith(head):
        raise RuntimeError(f"{TABLE}: unexpected CREATE TABLE {table_sql!r}")
    op.execute(f'CREATE TABLE "{TABLE}_0009"' + rebuilt[len(head) :])
    op.execute(f'INSERT INTO "{TABLE}_0009" SELECT * FROM "{TABLE}"')
    op.execute(f'DROP TABLE "{TABLE}"')
    op.execute(f'ALTER TABLE "{TABLE}_0009" RENAME TO "{TABLE}"')
    for sql in index_sql:
        op.execute(sql)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace_domain_check(NEW_VALUES)
    else:
        _rebuild_sqlite_table(OLD_VALUES, NEW_VALUES)


def downgrade() -> None:
    op.execute(f"UPDATE {TABLE} SET status = 'DEAD', ordering_key = NULL WHERE status = 'SKIPPED'")
    if op.get_bind().dialect.name == "postgresql":
        _replace_domain_check(OLD_VALUES)
    else:
        _rebuild_sqlite_table(NEW_VALUES, OLD_VALUES)
