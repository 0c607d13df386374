"""Reconciliation on real runs: every key of every run shape is reached, and nothing is relaunched wrongly.

Real Dagster runs on a PostgreSQL-backed instance (PostgreSQL for the leases too), launched the way the
daemon launches them (the implicit asset job with an asset selection, an explicit asset job, range tags for
a single-run backfill), in their own processes where a test kills or terminates them. The sensor is
evaluated as the daemon evaluates it (its asset events stored), and the runs it requests are executed as
the daemon would launch them, under Dagster's defaults (run monitoring and run retries off). Time passing
for a dead holder is written on the database clock (its heartbeat or expiry moved into the past), never
raced.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, create_engine
from dagster_joblease.dagster import JobLeaseResource, build_reconciliation_sensor
from dagster_joblease.dagster.metadata import TAG_OUTCOME
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.conftest import _admin_execute, clone_template, wait_until
from tests.dagster import jobs, reconcile_assets, reconcile_worker
from tests.dagster import reconcile_helpers as helpers
from tests.dagster.conftest import DagsterPg, psycopg2_url

REPO = Path(__file__).resolve().parents[2]
QUIET = reconcile_worker.QUIET
#: The relaunched runs do not wait for a live holder: they fail ``held`` at once (the sensor comes back).
RELAUNCH_RESOURCE = JobLeaseResource(held_wait_ms=0)


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    eng = create_engine(dagster_pg.joblease_url)
    yield eng
    eng.dispose()


def _days(month: int, first: int, last: int) -> list[str]:
    return [f"2024-{month:02d}-{d:02d}" for d in range(first, last + 1)]


def _hours(start: str, count: int) -> list[str]:
    first = dt.datetime.strptime(start, "%Y-%m-%d-%H:%M")
    return [(first + dt.timedelta(hours=i)).strftime("%Y-%m-%d-%H:%M") for i in range(count)]


def _start(home_env: dict[str, str], target: str, *keys: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.dagster.reconcile_worker", target, *keys],
        cwd=REPO,
        env={**home_env, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=600)
    lines = out.splitlines()
    assert lines, err[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _run(home_env: dict[str, str], target: str, *keys: str, **env: str) -> dict[str, Any]:
    return _result(_start(home_env, target, *keys, **env))


def _blocked(ready: Path, proc: subprocess.Popen[str]) -> tuple[int, str]:
    """Wait until the body blocks in its key; the run worker's pid and the run id."""
    wait_until(
        lambda: (ready.exists() and len(ready.read_text().split()) == 2) or proc.poll() is not None, 120
    )
    assert ready.exists(), proc.communicate()[1][-3000:]
    pid, run_id = ready.read_text().split()
    return int(pid), run_id


def _tick(
    instance: dg.DagsterInstance,
    sensor: dg.SensorDefinition,
    cursor: str | None = None,
    resource: JobLeaseResource | None = None,
) -> tuple[list[dg.RunRequest], str, str | None]:
    """One evaluation as the daemon does it: its asset events are stored on the instance."""
    resource = resource or JobLeaseResource()
    defs = reconcile_assets.definitions(resource, sensors=[sensor])
    with dg.build_sensor_context(
        instance=instance, resources={"joblease": resource}, cursor=cursor, definitions=defs
    ) as context:
        data = sensor.evaluate_tick(context)
    for event in data.asset_events:
        if isinstance(event, dg.AssetMaterialization):
            instance.report_runless_asset_event(event)
    return list(data.run_requests or []), data.skip_message or "", data.cursor


def _reexecute_with_parent_tags(
    job: Any, instance: dg.DagsterInstance, options: dg.ReexecutionOptions
) -> dg.DagsterRun:
    """Re-execute as the UI does: the parent's tags come along (all but Dagster's own; the partition kept)."""
    parent = instance.get_run_by_id(options.parent_run_id)
    assert parent is not None
    copied = {
        k: v for k, v in parent.tags.items() if not k.startswith("dagster/") or k == "dagster/partition"
    }
    with dg.execute_job(job, instance, run_config=QUIET, tags=copied, reexecution_options=options) as child:
        child_id = child.run_id
    run = instance.get_run_by_id(child_id)
    assert run is not None
    return run


