"""The demo's code location, shipped inside the package so ``joblease demo`` works from an installed wheel.

``dagster dev -m dagster_joblease.dagster.demo_location`` loads it (location name: the module's name, which
the demo's runs carry as their repository origin, so they show in the job's Partitions tab). It is a small
billing example: ``daily_billing_job`` (one POST per day, under lease code ``daily-billing``), its
schedule and reconciliation sensor, and the outbox sensor, dispatcher job and delivery checks. The
repository's ``definitions/`` stays the fuller example; the library never imports it.

Configuration (environment): ``JOBLEASE_DATABASE_URL`` (else SQLite under ``$DAGSTER_HOME``) and
``BILLING_API_URL`` (default: the reference receiver, ``joblease receiver`` on port 8765).
"""

from __future__ import annotations

import os

import dagster as dg
import sqlalchemy as sa

from dagster_joblease.dagster.jobs import OutboxHealth, build_dispatcher_job, outbox_asset_spec
from dagster_joblease.dagster.ops import LeasedRun, leased_op
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.schedules import build_leased_schedule
from dagster_joblease.dagster.sensors import build_outbox_sensor
from dagster_joblease.dispatch import Route

__all__ = [
    "BILLING_CODE",
    "BILLING_TOPIC",
    "LOCATION_NAME",
    "daily_billing_job",
    "defs",
    "origin_tags",
    "routes",
]

#: What ``dagster dev -m <module>`` names the location: the module's name.
LOCATION_NAME = __name__
REPOSITORY_NAME = "__repository__"  #: the repository a ``Definitions`` object becomes
BILLING_CODE = "daily-billing"
BILLING_TOPIC = "billing.daily"
DEFAULT_RECEIVER = "http://127.0.0.1:8765"

domain = sa.MetaData()
billing_table = sa.Table(
    "demo_billing_run",
    domain,
    sa.Column("billing_date", sa.String(32), primary_key=True),
    sa.Column("amount_cents", sa.BigInteger(), nullable=False),
    sa.Column("lease_attempt", sa.Integer(), nullable=False),
)

daily_partitions = dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="UTC")


@leased_op(code=BILLING_CODE)
def bill_day(run: LeasedRun) -> dict[str, object]:
    """Record the day's bill and enqueue its POST to the billing API, in one fenced transaction."""
    day = run.partition_key
    assert day is not None
    amount = 1_000 + sum(map(ord, day)) % 9_000
    with run.transaction() as conn:
        domain.create_all(conn, checkfirst=True)
        exists = conn.execute(
            sa.select(billing_table.c.billing_date).where(billing_table.c.billing_date == day)
        ).first()
        if exists is None:  # a reclaimed run repeats the body: stay a no-op
            conn.execute(
                billing_table.insert().values(
                    billing_date=day, amount_cents=amount, lease_attempt=run.lease.attempt
                )
            )
        run.enqueue_once(conn, topic=BILLING_TOPIC, payload={"billingDate": day})
    return {"billingDate": day, "amountCents": amount}


@dg.job(partitions_def=daily_partitions, description="Bill each day once (lease code daily-billing).")
def daily_billing_job() -> None:
    bill_day()


def routes() -> dict[str, Route]:
    """Read when a run or tick starts, so BILLING_API_URL needs no code-location reload."""
    return {BILLING_TOPIC: Route(os.environ.get("BILLING_API_URL") or f"{DEFAULT_RECEIVER}/{BILLING_TOPIC}")}


def origin_tags(job_name: str) -> dict[str, str]:
    """The tags a run of ``job_name`` launched from this location carries: its repository origin and
    partition set. Dagster's Partitions tab lists only runs with both; the demo's launchers add them."""
    return {
        ".dagster/repository": f"{REPOSITORY_NAME}@{LOCATION_NAME}",
        "dagster/partition_set": f"{job_name}_partition_set",
    }


health = OutboxHealth(routes=routes)
outbox_dispatch_job = build_dispatcher_job(routes, name="outbox_dispatch_job", health=health)

defs = dg.Definitions(
    assets=[outbox_asset_spec],
    asset_checks=health.asset_checks(),
    jobs=[daily_billing_job, outbox_dispatch_job],
    schedules=[
        build_leased_schedule(
            daily_billing_job, code=BILLING_CODE, cron_schedule="0 2 * * *", name="daily_billing_schedule"
        )
    ],
    sensors=[
        build_outbox_sensor(outbox_dispatch_job, name="outbox_dispatch_sensor", routes=routes, health=health),
        build_reconciliation_sensor(daily_billing_job, code=BILLING_CODE, name="daily_billing_reconcile"),
    ],
    resources={"joblease": JobLeaseResource()},
)
