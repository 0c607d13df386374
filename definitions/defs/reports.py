"""A leased, daily-partitioned asset: each day's revenue report is announced downstream once.

Its schedule and reconciliation sensor are Components (``reports_schedule/defs.yaml``,
``reports_reconcile/defs.yaml``) that reach this asset by path (``defs_path: reports.py``) and key.
"""

from __future__ import annotations

import dagster as dg

from dagster_joblease.dagster import LeasedRun, leased_asset

REPORTS_CODE = "daily-revenue-report"
REPORTS_TOPIC = "reports.daily"

daily_partitions = dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="UTC")


@leased_asset(code=REPORTS_CODE, partitions_def=daily_partitions, group_name="reports")
def daily_revenue_report(run: LeasedRun) -> None:
    """One day's revenue report, published once (lease code daily-revenue-report)."""
    day = run.partition_key
    assert day is not None
    with run.transaction() as conn:
        run.enqueue_once(conn, topic=REPORTS_TOPIC, payload={"reportDate": day})