def _reconcile_once(instance: dg.DagsterInstance, target: dg.JobDefinition, *, code: str, name: str) -> Any:
    """One tick of a reconciliation sensor over ``target`` in a location with only that sensor."""
    sensor = build_reconciliation_sensor(target, code=code, name=name)
    defs = dg.Definitions(jobs=[target], sensors=[sensor], resources={"joblease": JobLeaseResource()})
    with dg.build_sensor_context(
        instance=instance, resources={"joblease": JobLeaseResource()}, definitions=defs
    ) as context:
        return sensor.evaluate_tick(context)


def _launch(instance: dg.DagsterInstance, sensor: dg.SensorDefinition, request: dg.RunRequest) -> bool:
    """Execute a request as the daemon launches it: the implicit asset job with the request's selection
    and partition, the request's tags plus the sensor's name and run key."""
    defs = reconcile_assets.definitions(RELAUNCH_RESOURCE)
    tags = {**request.tags, "dagster/sensor_name": sensor.name}
    if request.run_key:
        tags["dagster/run_key"] = request.run_key
    result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=instance,
        asset_selection=list(request.asset_selection or []),
        partition_key=request.partition_key,
        tags=tags,
        run_config=QUIET,
        raise_on_error=False,
    )
    return result.success


def _converge(
    instance: dg.DagsterInstance,
    sensor: dg.SensorDefinition,
    ticks: int,
    resource: JobLeaseResource | None = None,
) -> tuple[list[dg.RunRequest], list[str]]:
    """Tick, launch every request, tick again: the requests and the skip messages, in order."""
    cursor: str | None = None
    requested: list[dg.RunRequest] = []
    messages: list[str] = []
    for _ in range(ticks):
        requests, message, cursor = _tick(instance, sensor, cursor, resource)
        messages.append(message)
        requested += requests
        for request in requests:
            _launch(instance, sensor, request)
    return requested, messages


def _leases(engine: sa.Engine, code: str, keys: Sequence[str]) -> dict[str, str]:
    ids = {JobIdentity.schedule(code, k).idempotency_key: k for k in keys}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(lease_table.c.lock_key, lease_table.c.status).where(lease_table.c.lock_key.in_(ids))
        ).all()
    return {ids[key]: status for key, status in rows}


def _effects(engine: sa.Engine, code: str, keys: Sequence[str]) -> dict[str, int]:
    ids = {JobIdentity.schedule(code, k).idempotency_key: k for k in keys}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(outbox_table.c.idempotency_key, sa.func.count())
            .where(outbox_table.c.idempotency_key.in_(ids))
            .group_by(outbox_table.c.idempotency_key)
        ).all()
    return {ids[key]: int(n) for key, n in rows}


def _materialized(instance: dg.DagsterInstance, asset: dg.AssetsDefinition, keys: Sequence[str]) -> set[str]:
    latest = instance.event_log_storage.get_latest_storage_id_by_partition(
        asset.key, dg.DagsterEventType.ASSET_MATERIALIZATION, partitions=set(keys)
    )
    return set(latest)


