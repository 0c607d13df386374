"""Column rules as domains (PostgreSQL): one-row writes to the hot tables no longer run a table CHECK.

PostgreSQL 15 prepares a table's CHECK constraints afresh for every statement that writes the table: the
executor parses each stored constraint (``stringToNode``), plans it and compiles it before it checks the
first row. For a one-row statement (a lease claim, an enqueue, the receiver's inbox insert, every outcome
the dispatcher records) that fixed cost is most of what the checks cost, and one CHECK costs as much as
four. A domain's CHECK is kept planned in the type cache. Measured on a 2-CPU machine:
``benchmarks/indexes.py`` (server time per insert, alternating rounds) gave a claim 72 us with the table
CHECKs and 51 us with the same rules on domains (0.71x), an enqueue 71 us and 53 us (0.75x); pgbench (4
clients, prepared statements, ``synchronous_commit`` off so that the server's CPU is the limit) ran claims
into the table with its CHECKs at 0.75-0.80 of the same table without them, and with domains at 0.96-1.0.

So on PostgreSQL the single-column rules move onto domains, with the same lengths and values:

==========================  =====================================  ==================================
column                      was                                    now
==========================  =====================================  ==================================
joblease_lease.status       VARCHAR(16) + CHECK IN (RUNNING, ...)  joblease_lease_status
joblease_lease.job_type     VARCHAR(16) + CHECK IN (INITIAL, ...)  joblease_job_type
joblease_lease.attempt      INTEGER + CHECK (attempt >= 1)         joblease_attempt
joblease_outbox.status      VARCHAR(16) + CHECK IN (PENDING, ...)  joblease_outbox_status
joblease_outbox.attempts    INTEGER + CHECK (attempts >= 0)        joblease_attempts
joblease_inbox.status       VARCHAR(16) + CHECK IN (IN_PROGRESS,)  joblease_inbox_status
==========================  =====================================  ==================================

A row that breaks a rule is refused as before (a domain's check fails the statement with SQLSTATE 23514,
like a table CHECK). The one rule that spans two columns cannot be a domain's and is dropped on PostgreSQL:
``run_key_by_type`` (an INITIAL lease has no run key, a SCHEDULE lease has one). Every lease row is written
from a validated ``JobIdentity``, which enforces exactly that pairing, and its ``lock_key`` is the SHA-256 of
the type and the run key together; only hand-written SQL can now break the pairing. SQLite keeps all its
table CHECKs (its checks are cheap, and it has no domains).

Existing databases upgrade in place: the domains are created, the columns change type, and PostgreSQL
rewrites each of the three tables once (a domain with a check forces a rewrite). Values already there are
checked by the rewrite, so a row that broke a rule fails the upgrade instead of passing silently.

Locks: ACCESS EXCLUSIVE on joblease_lease, joblease_outbox and joblease_inbox, held until the migration
commits (one transaction): every read and write of them waits meanwhile. Measured on a 2-CPU machine:
3.6 s for 200,000 leases and 200,000 outbox rows when quiet (about 9 s per million rows of the two
tables); 54.9 s for 1,000,000 leases and 1,000,000 outbox rows under heavy load (load average 10-15),
a concurrent claim waiting 52.9 s and then succeeding.

Running workers: the retype changes the result type of statements that return these columns, so a
statement prepared before it fails once with "cached plan must not change result type" (0A000). Workers
of this version need no restart: storage.driver prepares such a statement again and retries it on the
library's own connections, and a caller's transaction that meets one fails once with a StorageError
saying to retry it. Workers of an older build can fail their claims until their connections are
replaced: restart them after the upgrade. ``joblease db upgrade`` warns when other sessions of the
library are connected (RETYPES_COLUMNS below).

Revision ID: 0006
Revises: 0005
Deploy: before or after the code (queries compare these columns with text and integers, which a domain
over VARCHAR or INTEGER takes as its base type; psycopg reads them as their base types). See "Running
workers" above.
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: ``joblease db upgrade`` warns before running this migration while other sessions of the library are
#: connected (storage.migrate.upgrade_warnings).
RETYPES_COLUMNS = True

#: name → (base type, check on VALUE): the rules the table CHECKs held, one domain each.
DOMAINS = {
    "joblease_lease_status": ("VARCHAR(16)", "VALUE IN ('RUNNING', 'SUCCESS', 'FAIL')"),
    "joblease_job_type": ("VARCHAR(16)", "VALUE IN ('INITIAL', 'SCHEDULE')"),
    "joblease_attempt": ("INTEGER", "VALUE >= 1"),
    "joblease_outbox_status": ("VARCHAR(16)", "VALUE IN ('PENDING', 'SENT', 'DEAD')"),
    "joblease_attempts": ("INTEGER", "VALUE >= 0"),
    "joblease_inbox_status": ("VARCHAR(16)", "VALUE IN ('IN_PROGRESS', 'DONE')"),
}

#: table → [(column, its domain, the name of the table CHECK the domain replaces)]. That CHECK's SQL is the
#: domain's with the column for VALUE (see :func:`_table_check`).
COLUMNS = {
    "joblease_lease": [
        ("status", "joblease_lease_status", "status"),
        ("job_type", "joblease_job_type", "job_type"),
        ("attempt", "joblease_attempt", "attempt_positive"),
    ],
    "joblease_outbox": [
        ("status", "joblease_outbox_status", "status"),
        ("attempts", "joblease_attempts", "attempts_nonnegative"),
    ],
    "joblease_inbox": [
        ("status", "joblease_inbox_status", "status"),
    ],
}

#: The two-column rule no domain can hold (PostgreSQL drops it; see the module's docstring).
RUN_KEY_BY_TYPE = (
    "(job_type = 'INITIAL' AND run_key IS NULL) OR (job_type = 'SCHEDULE' AND run_key IS NOT NULL)"
)


def _check_names(table: str, name: str) -> list[str]:
    # 0001 named its checks in full and the naming convention prefixed them again, so a database made by
    # 0001 holds "ck_<table>_ck_<table>_<name>"; accept the plain form too.
    return [f"ck_{table}_ck_{table}_{name}", f"ck_{table}_{name}"]


def _table_check(column: str, domain: str) -> str:
    """The table CHECK a domain stands for: ``VALUE IN (...)`` on the domain is ``status IN (...)`` on the
    table."""
    return DOMAINS[domain][1].replace("VALUE", column, 1)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name, (base, check) in DOMAINS.items():
        op.execute(f"CREATE DOMAIN {name} AS {base} CHECK ({check})")
    for table, columns in COLUMNS.items():
        checks = [name for _, _, name in columns] + (["run_key_by_type"] if table == "joblease_lease" else [])
        clauses = [f"DROP CONSTRAINT IF EXISTS {ck}" for name in checks for ck in _check_names(table, name)]
        clauses += [f"ALTER COLUMN {column} TYPE {domain}" for column, domain, _ in columns]
        op.execute(f"ALTER TABLE {table} " + ", ".join(clauses))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, columns in COLUMNS.items():
        clauses = [f"ALTER COLUMN {column} TYPE {DOMAINS[domain][0]}" for column, domain, _ in columns] + [
            f"ADD CONSTRAINT ck_{table}_{name} CHECK ({_table_check(column, domain)})"
            for column, domain, name in columns
        ]
        if table == "joblease_lease":
            clauses.append(f"ADD CONSTRAINT ck_{table}_run_key_by_type CHECK ({RUN_KEY_BY_TYPE})")
        op.execute(f"ALTER TABLE {table} " + ", ".join(clauses))
    for name in DOMAINS:
        op.execute(f"DROP DOMAIN {name}")
