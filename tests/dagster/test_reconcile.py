"""The reconciliation sensor on a PostgreSQL-backed instance: what it relaunches, what it leaves alone.

Lease rows are made by the real LeaseService; Dagster runs are stored in the real instance with the
statuses and tags the daemon would give them. The sensor is evaluated as the daemon evaluates it.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.events import EngineEventData
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin

from dagster_joblease import JobIdentity, LeaseService, create_engine, errors, outbox
from dagster_joblease.dagster import JobLeaseResource, build_reconciliation_sensor, metadata
from dagster_joblease.dagster.holders import encode_holder
from dagster_joblease.dagster.jobs import BACKLOG_CHECK, DEAD_ROWS_CHECK, UNROUTED_CHECK, OutboxHealth
from dagster_joblease.dagster.metadata import TAG_OUTCOME, TAG_RELAUNCH
from dagster_joblease.dagster.ops import leased_op
from dagster_joblease.dispatch import Route
from dagster_joblease.storage.schema import lease_table
from tests.conftest import wait_until
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

DAYS = [f"2024-02-{d:02d}" for d in range(1, 8)]
JOBS: dict[str, dg.JobDefinition] = {}


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    eng = create_engine(dagster_pg.joblease_url)
    yield eng
    eng.dispose()


@pytest.fixture
def case() -> tuple[str, dg.JobDefinition]:
    """A fresh code and job name per test (the module shares one database and one instance)."""
    suffix = uuid.uuid4().hex[:6]
    code = f"rc-{suffix}"
    job = JOBS[f"rc_job_{suffix}"] = jobs._job(code, f"rc_job_{suffix}")
    return code, job


def _tick(
    dagster_pg: DagsterPg, sensor: dg.SensorDefinition, cursor: str | None = None
) -> tuple[list[dg.RunRequest], str, dict[str, Any], Any]:
    job = None if sensor.asset_selection is not None else JOBS[sensor.job_name]
    defs = dg.Definitions(
        jobs=[job] if job else [],
        assets=[] if job else [jobs.leased_daily_asset],
        sensors=[sensor],
        resources={"joblease": JobLeaseResource()},
    )
    with dg.build_sensor_context(
        instance=dagster_pg.instance,
        resources={"joblease": JobLeaseResource()},
        cursor=cursor,
        definitions=defs,
    ) as context:
        data = sensor.evaluate_tick(context)
    return list(data.run_requests or []), data.skip_message or "", json.loads(data.cursor or "{}"), data


def _origin(job_name: str) -> RemoteJobOrigin:
    location = RegisteredCodeLocationOrigin(location_name="tests")
    return RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(
            code_location_origin=location, repository_name="__repository__"
        ),
        job_name=job_name,
    )


def _run(
    dagster_pg: DagsterPg,
    job: dg.JobDefinition,
    key: str,
    status: dg.DagsterRunStatus,
    tags: dict[str, str] | None = None,
) -> dg.DagsterRun:
    return dagster_pg.instance.create_run_for_job(
        job,
        status=status,
        tags={"dagster/partition": key, **(tags or {})},
        remote_job_origin=_origin(job.name),
    )


def launched(sensor: dg.SensorDefinition, request: dg.RunRequest) -> dict[str, str]:
    """The tags of the run the daemon launches for ``request``: Dagster adds the sensor's name."""
    return {**request.tags, "dagster/sensor_name": sensor.name}


def _fail(engine: sa.Engine, code: str, key: str) -> int:
    service = LeaseService(engine)
    held = service.acquire(JobIdentity.schedule(code, key))
    assert held is not None
    service.fail(held, "boom")
    return held.attempt


def _set_idle(engine: sa.Engine, code: str, key: str, seconds: int) -> None:
    """Move a lease's last activity into the past (as if it failed ``seconds`` ago)."""
    t = lease_table
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.code == code, t.c.run_key == key)
            .values(
                finished_at=sa.func.clock_timestamp() - dt.timedelta(seconds=seconds),
                heartbeat_at=sa.func.clock_timestamp() - dt.timedelta(seconds=seconds),
            )
        )


