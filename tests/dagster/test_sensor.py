"""The outbox sensor, the dispatcher job and the delivery checks on a PostgreSQL-backed instance with a
real receiver; and two code locations with different routes sharing one joblease database."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin

from dagster_joblease import create_engine, errors, outbox
from dagster_joblease.dagster import JobLeaseResource, build_dispatcher_job, build_outbox_sensor
from dagster_joblease.dagster.jobs import (
    BACKLOG_CHECK,
    DEAD_ROWS_CHECK,
    OUTBOX_ASSET_KEY,
    UNROUTED_CHECK,
    OutboxHealth,
    outbox_asset_spec,
)
from dagster_joblease.dagster.sensors import NOT_FINISHED_STATUSES
from dagster_joblease.dispatch import Route
from dagster_joblease.receiver import effect_count
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until
from tests.dagster.conftest import DagsterPg
from tests.receiver_proc import ReceiverProcess

QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
REFUSED = "http://127.0.0.1:9"  # nothing listens on the discard port: connection refused, a retryable error


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    eng = create_engine(dagster_pg.joblease_url)
    yield eng
    eng.dispose()


class Location:
    """One code location's delivery: its routes, dispatcher job, outbox sensor and checks."""

    def __init__(self, name: str, routes: dict[str, Route], **health: Any) -> None:
        self.routes = routes
        self.health = OutboxHealth(routes=routes, **health)
        self.job = build_dispatcher_job(routes, name=f"{name}_dispatch_job", health=self.health)
        self.sensor = build_outbox_sensor(
            self.job, name=f"{name}_dispatch_sensor", routes=routes, health=self.health
        )
        self.defs = dg.Definitions(
            assets=[outbox_asset_spec],
            asset_checks=self.health.asset_checks(),
            jobs=[self.job],
            sensors=[self.sensor],
            resources={"joblease": JobLeaseResource()},
        )

    def tick(self, dagster_pg: DagsterPg, cursor: str | None = None) -> Any:
        with dg.build_sensor_context(
            instance=dagster_pg.instance, resources={"joblease": JobLeaseResource()}, cursor=cursor
        ) as context:
            return self.sensor.evaluate_tick(context)

    def dispatch(self, dagster_pg: DagsterPg) -> dg.ExecuteInProcessResult:
        return self.defs.resolve_job_def(self.job.name).execute_in_process(
            instance=dagster_pg.instance, run_config=QUIET, raise_on_error=False
        )


def _origin(job_name: str) -> RemoteJobOrigin:
    # A queued run must name where its code lives; the sensor only reads statuses, so any location works.
    location = RegisteredCodeLocationOrigin(location_name="tests")
    return RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(
            code_location_origin=location, repository_name="__repository__"
        ),
        job_name=job_name,
    )


def _enqueue(engine: sa.Engine, key: str, topic: str) -> None:
    with engine.begin() as conn:
        assert outbox.enqueue_once(conn, idempotency_key=key, topic=topic, payload={"key": key})


def _rows(engine: sa.Engine, topic: str) -> list[tuple[str, int]]:
    t = outbox_table
    with engine.connect() as conn:
        return [(r.status, r.attempts) for r in conn.execute(sa.select(t).where(t.c.topic == topic))]