def _move(engine: sa.Engine, code: str, key: str, **seconds_ago: int) -> None:
    """Move a lease's timestamps into the past on the database clock (as time passing would)."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(lease_table)
            .where(lease_table.c.lock_key == JobIdentity.schedule(code, key).idempotency_key)
            .values(
                **{
                    column: sa.func.clock_timestamp() - dt.timedelta(seconds=ago)
                    for column, ago in seconds_ago.items()
                }
            )
        )


def _requested(requests: Sequence[dg.RunRequest]) -> list[str]:
    return [str(r.partition_key) for r in requests]


# -- 1: a SIGKILLed per-key range run --------------------------------------------------------------------


@pytest.mark.chaos
def test_a_sigkilled_range_runs_untried_keys_are_relaunched_and_every_key_ends_done(
    dagster_pg: DagsterPg, engine: sa.Engine, tmp_path: Path
) -> None:
    """Finding 1: a per-key range 01-06 SIGKILLed inside 03 under Dagster's defaults (the run stays STARTED).
    Once its lease of 03 expired the run is a zombie: 03 and the untried 04-06 are relaunched, the done
    01-02 (killed before their materializations were logged) are recorded, every key ends done once."""
    keys = _days(3, 1, 6)
    code = "t-rc-range"
    ready = tmp_path / "ready"
    proc = _start(
        dagster_pg.env(),
        "rc_range",
        keys[0],
        keys[-1],
        **{reconcile_assets.BLOCK_ENV: keys[2], reconcile_assets.READY_ENV: str(ready)},
    )
    try:
        _pid, run_id = _blocked(ready, proc)
        os.kill(proc.pid, signal.SIGKILL)  # the run worker dies: no release, no run failure event
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    instance = dagster_pg.instance
    killed = instance.get_run_by_id(run_id)
    assert killed is not None and killed.status == dg.DagsterRunStatus.STARTED  # run monitoring is off
    assert _leases(engine, code, keys) == {keys[0]: "SUCCESS", keys[1]: "SUCCESS", keys[2]: "RUNNING"}
    _move(engine, code, keys[2], heartbeat_at=3_600, expires_at=60)  # its 15-minute lease ran out

    sensor = build_reconciliation_sensor(reconcile_assets.rc_range, code=code, max_requests_per_tick=10)
    requested, messages = _converge(instance, sensor, ticks=3)
    assert sorted(_requested(requested)) == keys[2:], messages
    zombie = instance.get_run_by_id(run_id)
    assert zombie is not None and zombie.tags[TAG_OUTCOME] == "lost"
    assert _leases(engine, code, keys) == dict.fromkeys(keys, "SUCCESS")
    assert _effects(engine, code, keys) == dict.fromkeys(keys, 1)
    assert _materialized(instance, reconcile_assets.rc_range, keys) == set(keys)


# -- 2: the tail of a long range ---------------------------------------------------------------------------


def _queue(instance: dg.DagsterInstance, requests: Sequence[dg.RunRequest]) -> None:
    """The daemon launched them: each is a queued run of its partition (in flight) from now on."""
    job = reconcile_assets.definitions().resolve_implicit_global_asset_job_def()
    helpers.add_runs(
        instance,
        [
            helpers.stored_run(
                job.name,
                dg.DagsterRunStatus.NOT_STARTED,
                {**request.tags, "dagster/partition": str(request.partition_key)},
                frozenset(request.asset_selection or []),
            )
            for request in requests
        ],
    )


def test_the_tail_of_a_long_range_is_reached(dagster_pg: DagsterPg, engine: sa.Engine) -> None:
    """Finding 2: a range run of 3,500 hourly keys stopped after its first 3 failed; then the first 3,400
    keys were done (relaunched, each with a SUCCESS lease and a materialization). Keys that already have
    rows must not eat the per-tick budget before they are filtered: the tail (3,401-3,500) is requested.
    (Before, a tick walked the range's first 2,000 keys not among the 1,200 lease rows it had just read:
    with more than 3,200 done keys ahead of it, the tail was never reached, whatever the tick.)

    The range run is stored as the backfill daemon stores it (creating a real run of 3,500 keys logs 3,500
    planned-materialization events, minutes on this machine); the sensor reads it like any other run."""
    keys = _hours("2023-02-01-00:00", 3_500)
    asset = reconcile_assets.rc_long
    instance = dagster_pg.instance
    job = reconcile_assets.definitions().resolve_implicit_global_asset_job_def()
    tags = {
        helpers.RANGE_START: keys[0],
        helpers.RANGE_END: keys[-1],
        TAG_OUTCOME: "failed",
        "joblease/work": "failed:3,not-attempted:3497",
    }
    helpers.add_runs(
        instance, [helpers.stored_run(job.name, dg.DagsterRunStatus.FAILURE, tags, frozenset({asset.key}))]
    )
    helpers.bulk_leases(engine, "t-rc-long", keys[:3_400], ago_s=[600.0] * 3_400, status="SUCCESS")
    helpers.materialize(instance, asset.key, keys[:3_400])
    helpers.analyze(engine)

    sensor = build_reconciliation_sensor(
        asset, code="t-rc-long", max_requests_per_tick=60, name="rc_long_tail"
    )
    cursor: str | None = None
    requested: list[str] = []
    message = ""
    for _ in range(4):
        requests, message, cursor = _tick(instance, sensor, cursor)
        requested += _requested(requests)
        _queue(instance, requests)
        if set(requested) >= set(keys[3_400:]):
            break
    assert sorted(requested) == keys[3_400:], message  # every key of the tail, none twice, nothing done


def test_a_range_of_more_than_10000_keys_hides_no_other_range_run(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """Finding 2: a newer range run of 10,050 keys (stopped after its first 3 failed) neither stops the
    walk nor hides an older range run's untried keys (the older one a real run; the big one stored as the
    daemon stores it, see above)."""
    older = _hours("2024-06-01-00:00", 5)
    result = _run(
        dagster_pg.env(), "rc_long", older[0], older[-1], **{reconcile_assets.FAIL_ENV: ",".join(older[:3])}
    )
    assert not result["ok"]
    assert _leases(engine, "t-rc-long", older) == dict.fromkeys(older[:3], "FAIL")  # 4 and 5: untried
    big = _hours("2025-01-01-00:00", 10_050)
    asset = reconcile_assets.rc_long
    job = reconcile_assets.definitions().resolve_implicit_global_asset_job_def()
    tags = {helpers.RANGE_START: big[0], helpers.RANGE_END: big[-1], TAG_OUTCOME: "failed"}
    helpers.add_runs(
        dagster_pg.instance,
        [helpers.stored_run(job.name, dg.DagsterRunStatus.FAILURE, tags, frozenset({asset.key}))],
    )
    helpers.bulk_leases(engine, "t-rc-long", big[:3], ago_s=[60.0] * 3)
    sensor = build_reconciliation_sensor(
        asset, code="t-rc-long", max_requests_per_tick=20, name="rc_long_big"
    )
    requests, message, cursor = _tick(dagster_pg.instance, sensor)
    got = set(_requested(requests))
    assert set(older) <= got and set(big[:3]) <= got, message
    assert len(got) == 20  # the rest of the big range next ticks: the cursor says where
    _queue(dagster_pg.instance, requests)
    requests, message, _ = _tick(dagster_pg.instance, sensor, cursor)
    later = set(_requested(requests))
    assert len(later) == 20 and later <= set(big[3:]) and not later & got, message


# -- 4: a downstream step is never relaunched without its upstream -----------------------------------------


def test_a_downstream_skipped_because_its_upstream_failed_is_relaunched_with_it(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """Finding 4: a range run of [up, down] over 01-03 in which up fails on 02 (Dagster skips down). down's
    sensor must never request down 02 alone: up 02 goes first, in the same run."""
    keys = _days(4, 1, 3)
    result = _run(
        dagster_pg.env(), "rc_up,rc_down", keys[0], keys[-1], **{reconcile_assets.FAIL_ENV: keys[1]}
    )
    assert not result["ok"]
    assert _leases(engine, "t-rc-up", keys) == {keys[0]: "SUCCESS", keys[1]: "FAIL", keys[2]: "SUCCESS"}
    assert _leases(engine, "t-rc-down", keys) == {}  # down never ran

    sensor = build_reconciliation_sensor(reconcile_assets.rc_down, code="t-rc-down", max_requests_per_tick=10)
    instance = dagster_pg.instance
    requests, message, _ = _tick(instance, sensor)
    by_key = {r.partition_key: r for r in requests}
    for key, request in by_key.items():
        selection = set(request.asset_selection or [])
        if key == keys[1]:
            assert selection == {reconcile_assets.rc_up.key, reconcile_assets.rc_down.key}, request
        else:
            assert reconcile_assets.rc_down.key in selection
    assert keys[1] in by_key, message
    for request in requests:
        assert _launch(instance, sensor, request)
    assert _leases(engine, "t-rc-up", keys) == dict.fromkeys(keys, "SUCCESS")
    assert _leases(engine, "t-rc-down", keys) == dict.fromkeys(keys, "SUCCESS")
    assert _materialized(instance, reconcile_assets.rc_down, keys) == set(keys)


# -- 9: a person's cancel holds for every run shape --------------------------------------------------------


@pytest.mark.chaos
@pytest.mark.parametrize("shape", ["asset-job", "asset-job-range", "range"])
def test_a_run_a_person_canceled_is_left_alone_whatever_its_shape(
    dagster_pg: DagsterPg, engine: sa.Engine, tmp_path: Path, shape: str
) -> None:
    """Finding 9: a person cancels (real termination, inside a key) a run of an explicit asset job
    (``define_asset_job``), a single-run range backfill of that job, or a range run of the implicit asset
    job: with relaunch_canceled=False nothing of it is relaunched; with True, every key it left undone."""
    instance = dagster_pg.instance
    asset, code = reconcile_assets.rc_jobbed, "t-rc-jobbed"
    if shape == "asset-job":
        keys = _days(5, 1, 1)
        args = ["job:rc_asset_job", keys[0]]
    elif shape == "asset-job-range":
        keys = _days(5, 2, 4)
        args = ["job:rc_asset_job", keys[0], keys[-1]]
    else:
        asset, code, keys = reconcile_assets.rc_range, "t-rc-range", _days(5, 5, 7)
        args = ["rc_range", keys[0], keys[-1]]
    ready = tmp_path / "ready"
    block = keys[0] if len(keys) == 1 else keys[1]
    proc = _start(
        dagster_pg.env(),
        *args,
        **{reconcile_assets.BLOCK_ENV: block, reconcile_assets.READY_ENV: str(ready)},
    )
    try:
        _pid, run_id = _blocked(ready, proc)
        run = instance.get_run_by_id(run_id)
        assert run is not None
        instance.report_run_canceling(run)  # what the UI's Terminate does, then the launcher's signal
        proc.send_signal(signal.SIGTERM)
        _result(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    canceled = instance.get_run_by_id(run_id)
    assert canceled is not None and canceled.status == dg.DagsterRunStatus.CANCELED
    assert _leases(engine, code, [block]) == {block: "FAIL"}  # released at the terminate

    sensor = build_reconciliation_sensor(
        asset, code=code, name=f"{asset.key.path[-1]}_cancel_{uuid.uuid4().hex[:4]}"
    )
    requests, message, _ = _tick(instance, sensor)
    assert [r.partition_key for r in requests if r.partition_key in keys] == [], message
    assert "canceled" in message
    eager = build_reconciliation_sensor(
        asset, code=code, relaunch_canceled=True, name=f"eager_{uuid.uuid4().hex[:6]}"
    )
    requests, message, _ = _tick(instance, eager)
    undone = keys[1:] if len(keys) > 1 else keys
    assert sorted(r.partition_key for r in requests if r.partition_key in keys) == undone, message


# -- 10: another deployment finished a key this deployment's range run failed held on ---------------------


@pytest.fixture
def deployment_b(
    dagster_pg: DagsterPg, pg_template: str, tmp_path: Path
) -> Iterator[tuple[dg.DagsterInstance, dict[str, str]]]:
    """A second Dagster deployment (its own run and event storage) on the same lease database."""
    name = f"joblease_dg_b_{uuid.uuid4().hex[:8]}"
    url = clone_template(pg_template, name)
    home = tmp_path / "home_b"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        f"storage:\n  postgres:\n    postgres_url: {psycopg2_url(url)}\ntelemetry:\n  enabled: false\n"
    )
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        yield instance, {**dagster_pg.env(), "DAGSTER_HOME": str(home)}
    finally:
        instance.dispose()
        _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.chaos
def test_a_key_another_deployment_finished_is_materialized_in_this_one(
    dagster_pg: DagsterPg,
    engine: sa.Engine,
    deployment_b: tuple[dg.DagsterInstance, dict[str, str]],
    tmp_path: Path,
) -> None:
    """Finding 10: deployment B's single-run range backfill over 01-03 fails ``held`` on 02 while
    deployment A holds it; A finishes 02. B's reconciliation relaunches or records 02: the asset is
    materialized in B."""
    keys = _days(6, 1, 3)
    instance_b, env_b = deployment_b
    ready, release = tmp_path / "ready", tmp_path / "release"
    holder = _start(
        dagster_pg.env(),
        "rc_range",
        keys[1],
        **{
            reconcile_assets.BLOCK_ENV: keys[1],
            reconcile_assets.READY_ENV: str(ready),
            reconcile_assets.RELEASE_ENV: str(release),
            reconcile_worker.DEPLOYMENT_ENV: "deployment-a",
        },
    )
    try:
        _blocked(ready, holder)
        in_b = _run(
            env_b,
            "rc_range",
            keys[0],
            keys[-1],
            **{reconcile_worker.DEPLOYMENT_ENV: "deployment-b", "JOBLEASE_RC_WAIT": "300"},
        )
        assert not in_b["ok"]
        run_b = instance_b.get_run_by_id(in_b["run_id"])
        assert run_b is not None and run_b.tags[TAG_OUTCOME] == "held"
        release.write_text("")
        assert _result(holder)["ok"]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate(timeout=60)
    assert _leases(engine, "t-rc-range", keys) == dict.fromkeys(keys, "SUCCESS")
    assert _materialized(instance_b, reconcile_assets.rc_range, keys) == {keys[0], keys[2]}

    sensor = build_reconciliation_sensor(reconcile_assets.rc_range, code="t-rc-range", name="rc_range_b")
    _requested_b, messages = _converge(instance_b, sensor, ticks=2)
    assert _materialized(instance_b, reconcile_assets.rc_range, keys) == set(keys), messages
    assert _effects(engine, "t-rc-range", keys) == dict.fromkeys(keys, 1)


# -- 11: a re-execution whose leased step never ran shows no copied outcome --------------------------------


def test_a_reexecution_whose_leased_step_never_ran_says_not_run_in_a_default_deployment(
    dagster_pg: DagsterPg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 11: the deployment has the reconciliation sensor (RUNNING by default) and nothing else; a
    re-execution from failure in which only a later, plain step ran must not keep the parent's ``won``."""
    marker = tmp_path / "fail"
    marker.write_text("")
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    job = dg.reconstructable(jobs.not_run_after_job)
    instance = dagster_pg.instance
    day = "2024-07-01"
    with dg.execute_job(job, instance, run_config=QUIET, tags={"dagster/partition": day}) as parent:
        parent_id = parent.run_id
    marker.unlink()
    parent_run = instance.get_run_by_id(parent_id)
    assert parent_run is not None and parent_run.tags[TAG_OUTCOME] == "won"
    run = _reexecute_with_parent_tags(job, instance, dg.ReexecutionOptions.from_failure(parent_id, instance))
    child_id = run.run_id
    assert run.status == dg.DagsterRunStatus.SUCCESS and run.tags[TAG_OUTCOME] == "won"

    _reconcile_once(instance, jobs.not_run_after_job(), code="t-not-run", name="not_run_after_reconcile")
    after = instance.get_run_by_id(child_id)
    assert after is not None
    assert (after.tags[TAG_OUTCOME], after.tags["joblease/winner"], after.tags["joblease/work"]) == (
        "not-run",
        "none",
        "not-run:1",
    )
    kept = instance.get_run_by_id(parent_id)
    assert kept is not None and kept.tags[TAG_OUTCOME] == "won"  # the parent's own truth stays


