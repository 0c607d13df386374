"""The code location both deployments of the daemon acceptance test load (``test_daemon_acceptance.py``).

Both deployments run the same leased job (lease code ``accept-billing``) on one shared joblease database,
so a partition's schedule run, its runs in two overlapping backfills, a re-execution and run retries all
compete for one lease. Each winner enqueues two effects in its fenced transaction: ``accept.effect``,
which both deployments route, and ``accept.audit``, which only deployment ``b`` routes (a dispatcher must
leave a topic it has no route for alone). A reconciliation sensor relaunches partitions left undone.

Configuration comes from the environment the test gives the daemon and the webserver (their code servers
and run workers inherit it):

- ``ACCEPT_DEPLOYMENT``: ``a`` or ``b`` (which routes this location has);
- ``ACCEPT_START_DATE``: first daily partition (``YYYY-MM-DD``), so the job has only a few partitions;
- ``ACCEPT_RECEIVER_URL``: the reference receiver (the downstream);
- ``ACCEPT_SLOW_KEY``: the partition whose first lease attempt blocks until the test SIGKILLs it;
- ``ACCEPT_FAIL_KEY``: the partition whose first lease attempt raises (a run that fails once);
- ``JOBLEASE_DATABASE_URL``: the shared joblease database (read by ``JobLeaseResource``).
"""

from __future__ import annotations

import os
import time

import dagster as dg

from dagster_joblease.dagster import (
    JobLeaseResource,
    LeasedRun,
    build_dispatcher_job,
    build_leased_schedule,
    build_outbox_sensor,
    build_reconciliation_sensor,
    leased_op,
)
from dagster_joblease.dagster.jobs import OutboxHealth
from dagster_joblease.dispatch import Route
from dagster_joblease.identity import effect_key

CODE = "accept-billing"
JOB_NAME = "accept_job"
SCHEDULE_NAME = "accept_schedule"
DISPATCH_JOB_NAME = "accept_dispatch_job"
EFFECT_TOPIC = "accept.effect"
AUDIT_TOPIC = "accept.audit"
#: How long the slow first attempt blocks if nobody kills it (the test kills it within seconds).
SLOW_LIMIT_S = 240.0

DEPLOYMENT = os.environ.get("ACCEPT_DEPLOYMENT", "a")
START_DATE = os.environ.get("ACCEPT_START_DATE", "2024-01-01")
SLOW_KEY = os.environ.get("ACCEPT_SLOW_KEY", "")
FAIL_KEY = os.environ.get("ACCEPT_FAIL_KEY", "")
RECEIVER_URL = os.environ.get("ACCEPT_RECEIVER_URL", "http://127.0.0.1:8765").rstrip("/")

partitions = dg.DailyPartitionsDefinition(start_date=START_DATE, timezone="UTC")


@leased_op(code=CODE)
def accept_effect(run: LeasedRun) -> None:
    """Enqueue the partition's two effects; the planned first attempts fail or block (to be killed)."""
    key = run.partition_key
    if key == FAIL_KEY and run.lease.attempt == 1:
        raise RuntimeError(f"planned failure of the first attempt of partition {key}")
    if key == SLOW_KEY and run.lease.attempt == 1:
        run.log.info(f"partition {key}: first attempt holds the lease until it is killed")
        deadline = time.monotonic() + SLOW_LIMIT_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
    with run.transaction() as conn:
        run.enqueue_once(conn, topic=EFFECT_TOPIC, payload={"partition": key})
        run.enqueue_once(
            conn,
            topic=AUDIT_TOPIC,
            payload={"partition": key},
            idempotency_key=effect_key(run.idempotency_key, "audit"),
        )


@dg.job(name=JOB_NAME, partitions_def=partitions, executor_def=dg.in_process_executor)
def accept_job() -> None:
    accept_effect()


accept_schedule = build_leased_schedule(accept_job, code=CODE, cron_schedule="* * * * *", name=SCHEDULE_NAME)


def routes() -> dict[str, Route]:
    """Deployment ``a`` routes only ``accept.effect``; ``b`` routes both topics."""
    table = {EFFECT_TOPIC: Route(f"{RECEIVER_URL}/{EFFECT_TOPIC}")}
    if DEPLOYMENT == "b":
        table[AUDIT_TOPIC] = Route(f"{RECEIVER_URL}/{AUDIT_TOPIC}")
    return table


accept_dispatch_job = build_dispatcher_job(routes, name=DISPATCH_JOB_NAME)
accept_dispatch_sensor = build_outbox_sensor(
    accept_dispatch_job,
    name="accept_dispatch_sensor",
    routes=routes,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
# The safety net, at its defaults except the interval (60 s by default; 10 s keeps the test short).
accept_reconcile_sensor = build_reconciliation_sensor(
    accept_job,
    code=CODE,
    name="accept_reconcile_sensor",
    health=OutboxHealth(routes=routes),
    minimum_interval_seconds=10,
)

defs = dg.Definitions(
    jobs=[accept_job, accept_dispatch_job],
    schedules=[accept_schedule],
    sensors=[accept_dispatch_sensor, accept_reconcile_sensor],
    resources={"joblease": JobLeaseResource()},
    executor=dg.in_process_executor,
)
