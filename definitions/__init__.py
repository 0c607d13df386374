"""Example code location for dagster-joblease (``dg dev`` in the repository root loads it).

It shows both styles side by side. The Pythonic half is this module; the Component half is ``defs/``
(loaded with ``dg.load_from_defs_folder``, this repository's ``[tool.dg]`` settings): the ``joblease``
resource declared once in ``defs/joblease/defs.yaml`` (it brings the location's not-run sensors), and a
leased daily asset (``defs/reports.py``) with its leased schedule and reconciliation sensor as components.
See docs/components.md.

Scenarios: a daily billing job whose effect (a POST to the billing API) must happen once per day however
many runs a partition gets (schedule ticks, backfills, re-executions, retries); a 5-minute order sync; a
run-once settings seed; the outbox sensor + dispatcher job that deliver the effects, with the delivery
checks; and a reconciliation sensor per partitioned job that relaunches partitions left undone.

Configuration (environment):
- ``JOBLEASE_DATABASE_URL``: the joblease tables (``postgresql+psycopg://…``); unset, an SQLite file
  under ``$DAGSTER_HOME`` (or ``./.joblease/``). Dagster's own storage on PostgreSQL, in ``dagster.yaml``,
  must say ``postgresql+psycopg2://`` instead.
- ``BILLING_API_URL`` / ``ORDERS_API_URL``: where the dispatcher delivers; by default the reference
  receiver (``joblease receiver --database-url …``, port 8765).
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping
from pathlib import Path

import dagster as dg
import sqlalchemy as sa

from dagster_joblease.dagster import (
    LeasedRun,
    build_dispatcher_job,
    build_leased_schedule,
    build_outbox_sensor,
    build_reconciliation_sensor,
    leased_op,
)
from dagster_joblease.dagster.jobs import OutboxHealth, outbox_asset_spec
from dagster_joblease.dispatch import Route
from definitions.defs.reports import REPORTS_TOPIC

__all__ = [
    "BILLING_CODE",
    "BILLING_TOPIC",
    "billing_table",
    "daily_billing_job",
    "daily_billing_reconcile",
    "daily_billing_schedule",
    "defs",
    "outbox_dispatch_job",
    "outbox_dispatch_sensor",
    "seed_default_settings_job",
    "sync_orders_job",
    "sync_orders_reconcile",
    "sync_orders_schedule",
]

BILLING_CODE = "daily-billing"
BILLING_TOPIC = "billing.daily"
ORDERS_CODE = "sync-orders"
ORDERS_TOPIC = "orders.synced"
SETTINGS_CODE = "seed-default-settings"
DEFAULT_RECEIVER = "http://127.0.0.1:8765"

# -- domain tables (the example application's own data, next to the joblease tables) ---------------

domain = sa.MetaData()
billing_table = sa.Table(
    "example_billing_run",
    domain,
    sa.Column("billing_date", sa.String(32), primary_key=True),
    sa.Column("amount_cents", sa.BigInteger(), nullable=False),
    sa.Column("lease_attempt", sa.Integer(), nullable=False),
)
orders_table = sa.Table(
    "example_order_sync",
    domain,
    sa.Column("window_start", sa.String(32), primary_key=True),
    sa.Column("orders", sa.Integer(), nullable=False),
)
settings_table = sa.Table(
    "example_setting",
    domain,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
)


def _ensure_tables(connection: sa.Connection) -> None:
    # Concurrent CREATE TABLE IF NOT EXISTS can collide on PostgreSQL; serialize it (SQLite already is).
    if connection.dialect.name == "postgresql":
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(7370656)"))
    domain.create_all(connection, checkfirst=True)


def _insert_missing(connection: sa.Connection, table: sa.Table, values: Mapping[str, object]) -> None:
    # A reclaimed run re-runs the body after a crash that may have come after the commit: stay a no-op.
    (pk,) = table.primary_key.columns
    if connection.execute(sa.select(pk).where(pk == values[pk.name])).first() is None:
        connection.execute(table.insert().values(**values))


# -- daily billing -------------------------------------------------------------------------------

daily_partitions = dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="UTC")


@leased_op(code=BILLING_CODE)
def bill_day(run: LeasedRun) -> dict[str, object]:
    """Record the day's bill and enqueue its POST to the billing API, in one fenced transaction."""
    day = run.partition_key
    assert day is not None
    amount = 1_000 + sum(map(ord, day)) % 9_000
    with run.transaction() as conn:
        _ensure_tables(conn)
        row = {"billing_date": day, "amount_cents": amount, "lease_attempt": run.lease.attempt}
        _insert_missing(conn, billing_table, row)
        run.enqueue_once(conn, topic=BILLING_TOPIC, payload={"billingDate": day})
    return {"billingDate": day, "amountCents": amount}