def test_failed_and_expired_leases_are_relaunched_live_and_done_ones_are_not(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    code, job = case
    service = LeaseService(engine)
    attempt = _fail(engine, code, DAYS[0])
    expired = service.acquire(JobIdentity.schedule(code, DAYS[1]), lease_ms=3)
    assert expired is not None
    live = service.acquire(JobIdentity.schedule(code, DAYS[2]), lease_ms=600_000)
    assert live is not None
    done = service.acquire(JobIdentity.schedule(code, DAYS[3]))
    assert done is not None
    service.complete(done)
    with engine.connect() as conn:  # the 3 ms lease is past its expiry on the database clock
        wait_until(
            lambda: conn.execute(
                sa.select(lease_table.c.expires_at < sa.func.clock_timestamp()).where(
                    lease_table.c.run_key == DAYS[1]
                )
            ).scalar_one()
        )

    sensor = build_reconciliation_sensor(job, code=code)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    requests, _, _, _ = _tick(dagster_pg, sensor)
    by_key = {r.partition_key: r for r in requests}
    assert set(by_key) == {DAYS[0], DAYS[1]}
    first = by_key[DAYS[0]]
    assert first.run_key == f"reconcile:{code}:{DAYS[0]}:attempt-{attempt}:relaunch-1"
    assert first.tags[TAG_RELAUNCH] == "1/5" and first.tags[TAG_OUTCOME] == "pending"
    # Two launch tags on top of the pending outcome; Dagster names the sensor (the cap counts by it).
    assert {t for t in first.tags if t.startswith("joblease/")} == {
        TAG_OUTCOME,
        TAG_RELAUNCH,
        "joblease/reconcile_reason",
    }
    assert first.tags["dagster/sensor_name"] == sensor.name
    assert first.tags["joblease/reconcile_reason"] == "lease FAIL"
    assert by_key[DAYS[1]].tags["joblease/reconcile_reason"] == "lease expired"

    # The daemon launched them; while they are queued, nothing new is requested.
    for key in (DAYS[0], DAYS[1]):
        _run(dagster_pg, job, key, dg.DagsterRunStatus.QUEUED, launched(sensor, by_key[key]))
    requests, message, _, _ = _tick(dagster_pg, sensor)
    assert requests == []
    assert "already queued or running" in message and "1 held by a live lease" in message


def test_relaunches_back_off_are_capped_and_the_cap_is_visible(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    code, job = case
    key = DAYS[0]
    _fail(engine, code, key)
    sensor = build_reconciliation_sensor(
        job, code=code, max_relaunches=3, backoff=dt.timedelta(minutes=10), max_backoff=dt.timedelta(hours=1)
    )
    run_keys = []
    for relaunch in range(1, 4):
        requests, message, _, _ = _tick(dagster_pg, sensor)
        if relaunch > 1:
            # The relaunched run failed again just now: the next relaunch waits (10 min, then 20 min).
            assert requests == [] and f"{key} (relaunch {relaunch} in" in message, message
            _set_idle(engine, code, key, seconds=10 * 60 * 2 ** (relaunch - 2) + 5)
            requests, message, _, _ = _tick(dagster_pg, sensor)
        (request,) = requests
        assert request.tags[TAG_RELAUNCH] == f"{relaunch}/3"
        run_keys.append(request.run_key)
        _run(dagster_pg, job, key, dg.DagsterRunStatus.FAILURE, launched(sensor, request))
        _fail(engine, code, key)  # the relaunched run took the lease and failed again
    assert len(set(run_keys)) == 3  # never collides with an earlier attempt's key

    _set_idle(engine, code, key, seconds=24 * 3600)
    requests, message, cursor, _ = _tick(dagster_pg, sensor)
    assert requests == []
    assert f"CAPPED after 3 relaunches: {key} (3 relaunches (lease FAIL)" in message
    assert key in cursor["capped"] and cursor["capped_count"] == 1


def test_a_canceled_partition_is_left_alone_unless_configured(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    code, job = case
    _fail(engine, code, DAYS[0])  # a terminated run releases its lease: FAIL
    _run(dagster_pg, job, DAYS[0], dg.DagsterRunStatus.CANCELED)
    requests, message, _, _ = _tick(dagster_pg, build_reconciliation_sensor(job, code=code))
    assert requests == [] and f"latest run canceled, not relaunched (relaunch_canceled=False): {DAYS[0]}" in (
        message
    )
    eager = build_reconciliation_sensor(job, code=code, relaunch_canceled=True, name="eager_reconcile")
    (request,) = _tick(dagster_pg, eager)[0]
    assert request.partition_key == DAYS[0]


def test_a_run_that_failed_as_held_is_relaunched_once_the_holder_is_done(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    code, job = case
    service = LeaseService(engine)
    holder = service.acquire(JobIdentity.schedule(code, DAYS[0]), lease_ms=600_000)
    assert holder is not None
    held = _run(dagster_pg, job, DAYS[0], dg.DagsterRunStatus.FAILURE, {TAG_OUTCOME: "held"})
    # What the run's leased step recorded (its own event, which reconciliation reads; the tag is for people).
    dagster_pg.instance.report_engine_event(
        f"{metadata.STEP_EVENT_MESSAGE}: held:1",
        held,
        EngineEventData(
            metadata={
                metadata.META_CODE: dg.MetadataValue.text(code),
                metadata.META_OUTCOME: dg.MetadataValue.text(metadata.HELD),
            }
        ),
        step_key=f"{job.name}_op",
    )
    sensor = build_reconciliation_sensor(job, code=code)
    requests, message, _, _ = _tick(dagster_pg, sensor)
    assert requests == [] and "1 held by a live lease" in message  # the holder is still working

    service.complete(holder)  # the holder succeeded: the partition's latest run must not stay red
    (request,) = _tick(dagster_pg, sensor)[0]
    assert request.partition_key == DAYS[0]
    # The reason names the run that failed and who did the key; the run key the lease's attempt.
    assert request.tags["joblease/reconcile_reason"].startswith(f"run {held.run_id} failed: held; done by ")
    assert request.run_key == f"reconcile:{code}:{DAYS[0]}:attempt-{holder.attempt}:relaunch-1"

    _run(dagster_pg, job, DAYS[0], dg.DagsterRunStatus.SUCCESS, launched(sensor, request))
    assert _tick(dagster_pg, sensor)[0] == []  # a later run settled it


def test_catch_up_requests_never_attempted_partitions_oldest_first_bounded_per_tick(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    code, job = case
    service = LeaseService(engine)
    done = service.acquire(JobIdentity.schedule(code, DAYS[1]))
    assert done is not None
    service.complete(done)
    sensor = build_reconciliation_sensor(job, code=code, catch_up_from=DAYS[0], max_requests_per_tick=3)
    requests, _, _, _ = _tick(dagster_pg, sensor)
    assert [r.partition_key for r in requests] == [DAYS[0], DAYS[2], DAYS[3]]
    assert all(r.tags["joblease/reconcile_reason"] == "never attempted (catch-up)" for r in requests)
    for request in requests:
        _run(
            dagster_pg,
            job,
            request.partition_key or "",
            dg.DagsterRunStatus.STARTED,
            launched(sensor, request),
        )
    requests, _, _, _ = _tick(dagster_pg, sensor)
    assert [r.partition_key for r in requests] == [DAYS[4], DAYS[5], DAYS[6]]

    with pytest.raises(errors.ConfigurationError, match="not a partition key"):
        build_reconciliation_sensor(job, code=code, catch_up_from="not-a-day")


def test_leases_outside_the_lookback_window_are_not_relaunched(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    code, job = case
    _fail(engine, code, DAYS[0])
    _set_idle(engine, code, DAYS[0], seconds=3 * 3600)
    old = build_reconciliation_sensor(job, code=code, lookback=dt.timedelta(hours=2))
    assert _tick(dagster_pg, old)[0] == []
    wide = build_reconciliation_sensor(job, code=code, lookback=dt.timedelta(hours=4), name="wide")
    assert [r.partition_key for r in _tick(dagster_pg, wide)[0]] == [DAYS[0]]


def test_a_leased_asset_is_relaunched_as_an_asset_run(dagster_pg: DagsterPg, engine: sa.Engine) -> None:
    _fail(engine, "t-asset", "2024-03-01")
    sensor = build_reconciliation_sensor(jobs.leased_daily_asset, code="t-asset")
    (request,) = [r for r in _tick(dagster_pg, sensor)[0] if r.partition_key == "2024-03-01"]
    assert request.asset_selection == [jobs.leased_daily_asset.key]


def test_the_sensor_reports_the_outbox_checks_on_its_own(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    code, job = case
    topic = f"rc.{code}"
    with engine.begin() as conn:
        outbox.enqueue_once(conn, idempotency_key=f"v2:{code}", topic=topic, payload={})
    health = OutboxHealth(routes={topic: Route("http://127.0.0.1:9/x")}, stale_due_ms=0)
    sensor = build_reconciliation_sensor(job, code=code, health=health, checks_interval_seconds=3600)
    _, _, cursor, data = _tick(dagster_pg, sensor)
    checks = {e.check_name: e for e in data.asset_events}
    assert set(checks) == {DEAD_ROWS_CHECK, BACKLOG_CHECK, UNROUTED_CHECK}
    assert checks[DEAD_ROWS_CHECK].passed and checks[UNROUTED_CHECK].passed
    assert checks[BACKLOG_CHECK].metadata["due"] == dg.MetadataValue.int(1)
    # Within the interval the checks are not evaluated again; the cursor remembers when they were.
    assert _tick(dagster_pg, sensor, json.dumps(cursor))[3].asset_events == []


def test_bad_arguments_are_refused_before_anything_runs(case: tuple[str, dg.JobDefinition]) -> None:
    code, job = case
    with pytest.raises(errors.ConfigurationError, match="max_relaunches must be an int >= 1, got 0"):
        build_reconciliation_sensor(job, code=code, max_relaunches=0)
    with pytest.raises(errors.ConfigurationError, match="no partitions_def"):
        build_reconciliation_sensor(dg.GraphDefinition("g").to_job(), code=code)
    with pytest.raises(errors.ConfigurationError, match="lookback"):
        build_reconciliation_sensor(job, code=code, lookback=dt.timedelta(seconds=-1))


def test_a_dead_or_zombie_dagster_holder_is_relaunched_a_live_one_is_not(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    """A holder whose heartbeat is a minute old (six of its own 10 s intervals) is dead when its Dagster run
    here is finished, and a zombie when that run is still STARTED (the liveness rule, #35: four missed
    intervals; it used to count as live until its lease expired, up to 15 minutes later). Either way the
    sensor fails its lease, fenced, and relaunches the partition, which reclaims it. A STARTED holder that
    heartbeats is live."""
    code, job = case
    service = LeaseService(engine, lease_ms=600_000, heartbeat_ms=10_000)  # dead: 4 x 10 s missed
    runs = {}
    for key, status in (
        (DAYS[0], dg.DagsterRunStatus.FAILURE),
        (DAYS[1], dg.DagsterRunStatus.STARTED),
        (DAYS[2], dg.DagsterRunStatus.STARTED),
    ):
        runs[key] = _run(dagster_pg, job, key, status)
        held = service.try_acquire(
            JobIdentity.schedule(code, key), holder=encode_holder("tests", runs[key].run_id)
        )
        assert held.acquired
    for key in DAYS[:2]:
        _set_idle(engine, code, key, seconds=60)  # no heartbeat for a minute; the lease runs 10 minutes
    patient = build_reconciliation_sensor(job, code=code, holder_stale_ms=3_600_000, name="patient")
    requests, message, _, _ = _tick(dagster_pg, patient)
    assert requests == [] and "3 held by a live lease" in message, message

    sensor = build_reconciliation_sensor(job, code=code)
    requests, message, _, _ = _tick(dagster_pg, sensor)
    reasons = {r.partition_key: r.tags["joblease/reconcile_reason"] for r in requests}
    assert reasons == {
        DAYS[0]: f"dead holder dagster:tests/{runs[DAYS[0]].run_id}",
        DAYS[1]: f"zombie holder dagster:tests/{runs[DAYS[1]].run_id}",
    }, message
    with engine.connect() as conn:
        statuses = dict(
            conn.execute(
                sa.select(lease_table.c.run_key, lease_table.c.status).where(lease_table.c.code == code)
            ).all()
        )
    assert statuses == {DAYS[0]: "FAIL", DAYS[1]: "FAIL", DAYS[2]: "RUNNING"}  # freed for the relaunches
    for key in DAYS[:2]:  # neither can record its own end: both say lost
        dead = dagster_pg.instance.get_run_by_id(runs[key].run_id)
        assert dead is not None and dead.tags[TAG_OUTCOME] == "lost"


def test_a_failed_partition_converges_without_dagster_run_retries(
    dagster_pg: DagsterPg,
    engine: sa.Engine,
    case: tuple[str, dg.JobDefinition],
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, job = case
    marker = tmp_path / "fail-once"
    marker.write_text("")
    monkeypatch.setenv(jobs.FAIL_ONCE_ENV, str(marker))
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    first = job.execute_in_process(
        partition_key=DAYS[0], instance=dagster_pg.instance, run_config=quiet, raise_on_error=False
    )
    assert not first.success  # the body failed once: lease FAIL, run FAILURE, no run retries configured

    sensor = build_reconciliation_sensor(job, code=code)
    (request,) = _tick(dagster_pg, sensor)[0]
    relaunch = job.execute_in_process(  # what the daemon does with the request
        partition_key=request.partition_key, instance=dagster_pg.instance, run_config=quiet, tags=request.tags
    )
    assert relaunch.success
    with engine.connect() as conn:
        status, attempt = conn.execute(
            sa.select(lease_table.c.status, lease_table.c.attempt).where(
                lease_table.c.code == code, lease_table.c.run_key == DAYS[0]
            )
        ).one()
    assert (status, attempt) == ("SUCCESS", 2)
    requests, message, _, _ = _tick(dagster_pg, sensor)
    assert requests == [] and message.startswith("0 relaunched")


def test_re_executions_and_retries_of_a_relaunch_do_not_count_as_relaunches(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    """Dagster copies the parent's tags into a re-execution or run retry; only the sensor's launches count."""
    code, job = case
    key = DAYS[0]
    _fail(engine, code, key)
    sensor = build_reconciliation_sensor(job, code=code, max_relaunches=2, backoff=dt.timedelta(seconds=1))
    (request,) = _tick(dagster_pg, sensor)[0]
    relaunch = _run(dagster_pg, job, key, dg.DagsterRunStatus.FAILURE, launched(sensor, request))
    for _ in range(2):  # a person's re-execution and a run retry, both inheriting the relaunch's tags
        dagster_pg.instance.create_run_for_job(
            job,
            status=dg.DagsterRunStatus.FAILURE,
            tags={"dagster/partition": key, **launched(sensor, request)},
            remote_job_origin=_origin(job.name),
            parent_run_id=relaunch.run_id,
            root_run_id=relaunch.run_id,
        )
    _fail(engine, code, key)
    _set_idle(engine, code, key, seconds=3600)
    (second,) = _tick(dagster_pg, sensor)[0]
    assert second.tags[TAG_RELAUNCH] == "2/2"
    assert second.run_key.endswith(":relaunch-2")


def test_dagster_run_retries_of_a_relaunch_count_against_the_cap(
    dagster_pg: DagsterPg, engine: sa.Engine, case: tuple[str, dg.JobDefinition]
) -> None:
    """#35 item 4: with Dagster's run retries on (3 per run), every retry of a relaunch is an attempt: a
    partition that always fails is capped after max_relaunches attempts. (Only root runs counted, among the
    newest cap + 10 runs read: with retries the cap never tripped.)"""
    code, job = case
    key = DAYS[0]
    _fail(engine, code, key)
    sensor = build_reconciliation_sensor(job, code=code, max_relaunches=5, backoff=dt.timedelta(seconds=1))
    for relaunch in (1, 2):
        requests, message, _, _ = _tick(dagster_pg, sensor)
        assert requests, message
        (request,) = requests
        assert request.tags[TAG_RELAUNCH] == f"{relaunch}/5"
        parent = _run(dagster_pg, job, key, dg.DagsterRunStatus.FAILURE, launched(sensor, request))
        root = parent.run_id
        for number in (1, 2, 3):  # the retry daemon's runs: each a child of the last, dagster/retry_number
            parent = dagster_pg.instance.create_run_for_job(
                job,
                status=dg.DagsterRunStatus.FAILURE,
                tags={
                    "dagster/partition": key,
                    **launched(sensor, request),
                    "dagster/retry_number": str(number),
                },
                remote_job_origin=_origin(job.name),
                parent_run_id=parent.run_id,
                root_run_id=root,
            )
        _fail(engine, code, key)  # the last retry took the lease and failed again
        _set_idle(engine, code, key, seconds=3600)
    requests, message, cursor, _ = _tick(dagster_pg, sensor)
    assert requests == [], message
    assert f"CAPPED after 5 relaunches: {key} (8 attempts (2 relaunches and run retries)" in message
    assert key in cursor["capped"]


def test_held_runs_beyond_one_page_are_all_reached_in_turn(
    dagster_pg: DagsterPg,
    engine: sa.Engine,
    case: tuple[str, dg.JobDefinition],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More runs failed as held than one tick names: the walk over the runs this deployment left undone
    resumes from the cursor, so the oldest held partition is not starved (it was, when only the newest
    500 were ever read)."""
    from dagster_joblease.dagster.reconcile import facts
    from dagster_joblease.dagster.reconcile import sensor as reconcile_sensor

    monkeypatch.setattr(facts, "RUNS_PER_PAGE", 2)
    monkeypatch.setattr(reconcile_sensor, "WALK_NAMED_PER_TICK", 2)
    code, job = case
    for day in DAYS:  # oldest first: DAYS[0]'s held run is the oldest
        _run(dagster_pg, job, day, dg.DagsterRunStatus.FAILURE, {TAG_OUTCOME: "held"})
    sensor = build_reconciliation_sensor(job, code=code)
    requested: list[str] = []
    cursor: str | None = None
    for _ in range(len(DAYS)):
        requests, _, new_cursor, _ = _tick(dagster_pg, sensor, cursor)
        cursor = json.dumps(new_cursor)
        for request in requests:
            assert request.partition_key is not None
            requested.append(request.partition_key)
            # the relaunch ran and succeeded: that partition is settled from now on
            _run(
                dagster_pg, job, request.partition_key, dg.DagsterRunStatus.SUCCESS, launched(sensor, request)
            )
        if set(requested) == set(DAYS):
            break
    assert sorted(requested) == sorted(DAYS)  # each once, the oldest included


def test_a_key_that_is_no_longer_a_partition_is_reported_and_passed(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """#35 item 7: a failed key whose dynamic partition was deleted is reported and passed, and the sweep
    moves past it (it used to stay unjudged: the sweep resumed before it on every tick, "rows still to look
    at" for good, and keys after it beyond the recent page were never requested)."""
    suffix = uuid.uuid4().hex[:6]
    code, name = f"rc-dyn-{suffix}", f"rc_dyn_{suffix}"
    dynamic = dg.DynamicPartitionsDefinition(name=f"dyn_{suffix}")
    op = leased_op(code=code, name=f"{name}_op")(jobs.write_domain_and_outbox)

    @dg.job(name=name, partitions_def=dynamic, resource_defs={"joblease": JobLeaseResource()})
    def dynamic_job() -> None:
        op()

    JOBS[name] = dynamic_job
    instance = dagster_pg.instance
    instance.add_dynamic_partitions(dynamic.name or "", ["a", "b", "c"])
    for key in ("a", "b", "c"):
        _fail(engine, code, key)
    instance.delete_dynamic_partition(dynamic.name or "", "b")

    sensor = build_reconciliation_sensor(dynamic_job, code=code)
    with dg.partition_loading_context(dynamic_partitions_store=instance):  # Dagster validates the requests
        requests, message, cursor, _ = _tick(dagster_pg, sensor)
    assert sorted(str(r.partition_key) for r in requests) == ["a", "c"], message
    assert cursor["sweep_after"] == 0 and cursor["gone"] == ["b"]  # the sweep reached its end; b reported
    for key in ("a", "c"):  # their relaunches ran
        _run(dagster_pg, dynamic_job, key, dg.DagsterRunStatus.SUCCESS, launched(sensor, requests[0]))
        service = LeaseService(engine)
        held = service.acquire(JobIdentity.schedule(code, key))
        assert held is not None
        service.complete(held)
    with dg.partition_loading_context(dynamic_partitions_store=instance):
        requests, message, cursor, _ = _tick(dagster_pg, sensor, json.dumps(cursor))
    assert requests == [] and "no longer a partition, passed: b" in message, message
    assert "0 lease rows still to look at" in message and cursor["sweep_after"] == 0, message
