"""The package's tables, as SQLAlchemy Core, on one MetaData with a naming convention.

Statuses are VARCHAR with a named CHECK (on PostgreSQL a domain over VARCHAR, migration 0006) rather
than PostgreSQL ENUMs, which cannot drop values and do not exist on SQLite. Every name starts with
``joblease_`` so the tables can share a database (even a schema) with Dagster's own storage or the host
application.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

__all__ = [
    "HEAD_REVISION",
    "PG_DOMAINS",
    "TRACEPARENT_LENGTH",
    "TRACESTATE_LENGTH",
    "VERSION_TABLE",
    "any_status",
    "inbox_table",
    "lease_table",
    "metadata",
    "outbox_event_table",
    "outbox_table",
    "route_group_table",
]

#: Alembic's version table for this package, distinct from Dagster's and the host's ``alembic_version``.
VERSION_TABLE = "joblease_alembic_version"
#: The newest migration; ``db check`` compares the database against it.
HEAD_REVISION = "0011"
#: The longest W3C ``traceparent`` and ``tracestate`` an outbox row stores (0010; W3C Trace Context: a
#: version-00 traceparent is 55 characters, later versions may append; a tracestate of more than 512
#: characters may be dropped by any hop).
TRACEPARENT_LENGTH = 128
TRACESTATE_LENGTH = 512

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# SQLite only autoincrements INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_Time = sa.DateTime(timezone=True)


#: PostgreSQL: the domain each of these columns has instead of a table CHECK (migration 0006: a table CHECK
#: is prepared again by every one-row write, a domain's check once). The models keep the base types, so
#: the queries compile as before; ``db check`` compares a domain's base type and name.
PG_DOMAINS = {
    ("joblease_lease", "status"): "joblease_lease_status",
    ("joblease_lease", "job_type"): "joblease_job_type",
    ("joblease_lease", "attempt"): "joblease_attempt",
    ("joblease_outbox", "status"): "joblease_outbox_status",
    ("joblease_outbox", "attempts"): "joblease_attempts",
    ("joblease_inbox", "status"): "joblease_inbox_status",
}


def _sqlite_check(sql: str, name: str) -> sa.CheckConstraint:
    """A table CHECK that exists on SQLite only; on PostgreSQL the column's domain holds the rule."""
    check = sa.CheckConstraint(sql, name=name)
    check.ddl_if(dialect="sqlite")
    return check