def test_an_all_steps_reexecution_failing_before_the_leased_step_says_not_run_in_a_default_deployment(
    dagster_pg: DagsterPg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 11, the other shape: an earlier, plain step fails in a re-execution of every step, so the
    leased step is skipped. The deployment has only the reconciliation sensor (RUNNING by default); the
    re-execution must not keep the parent's ``won``, and the partition, done by the parent, is not
    relaunched."""
    marker = tmp_path / "fail"
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    job = dg.reconstructable(jobs.not_run_before_job)
    instance = dagster_pg.instance
    day = "2024-07-02"
    with dg.execute_job(job, instance, run_config=QUIET, tags={"dagster/partition": day}) as parent:
        parent_id = parent.run_id
    parent_run = instance.get_run_by_id(parent_id)
    assert parent_run is not None and parent_run.tags[TAG_OUTCOME] == "won"
    marker.write_text("")  # now the earlier step fails: the leased one is skipped
    run = _reexecute_with_parent_tags(job, instance, dg.ReexecutionOptions(parent_run_id=parent_id))
    child_id = run.run_id
    assert run.status == dg.DagsterRunStatus.FAILURE and run.tags[TAG_OUTCOME] == "won"

    result = _reconcile_once(
        instance, jobs.not_run_before_job(), code="t-not-run-b", name="not_run_before_reconcile"
    )
    after = instance.get_run_by_id(child_id)
    assert after is not None
    assert (after.tags[TAG_OUTCOME], after.tags["joblease/winner"], after.tags["joblease/work"]) == (
        "not-run",
        "none",
        "not-run:1",
    )
    assert [r.partition_key for r in result.run_requests or []] == []  # the parent did the day
    kept = instance.get_run_by_id(parent_id)
    assert kept is not None and kept.tags[TAG_OUTCOME] == "won"


# -- #35 items 1 and 2: a key's own facts decide, and a relaunch is the run's whole plan ------------------


def _relaunch_as(
    instance: dg.DagsterInstance,
    target: dg.AssetsDefinition,
    code: str,
    key: str,
    upstream: dg.AssetsDefinition,
) -> None:
    """One tick of ``target``'s sensor requests ``key`` with ``upstream`` and ``target`` selected (the
    plan of the run that left it undone), and that relaunch, launched, succeeds."""
    sensor = build_reconciliation_sensor(target, code=code)
    requests, message, _ = _tick(instance, sensor)
    mine = [r for r in requests if r.partition_key == key]
    assert len(mine) == 1, message
    assert set(mine[0].asset_selection or []) == {upstream.key, target.key}
    assert _launch(instance, sensor, mine[0])


def test_a_downstream_that_never_ran_is_relaunched_though_another_leased_step_of_its_run_won(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """#35 item 1: a run of [up (leased), mid (plain, fails), down (leased)] for one partition: up wins,
    mid fails, Dagster skips down. The run's outcome tag (computed from up) says nothing of down: down has
    no lease row, so its sensor relaunches the partition with mid (which did not finish it), never up
    again. (The tag used to keep the run from being walked: down was never requested.)"""
    key = "2024-05-01"
    instance = dagster_pg.instance
    result = _run(
        dagster_pg.env(), "rc_a_up,rc_a_mid,rc_a_down", key, **{reconcile_assets.PLAIN_FAIL_ENV: key}
    )
    assert not result["ok"]
    assert _leases(engine, "t-rc-a-up", [key]) == {key: "SUCCESS"}
    assert _leases(engine, "t-rc-a-down", [key]) == {}  # down never ran

    _relaunch_as(instance, reconcile_assets.rc_a_down, "t-rc-a-down", key, reconcile_assets.rc_a_mid)
    assert _leases(engine, "t-rc-a-down", [key]) == {key: "SUCCESS"}
    assert _effects(engine, "t-rc-a-up", [key]) == {key: 1}  # up's effect once: it was not relaunched


def test_a_define_asset_job_run_whose_upstream_failed_is_relaunched_as_its_whole_plan(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """#35 item 2: in a job made with define_asset_job (its runs record no asset selection), up fails and
    Dagster skips down. down's sensor relaunches the partition as [up, down], never down alone (it used
    to take the run's upstream to be none: down ran alone and its lease was SUCCESS over an unmaterialized
    up)."""
    key = "2024-05-02"
    instance = dagster_pg.instance
    result = _run(dagster_pg.env(), "job:rc_pair_job", key, **{reconcile_assets.FAIL_ENV: key})
    assert not result["ok"]
    assert _leases(engine, "t-rc-j-up", [key]) == {key: "FAIL"}
    assert _leases(engine, "t-rc-j-down", [key]) == {}

    _relaunch_as(instance, reconcile_assets.rc_j_down, "t-rc-j-down", key, reconcile_assets.rc_j_up)
    assert _leases(engine, "t-rc-j-up", [key]) == {key: "SUCCESS"}
    assert _leases(engine, "t-rc-j-down", [key]) == {key: "SUCCESS"}
    assert _materialized(instance, reconcile_assets.rc_j_up, [key]) == {key}


def test_an_op_job_whose_later_leased_op_never_ran_is_relaunched_though_its_first_won(
    dagster_pg: DagsterPg, engine: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#35 item 1, an op job shaped leased -> failing plain -> leased: the first leased op wins, the plain
    one fails, the second leased op never runs. Its sensor relaunches the partition (the whole job: the
    first leased op then skips), whatever the run's outcome tag says (won, from the first op)."""

    @dg.job(
        name="leased_plain_leased_job",
        partitions_def=jobs.days,
        resource_defs={"joblease": jobs.WAIT_RESOURCE},
    )
    def three_steps() -> None:
        jobs.not_run_leased_after(after=jobs.plain_op(after=jobs.not_run_leased()))

    marker = tmp_path / "fail"
    marker.write_text("")
    monkeypatch.setenv(jobs.NOT_RUN_FAIL_ENV, str(marker))
    day = "2024-07-20"
    instance = dagster_pg.instance
    first = three_steps.execute_in_process(
        partition_key=day, instance=instance, run_config=QUIET, raise_on_error=False
    )
    assert not first.success
    assert _leases(engine, "t-not-run", [day]) == {day: "SUCCESS"}
    assert _leases(engine, "t-not-run-b", [day]) == {}

    result = _reconcile_once(instance, three_steps, code="t-not-run-b", name="three_steps_reconcile")
    (request,) = [r for r in result.run_requests or [] if r.partition_key == day]
    marker.unlink()
    again = three_steps.execute_in_process(
        partition_key=day, instance=instance, run_config=QUIET, tags=dict(request.tags)
    )
    assert again.success
    assert _leases(engine, "t-not-run-b", [day]) == {day: "SUCCESS"}
    assert _effects(engine, "t-not-run", [day]) == {day: 1}  # the first leased op skipped
