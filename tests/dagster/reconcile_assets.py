"""Leased assets for the reconciliation tests on real runs (module level: subprocesses import them).

Every body writes one outbox row per key in its fenced transaction. Environment variables steer a body
from the test: ``JOBLEASE_RC_FAIL`` (comma-separated keys whose body raises), ``JOBLEASE_RC_BLOCK`` (a key
whose body writes ``<pid> <run id>`` to ``JOBLEASE_RC_READY`` and then waits: until the file named by
``JOBLEASE_RC_RELEASE`` exists, or up to 120 s, for a test to kill or terminate the run).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import dagster as dg

from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_asset

FAIL_ENV = "JOBLEASE_RC_FAIL"
BLOCK_ENV = "JOBLEASE_RC_BLOCK"
READY_ENV = "JOBLEASE_RC_READY"
RELEASE_ENV = "JOBLEASE_RC_RELEASE"
TOPIC = "test.reconcile"

days = dg.DailyPartitionsDefinition(start_date="2024-01-01")
hours = dg.HourlyPartitionsDefinition(start_date="2023-01-01-00:00")
SINGLE_RUN = dg.BackfillPolicy.single_run()


def _steer(key: str, run: LeasedRun) -> None:
    if key in set(filter(None, os.environ.get(FAIL_ENV, "").split(","))):
        raise RuntimeError(f"failing {key} on purpose")
    if os.environ.get(BLOCK_ENV) == key:
        Path(os.environ[READY_ENV]).write_text(f"{os.getpid()} {run.context.run_id}")
        release = os.environ.get(RELEASE_ENV)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (release and Path(release).exists()):
            time.sleep(0.05)


def enqueue_key(run: LeasedRun) -> str:
    key = run.partition_key or "initial"
    _steer(key, run)
    with run.transaction() as conn:
        run.enqueue_once(conn, topic=TOPIC, payload={"key": key, "code": run.lease.identity.code})
    return key


#: Finding 1 (a SIGKILLed range run), 9 (a canceled range run), 10 (two deployments).
rc_range = leased_asset(code="t-rc-range", name="rc_range", partitions_def=days, backfill_policy=SINGLE_RUN)(
    enqueue_key
)
#: Finding 2: a long hourly range.
rc_long = leased_asset(code="t-rc-long", name="rc_long", partitions_def=hours, backfill_policy=SINGLE_RUN)(
    enqueue_key
)
#: Finding 4: a leased upstream and a leased downstream in one range run.
rc_up = leased_asset(code="t-rc-up", name="rc_up", partitions_def=days, backfill_policy=SINGLE_RUN)(
    enqueue_key
)
rc_down = leased_asset(
    code="t-rc-down", name="rc_down", partitions_def=days, backfill_policy=SINGLE_RUN, deps=[rc_up]
)(enqueue_key)
#: Finding 9: an asset materialized by an explicit asset job.
rc_jobbed = leased_asset(
    code="t-rc-jobbed", name="rc_jobbed", partitions_def=days, backfill_policy=SINGLE_RUN
)(enqueue_key)
rc_asset_job = dg.define_asset_job("rc_asset_job", selection=[rc_jobbed])

#: #35 item 1: a leased upstream, a plain step (it fails while ``JOBLEASE_RC_FAIL_PLAIN`` is set), a leased
#: downstream.
PLAIN_FAIL_ENV = "JOBLEASE_RC_FAIL_PLAIN"
rc_a_up = leased_asset(code="t-rc-a-up", name="rc_a_up", partitions_def=days)(enqueue_key)


@dg.asset(name="rc_a_mid", partitions_def=days, deps=[rc_a_up])
def rc_a_mid() -> None:
    if os.environ.get(PLAIN_FAIL_ENV):
        raise RuntimeError("failing the plain step on purpose")


rc_a_down = leased_asset(code="t-rc-a-down", name="rc_a_down", partitions_def=days, deps=[rc_a_mid])(
    enqueue_key
)
#: #35 item 2: an upstream and a downstream in a define_asset_job job (its runs record no selection).
rc_j_up = leased_asset(code="t-rc-j-up", name="rc_j_up", partitions_def=days)(enqueue_key)
rc_j_down = leased_asset(code="t-rc-j-down", name="rc_j_down", partitions_def=days, deps=[rc_j_up])(
    enqueue_key
)
rc_pair_job = dg.define_asset_job("rc_pair_job", selection=[rc_j_up, rc_j_down])

ASSETS = {
    a.key.to_user_string(): a
    for a in (rc_range, rc_long, rc_up, rc_down, rc_jobbed, rc_a_up, rc_a_mid, rc_a_down, rc_j_up, rc_j_down)
}


def definitions(
    resource: JobLeaseResource | None = None, sensors: list[dg.SensorDefinition] | None = None
) -> dg.Definitions:
    """Every asset and the asset job, with ``resource`` (default: from the environment) as ``joblease``."""
    return dg.Definitions(
        assets=list(ASSETS.values()),
        jobs=[rc_asset_job, rc_pair_job],
        sensors=sensors or [],
        resources={"joblease": resource or JobLeaseResource()},
    )


defs = definitions()