lease_table = sa.Table(
    "joblease_lease",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("lock_key", sa.String(80), nullable=False),
    sa.Column("job_type", sa.String(16), nullable=False),
    sa.Column("code", sa.String(64), nullable=False),
    sa.Column("run_key", sa.String(256), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("owner_token", sa.String(64), nullable=False),
    sa.Column("attempt", sa.Integer(), nullable=False),
    sa.Column("lease_ms", sa.BigInteger(), nullable=False),
    # The holder's heartbeat interval (0: none, judged by expiry only; NULL: written before 0002).
    sa.Column("heartbeat_ms", sa.BigInteger(), nullable=True),
    sa.Column("holder", sa.String(255), nullable=True),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("acquired_at", _Time, nullable=False),
    sa.Column("heartbeat_at", _Time, nullable=False),
    sa.Column("expires_at", _Time, nullable=False),
    sa.Column("finished_at", _Time, nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    sa.Column("result", _Json, nullable=True),
    sa.UniqueConstraint("lock_key"),
    _sqlite_check("status IN ('RUNNING', 'SUCCESS', 'FAIL')", name="status"),
    _sqlite_check("job_type IN ('INITIAL', 'SCHEDULE')", name="job_type"),
    _sqlite_check(
        "(job_type = 'INITIAL' AND run_key IS NULL) OR (job_type = 'SCHEDULE' AND run_key IS NOT NULL)",
        name="run_key_by_type",
    ),
    _sqlite_check("attempt >= 1", name="attempt_positive"),
    # Every index here is written by every claim's INSERT unless it is partial and excludes RUNNING rows;
    # benchmarks/indexes.py measures each one's cost on the claim and shows the plan of each query below.
    # The primary key: heartbeat, release, finish, takeover and `leases show ID` address a lease by id.
    # uq(lock_key): the claim's ON CONFLICT (lock_key) and every lookup by key.
    # Live rows only (RUNNING or FAIL: a few, however many finished): reconciliation (a code's FAIL/RUNNING
    # rows), `leases list --status running|fail`, `leases list --expired`, and the live half of every read
    # of a code's rows of any status (see `any_status`). The one secondary index a claim writes.
    sa.Index(
        "ix_joblease_lease_live",
        "code",
        postgresql_where=sa.text("status IN ('RUNNING', 'FAIL')"),
        sqlite_where=sa.text("status IN ('RUNNING', 'FAIL')"),
    ),
    # Succeeded rows only, by (code, run_key): the other half of a read of a code's rows of any status:
    # reconciliation's catch-up ("which run keys of this code have a row"), `leases list --code`,
    # `leases show CODE`, the near-match hint. Written when a lease succeeds, never by a claim (0005).
    sa.Index(
        "ix_joblease_lease_succeeded",
        "code",
        "run_key",
        postgresql_where=sa.text("status = 'SUCCESS'"),
        sqlite_where=sa.text("status = 'SUCCESS'"),
    ),
    # Finished rows only: `leases purge` (finished_at < cutoff). A claim leaves finished_at NULL, so the
    # claim never writes this index; a finish does.
    sa.Index(
        "ix_joblease_lease_finished_at",
        "finished_at",
        postgresql_where=sa.text("finished_at IS NOT NULL"),
        sqlite_where=sa.text("finished_at IS NOT NULL"),
    ),
)


def any_status() -> sa.ColumnElement[bool]:
    """``status IN ('RUNNING', 'FAIL') OR status = 'SUCCESS'``: true of every lease row (its status rule),
    spelled as the predicates of the two partial indexes that hold a code's rows between them.

    Add it beside ``code = …`` to read a code's rows of any status: PostgreSQL then reads them as a
    BitmapOr of ``ix_joblease_lease_live`` and ``ix_joblease_lease_succeeded`` instead of the table (no
    full index on ``code`` exists, so that a claim writes one secondary index only). The constants are
    written into the SQL, not bound, so a generic (prepared) plan can prove the predicates too.
    """
    status = lease_table.c.status
    return sa.or_(
        status.in_([sa.literal_column("'RUNNING'"), sa.literal_column("'FAIL'")]),
        status == sa.literal_column("'SUCCESS'"),
    )


outbox_table = sa.Table(
    "joblease_outbox",
    metadata,
    sa.Column("id", _Id, primary_key=True, autoincrement=True),
    sa.Column("idempotency_key", sa.String(320), nullable=False),
    sa.Column("topic", sa.String(128), nullable=False),
    sa.Column("payload", _Json, nullable=False),
    sa.Column("payload_sha256", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer(), nullable=False),
    sa.Column("next_attempt_at", _Time, nullable=False),
    sa.Column("claim_token", sa.String(64), nullable=True),
    sa.Column("claim_expires_at", _Time, nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    sa.Column("last_status", sa.Integer(), nullable=True),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("updated_at", _Time, nullable=False),
    sa.Column("sent_at", _Time, nullable=True),
    # When the downstream first saw (or may have seen) this key: the start of its retention window.
    sa.Column("first_attempt_at", _Time, nullable=True),
    # The limit group whose capacity an unexpired claim holds (NULL when no limit applied).
    sa.Column("claim_group", sa.String(255), nullable=True),
    # Attempts a downstream's Retry-After pause deferred without counting them against max_attempts.
    sa.Column("deferrals", sa.Integer(), nullable=False, server_default=sa.text("0")),
    # Rows with the same ordering key are delivered one at a time, in id order (NULL: no ordering; 0008).
    sa.Column("ordering_key", sa.String(128), nullable=True),
    # The W3C trace context of the span that enqueued the row (NULL: none was active, or before 0010).
    sa.Column("traceparent", sa.String(TRACEPARENT_LENGTH), nullable=True),
    sa.Column("tracestate", sa.String(TRACESTATE_LENGTH), nullable=True),
    sa.UniqueConstraint("idempotency_key"),
    _sqlite_check("status IN ('PENDING', 'SENT', 'DEAD', 'SKIPPED')", name="status"),
    _sqlite_check("attempts >= 0", name="attempts_nonnegative"),
    # The primary key: the dispatcher's claim (its CTE joins on id), recording outcomes, `outbox requeue ID`.
    # uq(idempotency_key): enqueue's ON CONFLICT (idempotency_key).
    # Pending rows only: the dispatcher's claim of due rows, due_summary, the sensor's probe, `outbox list
    # --status pending`; cheap however many rows were sent. The one secondary index an enqueue writes.
    sa.Index(
        "ix_joblease_outbox_due",
        "next_attempt_at",
        "id",
        postgresql_where=sa.text("status = 'PENDING'"),
        sqlite_where=sa.text("status = 'PENDING'"),
    ),
    # Claims holding a limit group's capacity: counting a group's requests in flight reads only these
    # (NULL on the unlimited path, so its claims and outcomes write no entry here).
    sa.Index(
        "ix_joblease_outbox_claim_group",
        "claim_group",
        "claim_expires_at",
        postgresql_where=sa.text("claim_group IS NOT NULL"),
        sqlite_where=sa.text("claim_group IS NOT NULL"),
    ),
    # Dead rows only: delivery_health, the no_dead_rows check, `outbox requeue --all-dead / --topic`,
    # `outbox list --status dead`. Written when a row is dead-lettered, never by an enqueue.
    sa.Index(
        "ix_joblease_outbox_dead",
        "topic",
        postgresql_where=sa.text("status = 'DEAD'"),
        sqlite_where=sa.text("status = 'DEAD'"),
    ),
    # Live rows of an ordering key (PENDING or DEAD), by (key, id): the claim's "is an earlier row of this
    # key still live?" probe, the blocked keys of `outbox status`. Rows without a key have no entry (0008).
    sa.Index(
        "ix_joblease_outbox_ordering",
        "ordering_key",
        "id",
        postgresql_where=sa.text("ordering_key IS NOT NULL AND status IN ('PENDING', 'DEAD')"),
        sqlite_where=sa.text("ordering_key IS NOT NULL AND status IN ('PENDING', 'DEAD')"),
    ),
    # Sent rows only: `outbox purge` (sent_at < cutoff). Written when a row is sent.
    sa.Index(
        "ix_joblease_outbox_sent_at",
        "sent_at",
        postgresql_where=sa.text("status = 'SENT'"),
        sqlite_where=sa.text("status = 'SENT'"),
    ),
)

# The CDC hand-over (0011; dagster_joblease.cdc): events for change-data capture in the shape of Debezium's
# Outbox Event Router, written insert-only (never updated; deleted by retention only). The dispatcher never
# reads this table: its topics leave through the connector reading the WAL.
outbox_event_table = sa.Table(
    "joblease_outbox_event",
    metadata,
    # The router's event id (the Kafka header ``id``): the row's idempotency key, one row per key.
    sa.Column("id", sa.String(320), primary_key=True),
    # The router's ``route.by.field``: the topic (Kafka topic ``outbox.event.<topic>`` by default).
    sa.Column("aggregatetype", sa.String(128), nullable=False),
    # The router's event key (the Kafka key, so per-key order holds): the ordering key, else the id.
    sa.Column("aggregateid", sa.String(320), nullable=False),
    sa.Column("type", sa.String(128), nullable=False),
    sa.Column("payload", _Json, nullable=False),
    # The router's ``tracing.span.context.field``: the W3C context as java.util.Properties text, or NULL.
    sa.Column("tracingspancontext", sa.Text(), nullable=True),
    sa.Column("payload_sha256", sa.String(64), nullable=False),
    sa.Column("created_at", _Time, nullable=False),
    # Retention: `purge_events` deletes rows older than a window (created_at < cutoff).
    sa.Index("ix_joblease_outbox_event_created_at", "created_at"),
)

# One row per limit group (a downstream's capacity shared by every dispatcher on this database): the
# smallest limits live dispatchers configured (each until its registration lapses), the rate limiter's next
# free admission, and a pause a downstream asked for (Retry-After) or repeated connection failures opened.
route_group_table = sa.Table(
    "joblease_route_group",
    metadata,
    sa.Column("limit_group", sa.String(255), primary_key=True),
    sa.Column("max_in_flight", sa.Integer(), nullable=True),
    sa.Column("max_in_flight_until", _Time, nullable=True),
    sa.Column("rate", sa.Integer(), nullable=True),
    sa.Column("rate_until", _Time, nullable=True),
    sa.Column("rate_next_at", _Time, nullable=True),
    sa.Column("paused_until", _Time, nullable=True),
    sa.Column("pause_reason", sa.Text(), nullable=True),
    sa.Column("failures", sa.Integer(), nullable=False, server_default=sa.text("0")),
    sa.Column("updated_at", _Time, nullable=False),
    sa.CheckConstraint("max_in_flight IS NULL OR max_in_flight >= 1", name="max_in_flight_positive"),
    sa.CheckConstraint("rate IS NULL OR rate >= 1", name="rate_positive"),
)

inbox_table = sa.Table(
    "joblease_inbox",
    metadata,
    sa.Column("idempotency_key", sa.String(320), primary_key=True),
    sa.Column("payload_sha256", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("lock_token", sa.String(64), nullable=True),
    sa.Column("locked_until", _Time, nullable=True),
    sa.Column("response_status", sa.Integer(), nullable=True),
    sa.Column("response_body", sa.Text(), nullable=True),
    sa.Column("created_at", _Time, nullable=False),
    sa.Column("completed_at", _Time, nullable=True),
    # The stored answer's headers, a JSON array of [name, value] pairs (NULL: none; before 0007: none).
    sa.Column("response_headers", sa.Text(), nullable=True),
    # A binary body (an ASGI answer); NULL when the body is the text in response_body.
    sa.Column("response_content", sa.LargeBinary(), nullable=True),
    # The highest fencing number accepted under this key (NULL: none was sent); a lower one is refused.
    sa.Column("fence", sa.BigInteger(), nullable=True),
    _sqlite_check("status IN ('IN_PROGRESS', 'DONE')", name="status"),
    sa.Index("ix_joblease_inbox_completed_at", "completed_at"),
)