@dg.job(partitions_def=daily_partitions, description="Bill each day once (lease code daily-billing).")
def daily_billing_job() -> None:
    bill_day()


daily_billing_schedule = build_leased_schedule(
    daily_billing_job, code=BILLING_CODE, cron_schedule="0 2 * * *", name="daily_billing_schedule"
)
# RUNNING by default: relaunches failed, expired, dead-holder and `held` partitions of the last 7 days.
daily_billing_reconcile = build_reconciliation_sensor(
    daily_billing_job, code=BILLING_CODE, name="daily_billing_reconcile"
)

# -- order sync every 5 minutes ------------------------------------------------------------------

five_minute_partitions = dg.TimeWindowPartitionsDefinition(
    start="2024-01-01-00:00", cron_schedule="*/5 * * * *", fmt="%Y-%m-%d-%H:%M", timezone="UTC"
)


@leased_op(code=ORDERS_CODE)
def sync_orders_window(run: LeasedRun) -> None:
    """Sync one 5-minute window of orders and announce it downstream."""
    window = run.partition_key
    assert window is not None
    with run.transaction() as conn:
        _ensure_tables(conn)
        _insert_missing(conn, orders_table, {"window_start": window, "orders": len(window)})
        run.enqueue_once(conn, topic=ORDERS_TOPIC, payload={"window": window})


@dg.job(partitions_def=five_minute_partitions, description="Sync each 5-minute window once.")
def sync_orders_job() -> None:
    sync_orders_window()


sync_orders_schedule = build_leased_schedule(sync_orders_job, code=ORDERS_CODE, name="sync_orders_schedule")
sync_orders_reconcile = build_reconciliation_sensor(
    sync_orders_job, code=ORDERS_CODE, name="sync_orders_reconcile", lookback=dt.timedelta(days=1)
)

# -- run once, forever -----------------------------------------------------------------------------


@leased_op(code=SETTINGS_CODE, initial=True)
def seed_default_settings(run: LeasedRun) -> None:
    """Insert the default settings exactly once per database (an INITIAL lease: done stays done)."""
    with run.transaction() as conn:
        _ensure_tables(conn)
        for key, value in {"currency": "EUR", "billing.cutoff": "02:00Z"}.items():
            _insert_missing(conn, settings_table, {"key": key, "value": value})


@dg.job(description="Seed default settings once (INITIAL lease).")
def seed_default_settings_job() -> None:
    seed_default_settings()


# -- delivery ----------------------------------------------------------------------------------------


def routes() -> dict[str, Route]:
    """Read at run start, so a changed BILLING_API_URL needs no code-location reload."""
    return {
        BILLING_TOPIC: Route(os.environ.get("BILLING_API_URL") or f"{DEFAULT_RECEIVER}/{BILLING_TOPIC}"),
        ORDERS_TOPIC: Route(os.environ.get("ORDERS_API_URL") or f"{DEFAULT_RECEIVER}/{ORDERS_TOPIC}"),
        REPORTS_TOPIC: Route(os.environ.get("REPORTS_API_URL") or f"{DEFAULT_RECEIVER}/{REPORTS_TOPIC}"),
    }


# The delivery checks look only at this location's topics; the outbox sensor reports them every 5 minutes.
outbox_health = OutboxHealth(routes=routes)
outbox_dispatch_job = build_dispatcher_job(routes, name="outbox_dispatch_job", health=outbox_health)
outbox_dispatch_sensor = build_outbox_sensor(
    outbox_dispatch_job, name="outbox_dispatch_sensor", routes=routes, health=outbox_health
)

# One Definitions object at module scope (Dagster refuses several): the Pythonic half merged with the
# Component half. The resource comes from defs/joblease/defs.yaml, declared once (Definitions.merge
# refuses two resources under one key); the Pythonic jobs and sensors name it by its key, `joblease`.
defs = dg.Definitions.merge(
    dg.Definitions(
        assets=[outbox_asset_spec],
        asset_checks=outbox_health.asset_checks(),
        jobs=[daily_billing_job, sync_orders_job, seed_default_settings_job, outbox_dispatch_job],
        schedules=[daily_billing_schedule, sync_orders_schedule],
        # The not-run sensors (joblease/* tags stay true on re-executions whose leased step never ran)
        # come with the resource component (defs/joblease/defs.yaml, not_run_sensors: true by default):
        # calling build_not_run_sensors() here as well would define them twice, which Dagster refuses.
        sensors=[outbox_dispatch_sensor, daily_billing_reconcile, sync_orders_reconcile],
    ),
    dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
)
