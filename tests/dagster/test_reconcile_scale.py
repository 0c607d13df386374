"""Reconciliation past 1,000 rows and runs, and whatever launched a partition's runs.

Lease rows are written in bulk as the lease service writes them (FAIL after a failed attempt); Dagster
runs are stored in the real PostgreSQL-backed instance with the statuses and tags the daemon gives them
(``dagster/sensor_name`` on a sensor's launches, ``dagster/asset_partition_range_start``/``_end`` on range
runs). The sensor is evaluated as the daemon evaluates it; between ticks the partitions it requested are
marked as the relaunched runs leave them (claimed: a live lease), which is what the daemon's launches do.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource, build_reconciliation_sensor, leased_asset, leased_op
from dagster_joblease.dagster.holders import encode_holder
from dagster_joblease.dagster.metadata import TAG_OUTCOME, TAG_RELAUNCH
from dagster_joblease.storage.schema import lease_table
from tests.dagster import jobs
from tests.dagster import reconcile_helpers as helpers
from tests.dagster.conftest import DagsterPg

LONG = dg.DailyPartitionsDefinition(start_date="2008-01-01", end_date="2024-01-01")
SENSOR_TAG = "dagster/sensor_name"
RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    eng = create_engine(dagster_pg.joblease_url)
    yield eng
    eng.dispose()


def _job(code: str) -> dg.JobDefinition:
    name = f"sc_{code.replace('-', '_')}"
    op = leased_op(code=code, name=f"{name}_op")(jobs.write_domain_and_outbox)

    @dg.job(name=name, partitions_def=LONG, executor_def=dg.in_process_executor)
    def _the_job() -> None:
        op()

    return _the_job


def _keys(count: int) -> list[str]:
    with dg.partition_loading_context(effective_dt=dt.datetime(2025, 1, 1, tzinfo=dt.UTC)):
        return list(LONG.get_partition_keys())[:count]


def claim(engine: sa.Engine, code: str, keys: Sequence[str]) -> None:
    """What the relaunched runs do first: claim the partition (a live lease)."""
    t = lease_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.code == code, t.c.run_key.in_(list(keys)))
            .values(
                status="RUNNING",
                attempt=t.c.attempt + 1,
                heartbeat_at=sa.func.clock_timestamp(),
                expires_at=sa.func.clock_timestamp() + dt.timedelta(hours=1),
                finished_at=None,
            )
        )


def tick(
    dagster_pg: DagsterPg, defs: dg.Definitions, sensor: dg.SensorDefinition, cursor: str | None = None
) -> tuple[list[dg.RunRequest], str, str, Any]:
    with dg.build_sensor_context(
        instance=dagster_pg.instance,
        resources={"joblease": JobLeaseResource()},
        cursor=cursor,
        definitions=defs,
    ) as context:
        data = sensor.evaluate_tick(context)
    return list(data.run_requests or []), data.skip_message or "", data.cursor or "{}", data


def run_of(
    dagster_pg: DagsterPg,
    job: dg.JobDefinition,
    status: dg.DagsterRunStatus,
    tags: dict[str, str],
    asset_selection: frozenset[dg.AssetKey] | None = None,
) -> dg.DagsterRun:
    """A run stored as the daemon stores it (no execution plan)."""
    return dagster_pg.instance.add_run(helpers.stored_run(job.name, status, tags, asset_selection))


def test_5000_partitions_with_1500_canceled_capped_or_backing_off_converge(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    code = f"sc-{uuid.uuid4().hex[:6]}"
    job = _job(code)
    keys = _keys(5_000)
    cap = 2
    sensor = build_reconciliation_sensor(
        job,
        code=code,
        max_relaunches=cap,
        max_requests_per_tick=500,
        lookback=dt.timedelta(days=30),
        backoff=dt.timedelta(hours=1),  # the 500 relaunched a minute ago stay backing off all test long
    )
    defs = dg.Definitions(jobs=[job], sensors=[sensor], resources={"joblease": JobLeaseResource()})
    # The oldest 1,500 rows are the blocked ones, so a window over the first rows (by key or by age) would
    # see only them: 500 canceled by a person, 500 at the relaunch cap, 500 relaunched a minute ago.
    canceled, capped, backing, actionable = keys[:500], keys[500:1_000], keys[1_000:1_500], keys[1_500:]
    helpers.bulk_leases(engine, code, keys[:1_000], ago_s=[86_400 * 3 - i for i in range(1_000)])
    helpers.bulk_leases(engine, code, backing, ago_s=[60.0] * 500)
    helpers.bulk_leases(engine, code, actionable, ago_s=[3_600 + i for i in range(3_500)])
    made = [
        helpers.stored_run(job.name, dg.DagsterRunStatus.CANCELED, {"dagster/partition": key})
        for key in canceled
    ]
    for key in capped:
        for n in range(1, cap + 1):
            tags = {"dagster/partition": key, SENSOR_TAG: sensor.name, TAG_RELAUNCH: f"{n}/{cap}"}
            made.append(helpers.stored_run(job.name, dg.DagsterRunStatus.FAILURE, tags))
    for key in backing:
        tags = {"dagster/partition": key, SENSOR_TAG: sensor.name, TAG_RELAUNCH: f"1/{cap}"}
        made.append(helpers.stored_run(job.name, dg.DagsterRunStatus.FAILURE, tags))
    helpers.add_runs(dagster_pg.instance, made)
    helpers.analyze(engine)

    requested: dict[str, dg.RunRequest] = {}
    cursor: str | None = None
    bound = 3_500 // 500 + 5_000 // 1_000 + 2  # requests per tick, plus one full sweep, plus slack
    slowest = 0.0
    ticks = 0
    for ticks in range(1, bound + 1):  # noqa: B007 (reported below)
        began = time.monotonic()
        requests, message, cursor, _ = tick(dagster_pg, defs, sensor, cursor)
        slowest = max(slowest, time.monotonic() - began)
        for request in requests:
            assert request.partition_key not in requested, "requested twice"
            requested[str(request.partition_key)] = request
        claim(engine, code, [str(r.partition_key) for r in requests])
        if set(requested) >= set(actionable):
            break
    assert set(requested) == set(actionable), (len(requested), message)
    assert all(r.tags[TAG_RELAUNCH] == f"1/{cap}" for r in requested.values())
    print(f"\n5,000 partitions converged in {ticks} ticks (bound {bound}); slowest tick {slowest:.2f} s")

    # Nothing blocked is ever requested through a whole sweep more; the messages say why.
    said = ""
    capped_counts = []
    for _ in range(5_000 // 1_000 + 1):
        requests, message, cursor, _ = tick(dagster_pg, defs, sensor, cursor)
        assert requests == [], message
        said += message
        capped_counts.append(json.loads(cursor)["capped_count"])
    assert "latest run canceled, not relaunched" in said and "CAPPED after 2 relaunches" in said
    assert "backing off" in said
    assert max(capped_counts) > 0


def test_a_new_failure_is_seen_in_one_tick_and_the_skip_says_what_is_left(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    code = f"sn-{uuid.uuid4().hex[:6]}"
    job = _job(code)
    keys = _keys(1_600)
    sensor = build_reconciliation_sensor(job, code=code, lookback=dt.timedelta(days=30))
    defs = dg.Definitions(jobs=[job], sensors=[sensor], resources={"joblease": JobLeaseResource()})
    old = keys[:1_500]
    helpers.bulk_leases(engine, code, old, ago_s=[7_200.0] * 1_500)
    # A person canceled every one of them.
    helpers.add_runs(
        dagster_pg.instance,
        [helpers.stored_run(job.name, dg.DagsterRunStatus.CANCELED, {"dagster/partition": k}) for k in old],
    )
    helpers.analyze(engine)
    requests, message, cursor, _ = tick(dagster_pg, defs, sensor)
    assert requests == []
    assert "lease rows still to look at in this sweep" in message
    left = int(message.split(" lease rows still to look at")[0].rsplit("; ", 1)[-1])
    assert 0 < left <= 1_500 - 1_000

    # A partition that failed just now, sorting last by key: requested on the very next tick.
    helpers.bulk_leases(engine, code, [keys[-1]], ago_s=[1.0])
    (request,) = tick(dagster_pg, defs, sensor, cursor)[0]
    assert request.partition_key == keys[-1]


def test_a_cap_holds_with_more_than_1000_newer_runs_in_view(dagster_pg: DagsterPg, engine: sa.Engine) -> None:
    code = f"sk-{uuid.uuid4().hex[:6]}"
    job = _job(code)
    keys = _keys(1_101)
    sensor = build_reconciliation_sensor(job, code=code, max_relaunches=5, lookback=dt.timedelta(days=30))
    defs = dg.Definitions(jobs=[job], sensors=[sensor], resources={"joblease": JobLeaseResource()})
    capped = keys[0]
    helpers.bulk_leases(engine, code, [capped], ago_s=[86_400.0])
    for n in range(1, 6):
        tags = {"dagster/partition": capped, SENSOR_TAG: sensor.name, TAG_RELAUNCH: f"{n}/5"}
        run_of(dagster_pg, job, dg.DagsterRunStatus.FAILURE, tags)
    # A 1,100-partition outage fills any window of the newest 1,000 runs.
    helpers.add_runs(
        dagster_pg.instance,
        [
            helpers.stored_run(job.name, dg.DagsterRunStatus.SUCCESS, {"dagster/partition": k})
            for k in keys[1:]
        ],
    )
    helpers.analyze(engine)
    requests, message, _, _ = tick(dagster_pg, defs, sensor)
    assert requests == [] and f"CAPPED after 5 relaunches: {capped}" in message, message


# -- assets: asset jobs, range runs, done-but-unrecorded ----------------------------------------------------


def _asset_case(
    code: str,
) -> tuple[dg.AssetsDefinition, dg.JobDefinition, dg.SensorDefinition, dg.Definitions]:
    name = f"as_{code.replace('-', '_')}"

    @leased_asset(code=code, name=name, partitions_def=jobs.days)
    def _asset(run: Any) -> str:
        return jobs.write_domain_and_outbox(run)

    asset_job = dg.define_asset_job(f"{name}_job", selection=[_asset], partitions_def=jobs.days)
    sensor = build_reconciliation_sensor(_asset, code=code, name=f"{name}_reconcile")
    defs = dg.Definitions(
        assets=[_asset], jobs=[asset_job], sensors=[sensor], resources={"joblease": JobLeaseResource()}
    )
    return _asset, defs.resolve_job_def(f"{name}_job"), sensor, defs


def test_a_canceled_asset_job_run_or_range_run_is_left_alone_and_a_running_range_is_in_flight(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    code = f"sa-{uuid.uuid4().hex[:6]}"
    asset, asset_job, sensor, defs = _asset_case(code)
    days = ["2024-05-01", "2024-05-02", "2024-05-03", "2024-05-04"]
    helpers.bulk_leases(engine, code, days, ago_s=[600.0] * 4)
    selection = frozenset({asset.key})
    run_of(dagster_pg, asset_job, dg.DagsterRunStatus.CANCELED, {"dagster/partition": days[0]}, selection)
    range_tags = {RANGE_START: days[1], RANGE_END: days[2]}
    run_of(dagster_pg, asset_job, dg.DagsterRunStatus.CANCELED, range_tags, selection)
    run_of(
        dagster_pg,
        asset_job,
        dg.DagsterRunStatus.STARTED,  # started a moment ago, not claimed yet: may be waiting, in flight
        {RANGE_START: days[3], RANGE_END: days[3]},
        selection,
    )
    requests, message, _, _ = tick(dagster_pg, defs, sensor)
    assert requests == [], [r.partition_key for r in requests]
    assert "latest run canceled, not relaunched" in message
    for day in days[:3]:
        assert day in message
    assert f"a run is already queued or running: {days[3]}" in message


def test_range_keys_never_claimed_are_relaunched_and_a_done_key_without_an_event_is_recorded(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    code = f"sr-{uuid.uuid4().hex[:6]}"
    asset, asset_job, sensor, defs = _asset_case(code)
    selection = frozenset({asset.key})
    # A range run over three days failed after the first: the others were never claimed (not-attempted).
    failed = run_of(
        dagster_pg,
        asset_job,
        dg.DagsterRunStatus.FAILURE,
        {RANGE_START: "2024-06-01", RANGE_END: "2024-06-03"},
        selection,
    )
    helpers.bulk_leases(engine, code, ["2024-06-01"], ago_s=[30.0])
    # Another run completed its lease and was killed before logging the materialization.
    killed = run_of(
        dagster_pg, asset_job, dg.DagsterRunStatus.FAILURE, {"dagster/partition": "2024-06-09"}, selection
    )
    service = LeaseService(engine, holder=encode_holder("tests", killed.run_id))
    done = service.acquire(JobIdentity.schedule(code, "2024-06-09"))
    assert done is not None
    service.complete(done)

    requests, message, _, data = tick(dagster_pg, defs, sensor)
    by_key = {r.partition_key: r for r in requests}
    assert set(by_key) == {"2024-06-01", "2024-06-02", "2024-06-03"}, message
    assert by_key["2024-06-02"].tags["joblease/reconcile_reason"] == f"range run {failed.run_id} failed"
    assert all(r.asset_selection == [asset.key] for r in requests)
    (event,) = [e for e in data.asset_events if isinstance(e, dg.AssetMaterialization)]
    assert (event.asset_key, event.partition) == (asset.key, "2024-06-09")
    assert event.metadata["joblease/winner"] == dg.MetadataValue.dagster_run(killed.run_id)
    assert "2024-06-09" not in by_key  # recorded, not relaunched
    assert all(r.tags[TAG_OUTCOME] == "pending" for r in requests)

    # Once recorded (the daemon stores the sensor's events), nothing more is recorded for it.
    dagster_pg.instance.report_runless_asset_event(event)
    data = tick(dagster_pg, defs, sensor)[3]
    assert not [e for e in data.asset_events if isinstance(e, dg.AssetMaterialization)]