def _checks(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {c.check_name: c for c in result.get_asset_check_evaluations()}


def _meta(result: dg.ExecuteInProcessResult, node: str) -> dict[str, Any]:
    (event,) = [
        e
        for e in result.all_events
        if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION and e.step_key == node
    ]
    observation = event.asset_observation_data.asset_observation
    assert observation.asset_key == OUTBOX_ASSET_KEY
    return {k: v.value for k, v in observation.metadata.items()}


def test_sensor_requests_one_dispatcher_run_at_a_time_and_the_job_reports(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    instance = dagster_pg.instance
    topic, poison = f"good.{uuid.uuid4().hex[:6]}", f"poison.{uuid.uuid4().hex[:6]}"
    with ReceiverProcess(dagster_pg.joblease_url, always_status_for_topic={poison: 400}) as receiver:
        here = Location(
            "one", {topic: Route(f"{receiver.url}/{topic}"), poison: Route(f"{receiver.url}/{poison}")}
        )
        nothing = here.tick(dagster_pg)
        assert nothing.run_requests == [] and nothing.skip_message == "0 outbox rows due"

        _enqueue(engine, f"v2:{topic}-1", topic)
        _enqueue(engine, f"v2:{topic}-2", topic)
        _enqueue(engine, f"v2:{poison}", poison)
        first = here.tick(dagster_pg)
        (request,) = first.run_requests
        assert request.run_key and request.tags["joblease/due"] == "3"

        # The daemon turns the request into a run; until it finishes, no second dispatcher is requested.
        # QUEUED and NOT_STARTED count as not finished (Dagster's IN_PROGRESS_RUN_STATUSES omits them).
        job_def = here.defs.resolve_job_def(here.job.name)
        run = instance.create_run_for_job(
            job_def,
            status=dg.DagsterRunStatus.NOT_STARTED,
            tags=request.tags,
            remote_job_origin=_origin(job_def.name),
        )
        steps = [
            (None, dg.DagsterRunStatus.NOT_STARTED),
            (dg.DagsterEventType.RUN_ENQUEUED, dg.DagsterRunStatus.QUEUED),
            (dg.DagsterEventType.RUN_STARTING, dg.DagsterRunStatus.STARTING),
            (dg.DagsterEventType.RUN_START, dg.DagsterRunStatus.STARTED),
            (dg.DagsterEventType.RUN_CANCELING, dg.DagsterRunStatus.CANCELING),
        ]
        for event_type, status in steps:
            if event_type is not None:
                instance.report_dagster_event(
                    dg.DagsterEvent(event_type_value=event_type.value, job_name=job_def.name), run.run_id
                )
            stored = instance.get_run_by_id(run.run_id)
            assert stored is not None and stored.status == status and status in NOT_FINISHED_STATUSES
            busy = here.tick(dagster_pg)
            assert busy.run_requests == []
            assert f"dispatcher run {run.run_id} is {status.value}" in busy.skip_message
            assert busy.skip_message.startswith("3 outbox rows due")
        instance.report_dagster_event(
            dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_CANCELED.value, job_name=job_def.name),
            run.run_id,
        )
        (again,) = here.tick(dagster_pg).run_requests  # a finished (canceled) dispatcher no longer blocks
        assert again.run_key != request.run_key

        result = here.dispatch(dagster_pg)
        # The pass dead-lettered the poison row: the run fails (not retried), after its counts and checks.
        counts = _meta(result, f"{here.job.name}_dispatch")
        sent = counts["sent"]
        for _ in range(5):
            # On a loaded machine a delivery can time out: a retry (with backoff) is the dispatcher
            # working as designed; the retried row goes out on a later run.
            if sent == 2:
                break
            wait_until(lambda: outbox.due_summary(engine).due > 0, timeout=10)
            sent += here.dispatch(dagster_pg).output_for_node(f"{here.job.name}_dispatch")["sent"]
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert failure.step_failure_data.error is not None
    message = failure.step_failure_data.user_failure_data.description or ""
    assert "1 outbox row(s) were dead-lettered in this pass" in message
    assert "joblease outbox requeue" in message
    stored = instance.get_run_by_id(result.run_id)
    assert stored is not None and stored.tags.get("dagster/max_retries") == "0"  # no run retry
    assert (counts["claimed"], counts["dead"], counts["sent"] + counts["retried"]) == (3, 1, 2), counts
    assert sent == 2
    assert effect_count(engine) == 2

    meta = counts
    assert meta["due_before"] == 3
    assert meta["result"] == f"delivered {counts['sent']} of 3 claimed row(s)"
    assert meta["delivered_nothing"] is False
    assert {"batches", "lost_claims", "released", "unrecorded", "due_after"} <= set(meta)
    assert (counts["lost_claims"], counts["released"], counts["unrecorded"]) == (0, 0, 0), counts
    checks = _checks(result)
    assert set(checks) == {DEAD_ROWS_CHECK, BACKLOG_CHECK, UNROUTED_CHECK}
    dead = checks[DEAD_ROWS_CHECK]
    assert dead.asset_key == OUTBOX_ASSET_KEY and not dead.passed
    assert dead.severity == dg.AssetCheckSeverity.ERROR
    assert dead.metadata["dead_rows"] == dg.MetadataValue.int(1)
    dead_table = str(dead.metadata["dead"])
    assert f"v2:{poison}" in dead_table and "HTTP 400" in dead_table

    # The finished dispatcher no longer blocks; dead rows are not due, so nothing is requested.
    after = here.tick(dagster_pg)
    assert after.run_requests == [] and after.skip_message == "0 outbox rows due"

    # New work gets a new, different run key (a sensor's run keys dedupe forever).
    _enqueue(engine, f"v2:{topic}-3", topic)
    (second,) = here.tick(dagster_pg).run_requests
    assert second.run_key != request.run_key


def test_a_dispatcher_run_that_delivers_nothing_is_not_green(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    topic = f"down.{uuid.uuid4().hex[:6]}"
    here = Location("down", {topic: Route(f"{REFUSED}/{topic}", timeout_s=1.0)})
    idle = here.dispatch(dagster_pg)
    assert idle.success  # nothing was due: nothing to deliver is a true green
    idle_meta = _meta(idle, f"{here.job.name}_dispatch")
    assert idle_meta["result"] == "nothing was due for this location's topics; delivered nothing"
    assert idle_meta["delivered_nothing"] is True

    for i in range(3):
        _enqueue(engine, f"v2:{topic}-{i}", topic)
    refused = here.dispatch(dagster_pg)
    assert not refused.success  # the downstream refuses connections: a failed (retryable) run
    meta = _meta(refused, f"{here.job.name}_dispatch")
    # Full jitter can make a retried row due again at once, so a run may claim a row more than once.
    claimed = meta["claimed"]
    assert claimed >= 3 and meta["retried"] == claimed and meta["sent"] == 0
    assert meta["result"] == f"delivered NOTHING of {claimed} claimed row(s)"
    assert meta["delivered_nothing"] is True
    (failure,) = [e for e in refused.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert f"delivered NOTHING of {claimed} claimed row(s)" in str(failure.step_failure_data.error)
    backlog = _checks(refused)[BACKLOG_CHECK]
    assert not backlog.passed and backlog.severity == dg.AssetCheckSeverity.WARN
    assert "3 row(s) retrying after a failed delivery attempt" in (backlog.description or "")
    assert [status for status, _ in _rows(engine, topic)] == ["PENDING"] * 3
    assert all(attempts >= 1 for _, attempts in _rows(engine, topic))


def test_the_checks_run_on_their_own_and_from_the_sensor(dagster_pg: DagsterPg, engine: sa.Engine) -> None:
    topic, other = f"chk.{uuid.uuid4().hex[:6]}", f"elsewhere.{uuid.uuid4().hex[:6]}"
    here = Location("chk", {topic: Route(f"{REFUSED}/{topic}")}, stale_due_ms=0, unrouted_after_ms=0)
    _enqueue(engine, f"v2:{topic}-dead", topic)
    with engine.begin() as conn:  # as the dispatcher parks a row after a 4xx
        conn.execute(
            sa.update(outbox_table)
            .where(outbox_table.c.idempotency_key == f"v2:{topic}-dead")
            .values(status="DEAD", attempts=1, last_status=400, last_error="HTTP 400: rejected")
        )
    _enqueue(engine, f"v2:{topic}-due", topic)
    _enqueue(engine, f"v2:{other}", other)  # a topic this location does not route
    wait_until(lambda: outbox.delivery_health(engine, topics=[topic], unrouted_after_ms=0).unrouted > 0)
    wait_until(lambda: (outbox.delivery_health(engine, topics=[topic]).oldest_due_age_ms or 0) > 0)

    checks_job = dg.define_asset_job(
        "outbox_checks_job", selection=dg.AssetSelection.checks_for_assets(OUTBOX_ASSET_KEY)
    )
    defs = dg.Definitions(
        assets=[outbox_asset_spec],
        asset_checks=here.health.asset_checks(),
        jobs=[checks_job],
        resources={"joblease": JobLeaseResource()},
    )
    result = defs.resolve_job_def("outbox_checks_job").execute_in_process(
        instance=dagster_pg.instance, run_config=QUIET
    )
    assert result.success  # a failed check is reported, not a failed run
    checks = _checks(result)
    dead = checks[DEAD_ROWS_CHECK]
    assert dead.passed is False and dead.severity == dg.AssetCheckSeverity.ERROR
    dead_table = str(dead.metadata["dead"])
    assert f"v2:{topic}-dead" in dead_table and "HTTP 400: rejected" in dead_table
    assert other not in dead_table
    backlog = checks[BACKLOG_CHECK]
    assert backlog.passed is False and backlog.severity == dg.AssetCheckSeverity.WARN
    assert "the oldest of 1 due row(s) has waited" in (backlog.description or "")
    unrouted = checks[UNROUTED_CHECK]
    assert unrouted.passed is False and unrouted.severity == dg.AssetCheckSeverity.WARN
    assert other in str(unrouted.metadata["unrouted_topics"])

    # The outbox sensor reports the same checks without any run, at most once per interval.
    data = here.tick(dagster_pg)
    assert {e.check_name: e.passed for e in data.asset_events} == {
        DEAD_ROWS_CHECK: False,
        BACKLOG_CHECK: False,
        UNROUTED_CHECK: False,
    }
    assert here.tick(dagster_pg, data.cursor).asset_events == []


def test_two_code_locations_sharing_one_database_deliver_only_their_own_topics(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    suffix = uuid.uuid4().hex[:6]
    topic_a, topic_b = f"a.{suffix}", f"b.{suffix}"
    with ReceiverProcess(dagster_pg.joblease_url) as receiver:
        location_a = Location("loc_a", {topic_a: Route(f"{receiver.url}/{topic_a}")}, unrouted_after_ms=0)
        location_b = Location("loc_b", {topic_b: Route(f"{receiver.url}/{topic_b}")})
        for i in range(3):
            _enqueue(engine, f"v2:{topic_a}-{i}", topic_a)
            _enqueue(engine, f"v2:{topic_b}-{i}", topic_b)

        # Each location's sensor counts only its own topics.
        assert location_a.tick(dagster_pg).run_requests[0].tags["joblease/due"] == "3"
        assert location_b.tick(dagster_pg).run_requests[0].tags["joblease/due"] == "3"

        result_a = location_a.dispatch(dagster_pg)
        assert result_a.success
        counts_a = result_a.output_for_node(f"{location_a.job.name}_dispatch")
        assert (counts_a["claimed"], counts_a["dead"]) == (3, 0), counts_a
        # B's rows were not touched: still pending, no attempt counted, nothing dead-lettered.
        assert _rows(engine, topic_b) == [("PENDING", 0)] * 3
        wait_until(
            lambda: outbox.delivery_health(engine, topics=[topic_a], unrouted_after_ms=0).unrouted >= 3
        )
        unrouted = _checks(location_a.dispatch(dagster_pg))[UNROUTED_CHECK]
        assert not unrouted.passed and topic_b in str(unrouted.metadata["unrouted_topics"])

        result_b = location_b.dispatch(dagster_pg)
        assert result_b.success
        assert result_b.output_for_node(f"{location_b.job.name}_dispatch")["dead"] == 0
    wait_until(lambda: all(s == "SENT" for s, _ in _rows(engine, topic_a) + _rows(engine, topic_b)))
    assert all(c.passed for c in _checks(result_b).values() if c.check_name == DEAD_ROWS_CHECK)


def test_health_options_are_validated() -> None:
    with pytest.raises(
        errors.ConfigurationError,
        match="stale_due_ms must be an int number of milliseconds from 0 to 3153600000000, got -1",
    ):
        OutboxHealth(stale_due_ms=-1)
    with pytest.raises(errors.ConfigurationError, match="topics='abc' must be a collection"):
        outbox.delivery_health(sa.create_engine("sqlite://"), topics="abc")


def test_a_paused_group_is_skipped_by_the_sensor_and_shown_by_the_job_and_checks(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    from dagster_joblease.storage import route_groups

    topic = f"paused.{uuid.uuid4().hex[:6]}"
    group = f"downstream-{uuid.uuid4().hex[:6]}"
    here = Location("paused", {topic: Route(f"{REFUSED}/{topic}", limit_group=group)})
    _enqueue(engine, f"v2:{topic}-1", topic)
    with engine.begin() as conn:
        route_groups.record_pause(conn, group, 600_000, "HTTP 429 with Retry-After: 600")
    tick = here.tick(dagster_pg)
    assert tick.run_requests == []  # no dispatcher run every tick that would claim nothing
    assert tick.skip_message.startswith("0 outbox rows due (1 more wait out a downstream's pause")
    assert group in tick.skip_message and "Retry-After: 600" in tick.skip_message

    result = here.dispatch(dagster_pg)
    assert result.success  # nothing deliverable and nothing dead: green, and the metadata says why
    meta = _meta(result, f"{here.job.name}_dispatch")
    assert meta["claimed"] == 0 and meta["paused_due"] == 1
    assert meta["result"] == "1 due row(s) wait out a downstream's pause; delivered nothing"
    assert meta["paused_groups"][0]["limit_group"] == group
    backlog = _checks(result)[BACKLOG_CHECK]
    assert not backlog.passed and "delivery paused by the downstream" in (backlog.description or "")
    assert _rows(engine, topic) == [("PENDING", 0)]


def test_the_dispatch_op_can_run_in_a_concurrency_pool() -> None:
    job = build_dispatcher_job({"t": Route("http://127.0.0.1:9/t")}, name="pooled_job", pool="joblease")
    (node,) = job.graph.node_defs
    assert node.pool == "joblease"
    plain = build_dispatcher_job({"t": Route("http://127.0.0.1:9/t")}, name="plain_job")
    assert plain.graph.node_defs[0].pool is None
