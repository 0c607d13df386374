"""The code location of ``benchmarks/kill_to_effect.py``: the demo's leased ``daily_invoice`` asset, its
job, its dispatcher and its sensors (:mod:`dagster_joblease.demo.location`), with the timings a
deployment gets from the library's defaults instead of the demo's short ones. Loaded by ``dagster-daemon
run -m`` in the benchmark's work directory.

Environment (set by the benchmark): ``JOBLEASE_K2E_HEARTBEAT_MS`` (the resource's heartbeat; empty: its
default), ``JOBLEASE_K2E_RECONCILE_S`` and ``JOBLEASE_K2E_DISPATCH_S`` (the reconciliation and the outbox
sensors' intervals; empty: the builders' defaults).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import dagster as dg

from dagster_joblease.dagster.jobs import outbox_asset_spec
from dagster_joblease.dagster.reconcile import build_reconciliation_sensor
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.dagster.sensors import build_outbox_sensor
from dagster_joblease.demo import location as demo

HEARTBEAT_ENV = "JOBLEASE_K2E_HEARTBEAT_MS"
RECONCILE_ENV = "JOBLEASE_K2E_RECONCILE_S"
DISPATCH_ENV = "JOBLEASE_K2E_DISPATCH_S"


def default_interval(builder: Callable[..., object]) -> int:
    """A sensor builder's default ``minimum_interval_seconds``."""
    return int(inspect.signature(builder).parameters["minimum_interval_seconds"].default)


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value else default


_heartbeat_ms = _env_int(HEARTBEAT_ENV, None)

defs = dg.Definitions(
    assets=[demo.daily_invoice, outbox_asset_spec],
    asset_checks=demo.health.asset_checks(),
    jobs=[demo.daily_billing_job, demo.outbox_dispatch_job],
    sensors=demo.sensors(
        reconcile_s=_env_int(RECONCILE_ENV, None) or default_interval(build_reconciliation_sensor),
        dispatch_s=_env_int(DISPATCH_ENV, None) or default_interval(build_outbox_sensor),
    ),
    resources={"joblease": JobLeaseResource(heartbeat_ms=_heartbeat_ms)},
    executor=dg.in_process_executor,
)
