"""A code location for the skip-recording tests (issue 35 items 9, 11, 12), loaded as Dagster loads one.

``bf_daily``: a leased daily asset an asset backfill runs one partition per run; ``bf_range``: the same
with ``BackfillPolicy.single_run()`` (one run over the range); ``once``: a run-once (``INITIAL``) leased
asset with a plain eager asset downstream (``after_once``). Every body writes a domain row and an outbox
row (``tests.dagster.jobs.write_domain_and_outbox``); the lease database is ``$JOBLEASE_DATABASE_URL``.
"""

from __future__ import annotations

import dagster as dg

from dagster_joblease.dagster import JobLeaseResource, leased_asset
from tests.dagster.jobs import days, write_domain_and_outbox

bf_daily = leased_asset(code="t-skip-bf", name="bf_daily", partitions_def=days)(write_domain_and_outbox)
bf_range = leased_asset(
    code="t-skip-range",
    name="bf_range",
    partitions_def=days,
    backfill_policy=dg.BackfillPolicy.single_run(),
)(write_domain_and_outbox)
once = leased_asset(code="t-skip-once", name="once", initial=True)(write_domain_and_outbox)


@dg.asset(deps=[once], automation_condition=dg.AutomationCondition.eager())
def after_once() -> None:
    """A plain asset that eager automation requests whenever ``once`` is updated."""


defs = dg.Definitions(
    assets=[bf_daily, bf_range, once, after_once],
    resources={"joblease": JobLeaseResource()},
)
