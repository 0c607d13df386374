"""The demo's code location, shipped inside the package so ``joblease demo`` works from an installed wheel.

``dg dev -m dagster_joblease.demo.location`` (or ``dagster-daemon run -m …``, as the demo does)
loads it; the location's name is the module's name. A small billing example built around a leased,
daily-partitioned asset:

- ``daily_invoice`` (lease code ``daily-billing``): records the day's invoice and enqueues one POST to the
  billing API, in one fenced transaction; ``daily_billing_job`` is its asset job;
- ``daily_billing_schedule`` (02:00 UTC, the previous day), a leased schedule on that job;
- ``daily_invoice_reconcile``, its reconciliation sensor (RUNNING; every 5 s here, so the demo's killed
  run is redone within seconds);
- ``outbox_dispatch_sensor`` (RUNNING) and ``outbox_dispatch_job``, with the delivery checks.

Runs use the in-process executor (one process per run, not two). The resource's heartbeat is 2 s, so a
finished run's stale lease is taken over after 4 s. The repository's ``definitions/`` stays the fuller
example; the library never imports it.

Configuration (environment): ``JOBLEASE_DATABASE_URL`` (else SQLite under ``$DAGSTER_HOME``) and
``BILLING_API_URL`` (default: the reference receiver, ``joblease receiver`` on port 8765).
``JOBLEASE_DEMO_KILL_DIR`` is set only by ``joblease demo``: the first attempt of a partition whose file
``<dir>/<partition>.kill`` exists writes its process id to ``<dir>/<partition>.pid`` and waits to be
killed; unset (the UI afterwards), nothing waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, cast

import dagster as dg
import sqlalchemy as sa

from dagster_joblease.dagster.jobs import OutboxHealth, build_dispatcher_job, outbox_asset_spec
from dagster_joblease.dagster.ops import LeasedRun, leased_asset
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.schedules import build_leased_schedule
from dagster_joblease.dagster.sensors import build_outbox_sensor
from dagster_joblease.dispatch import Route

__all__ = [
    "BILLING_CODE",
    "BILLING_TOPIC",
    "JOB_NAME",
    "KILL_DIR_ENV",
    "LOCATION_NAME",
    "REPOSITORY_NAME",
    "SCHEDULE_NAME",
    "daily_invoice",
    "defs",
    "routes",
]

#: What ``-m <module>`` names the location: the module's name.
LOCATION_NAME = __name__
REPOSITORY_NAME = "__repository__"  #: the repository a ``Definitions`` object becomes
BILLING_CODE = "daily-billing"
BILLING_TOPIC = "billing.daily"
JOB_NAME = "daily_billing_job"
SCHEDULE_NAME = "daily_billing_schedule"
RECONCILE_NAME = "daily_invoice_reconcile"
DEFAULT_RECEIVER = "http://127.0.0.1:8765"
KILL_DIR_ENV = "JOBLEASE_DEMO_KILL_DIR"
KILL_WAIT_S = 120.0

domain = sa.MetaData()
invoice_table = sa.Table(
    "demo_invoice",
    domain,
    sa.Column("billing_date", sa.String(32), primary_key=True),
    sa.Column("amount_cents", sa.BigInteger(), nullable=False),
    sa.Column("lease_attempt", sa.Integer(), nullable=False),
)

daily_partitions = dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="UTC")


def _wait_to_be_killed(day: str, attempt: int) -> None:
    """The demo's kill point: the first attempt of a marked partition parks here until it is SIGKILLed."""
    kill_dir = os.environ.get(KILL_DIR_ENV)
    if not kill_dir or attempt != 1 or not (Path(kill_dir) / f"{day}.kill").exists():
        return
    (Path(kill_dir) / f"{day}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)


@leased_asset(code=BILLING_CODE, partitions_def=daily_partitions, group_name="billing")
def daily_invoice(run: LeasedRun) -> dict[str, object]:
    """The day's invoice, and its POST to the billing API enqueued in the same fenced transaction."""
    day = run.partition_key
    assert day is not None
    _wait_to_be_killed(day, run.lease.attempt)
    amount = 1_000 + sum(map(ord, day)) % 9_000
    with run.transaction() as conn:
        domain.create_all(conn, checkfirst=True)
        exists = conn.execute(
            sa.select(invoice_table.c.billing_date).where(invoice_table.c.billing_date == day)
        ).first()
        if exists is None:  # a reclaimed run repeats the body: stay a no-op
            conn.execute(
                invoice_table.insert().values(
                    billing_date=day, amount_cents=amount, lease_attempt=run.lease.attempt
                )
            )
        run.enqueue_once(conn, topic=BILLING_TOPIC, payload={"billingDate": day})
    return {"billingDate": day, "amountCents": amount}


daily_billing_job = dg.define_asset_job(
    JOB_NAME,
    selection=[daily_invoice],
    partitions_def=daily_partitions,
    description="Invoice each day once (lease code daily-billing).",
)


def routes() -> dict[str, Route]:
    """Read when a run or tick starts, so BILLING_API_URL needs no code-location reload."""
    return {
        BILLING_TOPIC: Route(
            os.environ.get("BILLING_API_URL") or f"{DEFAULT_RECEIVER}/{BILLING_TOPIC}", timeout_s=5.0
        )
    }


health = OutboxHealth(routes=routes)
outbox_dispatch_job = build_dispatcher_job(routes, name="outbox_dispatch_job", health=health)


def sensors(reconcile_s: int = 5, dispatch_s: int = 5) -> list[dg.SensorDefinition]:
    """The location's two sensors, both RUNNING: the outbox dispatcher's and the reconciliation sensor,
    evaluated every ``dispatch_s`` and ``reconcile_s`` seconds (the demo's 5 s; ``benchmarks/
    kill_to_effect.py`` passes the documented defaults)."""
    return [
        build_outbox_sensor(
            outbox_dispatch_job,
            name="outbox_dispatch_sensor",
            routes=routes,
            health=health,
            minimum_interval_seconds=dispatch_s,
            default_status=dg.DefaultSensorStatus.RUNNING,
        ),
        build_reconciliation_sensor(
            daily_invoice, code=BILLING_CODE, name=RECONCILE_NAME, minimum_interval_seconds=reconcile_s
        ),
    ]


defs = dg.Definitions(
    assets=[daily_invoice, outbox_asset_spec],
    asset_checks=health.asset_checks(),
    jobs=[daily_billing_job, outbox_dispatch_job],
    schedules=[
        build_leased_schedule(
            # An asset job: the builder needs only its name and partitions.
            cast(Any, daily_billing_job),
            code=BILLING_CODE,
            cron_schedule="0 2 * * *",
            name=SCHEDULE_NAME,
            job_by_name=True,
        )
    ],
    sensors=sensors(),
    resources={"joblease": JobLeaseResource(heartbeat_ms=2_000)},
    executor=dg.in_process_executor,
)
