"""Batch mode (``batch=True``): the body is called with the keys this run won, at once.

Real Dagster runs on PostgreSQL: keys already succeeded are skipped, the keys won are one call (one claim
statement, one fenced transaction, one multi-row outbox insert), keys held by a live holder are waited for
and the keys won later go to a further call; a failing call fails its set; two overlapping batch range runs
in two processes give one effect per key.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource
from dagster_joblease.dagster.metadata import META_OUTCOMES, TAG_OUTCOME, TAG_WINNER, TAG_WORK
from dagster_joblease.dagster.ops import step_records
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.conftest import _admin_execute, clone_template, wait_until
from tests.dagster import range_assets, range_worker
from tests.dagster.conftest import DagsterPg

REPO = Path(__file__).resolve().parents[2]
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
ASSET = range_assets.batch_asset


def _days(month: int, first: int, last: int) -> list[str]:
    return [f"2024-{month:02d}-{d:02d}" for d in range(first, last + 1)]


def _materialize(dagster_pg: DagsterPg, keys: Sequence[str], **resource: int) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [ASSET],
        instance=dagster_pg.instance,
        resources={"joblease": JobLeaseResource(**resource)},
        run_config=QUIET,
        raise_on_error=False,
        tags={"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]},
    )


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    engine = create_engine(dagster_pg.joblease_url)
    yield engine
    engine.dispose()


@pytest.fixture
def calls(tmp_path: Path) -> Iterator[Path]:
    """A file each body call appends its keys to."""
    log = tmp_path / "calls"
    os.environ[range_assets.LOG_ENV] = str(log)
    yield log
    os.environ.pop(range_assets.LOG_ENV, None)
    os.environ.pop(range_assets.FAIL_ENV, None)


def _calls(log: Path) -> list[list[str]]:
    return [line.split(",") for line in log.read_text().splitlines()] if log.exists() else []


def _leases(engine: sa.Engine, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
    ids = {JobIdentity.schedule("t-batch", k).idempotency_key: k for k in keys}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(lease_table.c.lock_key, lease_table.c.status, lease_table.c.attempt).where(
                lease_table.c.lock_key.in_(ids)
            )
        ).all()
    return {ids[key]: (status, attempt) for key, status, attempt in rows}


def _outbox(engine: sa.Engine, keys: Sequence[str]) -> dict[str, int]:
    ids = {JobIdentity.schedule("t-batch", k).idempotency_key: k for k in keys}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(outbox_table.c.idempotency_key, sa.func.count())
            .where(outbox_table.c.idempotency_key.in_(ids))
            .group_by(outbox_table.c.idempotency_key)
        ).all()
    return {ids[key]: int(n) for key, n in rows}


def _tags(dagster_pg: DagsterPg, run_id: str) -> dict[str, str]:
    run = dagster_pg.instance.get_run_by_id(run_id)
    assert run is not None
    return {k: v for k, v in run.tags.items() if k.startswith("joblease/")}


def test_one_call_for_the_keys_won_succeeded_skipped_held_given_in_a_further_call(
    dagster_pg: DagsterPg, engine: sa.Engine, calls: Path
) -> None:
    keys = _days(9, 1, 5)
    done_elsewhere, held_key = keys[2], keys[3]
    other = LeaseService(engine, holder="worker:5", lease_ms=600_000, heartbeat_ms=0)
    finished = other.acquire(JobIdentity.schedule("t-batch", done_elsewhere))
    assert finished is not None
    other.complete(finished)
    held = other.acquire(JobIdentity.schedule("t-batch", held_key))
    assert held is not None

    def give_up_after_the_first_call() -> None:
        wait_until(lambda: len(_calls(calls)) == 1, timeout=120)
        other.fail(held, "the other holder gave up")  # frees the key during the run's wait

    releaser = threading.Thread(target=give_up_after_the_first_call)
    releaser.start()
    try:
        result = _materialize(dagster_pg, keys, held_wait_ms=180_000)
    finally:
        releaser.join()

    assert result.success
    assert _calls(calls) == [[keys[0], keys[1], keys[4]], [held_key]]
    assert _leases(engine, keys) == {
        **{k: ("SUCCESS", 1) for k in keys if k != held_key},
        held_key: ("SUCCESS", 2),
    }
    assert _outbox(engine, keys) == {k: 1 for k in keys if k != done_elsewhere}
    assert _tags(dagster_pg, result.run_id) == {
        TAG_OUTCOME: "reclaimed",
        TAG_WINNER: "multiple",
        TAG_WORK: "reclaimed:1,won:3,skipped-succeeded:1",
    }
    materialized = dagster_pg.instance.get_materialized_partitions(ASSET.key)
    assert set(keys) <= materialized  # every key done: the output covers the range


def test_a_failing_call_fails_its_whole_set_and_the_step_names_the_keys(
    dagster_pg: DagsterPg, engine: sa.Engine, calls: Path
) -> None:
    keys = _days(9, 10, 12)
    os.environ[range_assets.FAIL_ENV] = keys[1]
    result = _materialize(dagster_pg, keys)
    assert not result.success
    assert _leases(engine, keys) == dict.fromkeys(keys, ("FAIL", 1))
    assert _outbox(engine, keys) == {}
    (record,) = step_records(dagster_pg.instance, result.run_id).values()
    assert record[META_OUTCOMES] == {"failed": 3}
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    message = failure.step_failure_data.error.message if failure.step_failure_data.error else ""
    assert "3 of 3 keys not done: failed: 2024-09-10 (RuntimeError" in message
    assert dagster_pg.instance.get_materialized_partitions(ASSET.key).isdisjoint(keys)

    # A retry reclaims the set in one call.
    os.environ.pop(range_assets.FAIL_ENV)
    again = _materialize(dagster_pg, keys)
    assert again.success
    assert _leases(engine, keys) == dict.fromkeys(keys, ("SUCCESS", 2))
    assert _tags(dagster_pg, again.run_id)[TAG_WORK] == "reclaimed:3"


@pytest.mark.chaos
def test_two_overlapping_batch_range_runs_race_with_one_effect_per_key(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    first, second = _days(10, 1, 20), _days(10, 10, 31)
    results = range_worker.race("batch_asset", (first, second), dagster_pg.env())
    every = sorted(set(first) | set(second))
    assert {k: s for k, (s, _a) in _leases(engine, every).items()} == dict.fromkeys(every, "SUCCESS")
    assert _outbox(engine, every) == dict.fromkeys(every, 1)  # one effect per key
    did = 0
    for r in results:
        (record,) = step_records(dagster_pg.instance, r["run_id"]).values()
        outcomes = record[META_OUTCOMES]
        assert isinstance(outcomes, dict)
        did += outcomes.get("won", 0) + outcomes.get("reclaimed", 0)
    assert did == len(every)


@pytest.fixture
def steer() -> Iterator[dict[str, str]]:
    """Environment variables for the bodies (see range_assets), removed after the test."""
    env: dict[str, str] = {}
    yield env
    for key in env:
        os.environ.pop(key, None)


def _set(steer: dict[str, str], **values: str) -> None:
    for key, value in values.items():
        steer[key] = value
        os.environ[key] = value


def _hold(engine: sa.Engine, key: str, holder: str) -> tuple[LeaseService, Any]:
    """A live holder outside Dagster (no heartbeat, a 10-minute lease): only it can free the key."""
    other = LeaseService(engine, holder=holder, lease_ms=600_000, heartbeat_ms=0)
    held = other.acquire(JobIdentity.schedule("t-batch", key))
    assert held is not None
    return other, held


def test_a_held_key_freed_while_a_long_call_runs_is_looked_at_once_more(
    dagster_pg: DagsterPg, engine: sa.Engine, tmp_path: Path, steer: dict[str, str]
) -> None:
    """Finding 5: the first call outlasts ``held_wait_ms``; the held key succeeded meanwhile. The range
    looks at it once more after the call (as per-key mode does): a recorded skip, the run green."""
    keys = _days(11, 1, 3)
    other, held = _hold(engine, keys[2], "worker:11")
    ready, release = tmp_path / "ready", tmp_path / "release"
    _set(
        steer,
        **{
            range_assets.BLOCK_ENV: keys[0],
            range_assets.READY_ENV: str(ready),
            range_assets.RELEASE_ENV: str(release),
        },
    )

    def finish_then_release() -> None:
        wait_until(ready.exists, timeout=120)
        other.complete(held)
        time.sleep(1.0)  # the call runs past the run's 0.5 s wait (a lower bound: it cannot end sooner)
        release.write_text("")

    finisher = threading.Thread(target=finish_then_release)
    finisher.start()
    try:
        result = _materialize(dagster_pg, keys, held_wait_ms=500)
    finally:
        finisher.join()
    assert result.success
    assert _tags(dagster_pg, result.run_id)[TAG_WORK] == "won:2,skipped-succeeded:1"
    assert {k: s for k, (s, _a) in _leases(engine, keys).items()} == dict.fromkeys(keys, "SUCCESS")


def test_one_key_taken_over_mid_call_is_lost_and_the_rest_of_its_set_failed(
    dagster_pg: DagsterPg, engine: sa.Engine, tmp_path: Path, steer: dict[str, str]
) -> None:
    """Finding 7: one key of a set of five is taken over while the call runs; the set's fenced transaction
    is refused and this run fails the other four itself. One ``lost``, four ``failed`` (not ``lost:5``)."""
    keys = _days(11, 10, 14)
    taken = JobIdentity.schedule("t-batch", keys[2])
    ready, release = tmp_path / "ready", tmp_path / "release"
    _set(
        steer,
        **{
            range_assets.BLOCK_ENV: keys[0],
            range_assets.READY_ENV: str(ready),
            range_assets.RELEASE_ENV: str(release),
        },
    )

    def take_over_one_key() -> None:
        wait_until(ready.exists, timeout=120)
        with engine.begin() as conn:  # its lease runs out (on the database clock) ...
            conn.execute(
                sa.update(lease_table)
                .where(lease_table.c.lock_key == taken.idempotency_key)
                .values(expires_at=sa.func.clock_timestamp() - sa.text("interval '1 minute'"))
            )
        assert LeaseService(engine, holder="worker:13").acquire(taken) is not None  # ... another takes it
        release.write_text("")

    taker = threading.Thread(target=take_over_one_key)
    taker.start()
    try:
        result = _materialize(dagster_pg, keys)
    finally:
        taker.join()
    assert not result.success
    (record,) = step_records(dagster_pg.instance, result.run_id).values()
    assert record[META_OUTCOMES] == {"failed": 4, "lost": 1}
    assert _leases(engine, keys) == {
        **{k: ("FAIL", 1) for k in keys if k != keys[2]},
        keys[2]: ("RUNNING", 2),
    }
    assert _outbox(engine, keys) == {}


@pytest.mark.chaos
def test_a_run_terminated_while_waiting_for_a_held_key_records_what_it_did(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """Finding 6: a batch range run is terminated while it waits for a key a live worker holds. The keys
    it did are materialized and recorded ``won``, the held one ``not-attempted`` (not ``pending:3``)."""
    keys = _days(11, 20, 22)
    _hold(engine, keys[1], "worker:12")
    waiting = "keys are held by another holder; waiting up to"
    run_id, err = range_worker.terminated_while(
        dagster_pg.instance,
        "batch_asset",
        keys,
        waiting,
        dagster_pg.env(),  # held_wait_ms default: 5 minutes
    )
    run = dagster_pg.instance.get_run_by_id(run_id)
    assert run is not None and run.status != dg.DagsterRunStatus.SUCCESS, err[-2000:]
    assert _tags(dagster_pg, run_id)[TAG_WORK] == "not-attempted:1,won:2"
    materialized = dagster_pg.instance.get_materialized_partitions(ASSET.key)
    assert {keys[0], keys[2]} <= materialized and keys[1] not in materialized
    assert {k: s for k, (s, _a) in _leases(engine, keys).items()} == {
        keys[0]: "SUCCESS",
        keys[1]: "RUNNING",  # still the other worker's
        keys[2]: "SUCCESS",
    }


@pytest.fixture
def lease_db(pg_template: str) -> Iterator[tuple[str, str]]:
    """A joblease database of its own (Dagster's storage stays reachable): its name and URL."""
    name = f"joblease_out_{uuid.uuid4().hex[:10]}"
    url = clone_template(pg_template, name)
    yield name, url
    _admin_execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize(
    ("asset", "code", "waiting"),
    [
        (ASSET, "t-batch", "keys are held by another holder; waiting up to"),
        (range_assets.range_asset, "t-range", "held by worker:14 (attempt 1); waiting up to"),
    ],
    ids=["batch", "per-key"],
)
def test_a_lease_database_outage_while_waiting_keeps_what_was_done(
    dagster_pg: DagsterPg, lease_db: tuple[str, str], asset: dg.AssetsDefinition, code: str, waiting: str
) -> None:
    """Finding 6 (the outage) and finding 8's sibling: the lease database goes away while a range run (batch
    or per-key mode) waits for a key a live worker holds. The keys done are materialized and recorded
    ``won``; the held one, which this run never held (its lease stays the worker's), ``not-attempted`` with
    the error: not ``failed`` (a lease this run released), not ``pending:3`` with nothing materialized. The
    step fails retryably."""
    name, url = lease_db
    keys = _days(11, 25, 27) if code == "t-batch" else _days(12, 25, 27)
    engine = create_engine(url)
    try:
        other = LeaseService(engine, holder="worker:14", lease_ms=600_000, heartbeat_ms=0)
        assert other.acquire(JobIdentity.schedule(code, keys[1])) is not None
    finally:
        engine.dispose()

    def cut_the_lease_database() -> None:
        wait_until(lambda: range_worker.logged_run(dagster_pg.instance, keys, waiting) is not None, 120)
        _admin_execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        _admin_execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")

    cutter = threading.Thread(target=cut_the_lease_database)
    cutter.start()
    try:
        result = dg.materialize(
            [asset],
            instance=dagster_pg.instance,
            resources={"joblease": JobLeaseResource(database_url=url, held_wait_ms=120_000)},
            run_config=QUIET,
            raise_on_error=False,
            tags={
                "dagster/asset_partition_range_start": keys[0],
                "dagster/asset_partition_range_end": keys[-1],
            },
        )
    finally:
        cutter.join()
    assert not result.success
    assert _tags(dagster_pg, result.run_id)[TAG_WORK] == "not-attempted:1,won:2"
    record = step_records(dagster_pg.instance, result.run_id)[asset.key.path[-1]]
    assert record[META_OUTCOMES] == {"won": 2, "not-attempted": 1}
    materialized = dagster_pg.instance.get_materialized_partitions(asset.key)
    assert {keys[0], keys[2]} <= materialized and keys[1] not in materialized
