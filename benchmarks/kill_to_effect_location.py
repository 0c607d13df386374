"""The code location of ``benchmarks/kill_to_effect.py``: the demo's leased ``daily_invoice`` asset, its
job and its dispatcher (:mod:`dagster_joblease.dagster.demo_location`), with the timings a deployment gets
from the docs instead of the demo's short ones. Loaded by ``dagster-daemon run -m`` in the benchmark's
work directory.

Environment (set by the benchmark): ``JOBLEASE_K2E_HEARTBEAT_MS`` (empty: the resource's default),
``JOBLEASE_K2E_RECONCILE_S`` and ``JOBLEASE_K2E_DISPATCH_S`` (the reconciliation and the outbox sensors'
``minimum_interval_seconds``; empty: the builders' defaults).
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg

from dagster_joblease.dagster.demo_location import (
    BILLING_CODE,
    daily_billing_job,
    daily_invoice,
    health,
    outbox_dispatch_job,
    routes,
)
from dagster_joblease.dagster.jobs import outbox_asset_spec
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.sensors import build_outbox_sensor

HEARTBEAT_ENV = "JOBLEASE_K2E_HEARTBEAT_MS"
RECONCILE_ENV = "JOBLEASE_K2E_RECONCILE_S"
DISPATCH_ENV = "JOBLEASE_K2E_DISPATCH_S"


def _int_env(name: str) -> dict[str, int]:
    value = os.environ.get(name, "")
    return {} if not value else {"value": int(value)}


def _interval(name: str) -> dict[str, Any]:
    found = _int_env(name)
    return {"minimum_interval_seconds": found["value"]} if found else {}


_heartbeat = _int_env(HEARTBEAT_ENV)

defs = dg.Definitions(
    assets=[daily_invoice, outbox_asset_spec],
    asset_checks=health.asset_checks(),
    jobs=[daily_billing_job, outbox_dispatch_job],
    sensors=[
        build_outbox_sensor(
            outbox_dispatch_job,
            name="outbox_dispatch_sensor",
            routes=routes,
            health=health,
            default_status=dg.DefaultSensorStatus.RUNNING,
            **_interval(DISPATCH_ENV),
        ),
        build_reconciliation_sensor(
            daily_invoice, code=BILLING_CODE, name="daily_invoice_reconcile", **_interval(RECONCILE_ENV)
        ),
    ],
    resources={
        "joblease": JobLeaseResource(heartbeat_ms=_heartbeat["value"]) if _heartbeat else JobLeaseResource()
    },
    executor=dg.in_process_executor,
)
