"""Range runs (single-run backfills) of leased assets, and the four cases the range issue saw.

Real Dagster runs on a PostgreSQL-backed instance (and real processes for termination and races): every key
of a range ends with a recorded outcome, the run is green only when every key is done, a failing key does
not stop the others, a terminated run keeps the materializations of the keys it finished, held keys are
waited for together, and the output is produced when every key is done so downstream leased assets run
for the whole range (without Declarative Automation asking for any key again).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource, leased_asset
from dagster_joblease.dagster.metadata import (
    META_FIRST_KEYS,
    META_OUTCOME,
    META_OUTCOMES,
    META_RUN_KEY,
    META_WINNER,
    STEP_TAGS,
    TAG_OUTCOME,
    TAG_WINNER,
    TAG_WORK,
)
from dagster_joblease.dagster.ops import step_records
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.conftest import wait_until
from tests.dagster import range_assets, range_worker
from tests.dagster.conftest import DagsterPg

REPO = Path(__file__).resolve().parents[2]
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def _days(month: int, first: int, last: int) -> list[str]:
    return [f"2024-{month:02d}-{d:02d}" for d in range(first, last + 1)]


def _range_tags(keys: Sequence[str]) -> dict[str, str]:
    return {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}


def _materialize(
    dagster_pg: DagsterPg, assets: list[dg.AssetsDefinition], keys: Sequence[str], **resource: Any
) -> dg.ExecuteInProcessResult:
    extra = {"partition_key": keys[0]} if len(keys) == 1 else {"tags": _range_tags(keys)}
    return dg.materialize(
        assets,
        instance=dagster_pg.instance,
        resources={"joblease": JobLeaseResource(**resource)},
        run_config=QUIET,
        raise_on_error=False,
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
def engine(dagster_pg: DagsterPg) -> Iterator[sa.Engine]:
    engine = create_engine(dagster_pg.joblease_url)
    yield engine
    engine.dispose()


@pytest.fixture
def steer() -> Iterator[dict[str, str]]:
    """Environment variables for the bodies (see range_assets), removed after the test."""
    env: dict[str, str] = {}
    yield env
    for key in env:
        os.environ.pop(key, None)


def _set(steer: dict[str, str], key: str, value: str) -> None:
    steer[key] = value
    os.environ[key] = value


def _leases(engine: sa.Engine, code: str, keys: Sequence[str]) -> dict[str, str]:
    ids = {JobIdentity.schedule(code, k).idempotency_key: k for k in keys}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(lease_table.c.lock_key, lease_table.c.status).where(lease_table.c.lock_key.in_(ids))
        ).all()
    return {ids[key]: status for key, status in rows}


def _outbox(engine: sa.Engine, code: str, keys: Sequence[str]) -> dict[str, int]:
    """Outbox rows per key (the effect): exactly one per done key, whatever raced."""
    ids = {JobIdentity.schedule(code, k).idempotency_key: k for k in keys}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(outbox_table.c.idempotency_key, sa.func.count())
            .where(outbox_table.c.idempotency_key.in_(ids))
            .group_by(outbox_table.c.idempotency_key)
        ).all()
    return {ids[key]: int(n) for key, n in rows}


def _materialized(instance: dg.DagsterInstance, asset: dg.AssetsDefinition, keys: Sequence[str]) -> list[int]:
    """How many materializations each key has on the instance."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset.key, asset_partitions=list(keys)), limit=10 * len(keys)
    ).records
    partitions = [r.partition_key for r in records]
    return [partitions.count(k) for k in keys]


def _tags(dagster_pg: DagsterPg, run_id: str) -> dict[str, str]:
    run = dagster_pg.instance.get_run_by_id(run_id)
    assert run is not None
    return {k: v for k, v in run.tags.items() if k.startswith("joblease/")}


def _failure_text(result: dg.ExecuteInProcessResult) -> str:
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error
    return error.message if error else ""


def _done(engine: sa.Engine, code: str, keys: Sequence[str]) -> None:
    """Record ``keys`` of ``code`` as done by a worker outside Dagster."""
    service = LeaseService(engine, holder="worker:elsewhere")
    for key in keys:
        held = service.acquire(JobIdentity.schedule(code, key))
        assert held is not None
        service.complete(held)


# ---- Seen case 1: a green run whose downstream leased asset never ran ------------------------------------


def test_a_range_with_a_key_done_before_still_runs_the_downstream_for_every_key(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    keys = _days(1, 1, 3)
    up, down = range_assets.up, range_assets.down
    defs = dg.Definitions(assets=[up, down], resources={"joblease": JobLeaseResource()})
    automation = dg.evaluate_automation_conditions(defs=defs, instance=dagster_pg.instance)
    assert _materialize(dagster_pg, [up], ["2024-01-02"]).success  # up done for the middle key
    automation = dg.evaluate_automation_conditions(
        defs=defs, instance=dagster_pg.instance, cursor=automation.cursor
    )
    # Eager does ask for the downstream of an update made without it (the control for the end).
    assert automation.get_requested_partitions(down.key) == {"2024-01-02"}

    result = _materialize(dagster_pg, [up, down], keys)

    assert result.success
    assert _leases(engine, "t-up", keys) == dict.fromkeys(keys, "SUCCESS")
    assert _leases(engine, "t-down", keys) == dict.fromkeys(keys, "SUCCESS")  # down ran for every key
    assert _outbox(engine, "t-up", keys) == dict.fromkeys(keys, 1)
    assert _outbox(engine, "t-down", keys) == dict.fromkeys(keys, 1)
    assert _materialized(dagster_pg.instance, down, keys) == [1, 1, 1]
    records = step_records(dagster_pg.instance, result.run_id)
    assert records["up"][META_OUTCOMES] == {"won": 2, "skipped-succeeded": 1}
    assert records["down"][META_OUTCOMES] == {"won": 3}
    assert _tags(dagster_pg, result.run_id) == {
        TAG_OUTCOME: "won",
        TAG_WINNER: "multiple",
        TAG_WORK: "won:5,skipped-succeeded:1",
    }
    # The range re-recorded 'up' for the key done before; automation does not ask for any key again.
    again = dg.evaluate_automation_conditions(
        defs=defs, instance=dagster_pg.instance, cursor=automation.cursor
    )
    assert again.total_requested == 0, [r.key for r in again.results if r.true_subset.size]


def test_a_single_partition_whose_upstream_was_a_skip_still_redoes_a_failed_downstream(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    day = "2024-01-10"
    up, down = range_assets.up, range_assets.down
    assert _materialize(dagster_pg, [up], [day]).success
    service = LeaseService(engine)
    failed = service.acquire(JobIdentity.schedule("t-down", day))
    assert failed is not None
    service.fail(failed, "an earlier run of down failed")

    result = _materialize(dagster_pg, [up, down], [day])

    assert result.success
    records = step_records(dagster_pg.instance, result.run_id)
    assert (records["up"][META_OUTCOME], records["down"][META_OUTCOME]) == ("skipped-succeeded", "reclaimed")
    assert _leases(engine, "t-down", [day]) == {day: "SUCCESS"}
    assert _outbox(engine, "t-down", [day]) == {day: 1}


# ---- Seen case 2: keys after a failing key were never attempted -------------------------------------------


def test_a_failing_key_does_not_stop_the_others_and_the_step_names_it(
    dagster_pg: DagsterPg, engine: sa.Engine, steer: dict[str, str]
) -> None:
    keys = _days(2, 1, 5)
    _set(steer, range_assets.FAIL_ENV, "2024-02-02")

    result = _materialize(dagster_pg, [range_assets.range_asset], keys)

    assert not result.success
    assert _leases(engine, "t-range", keys) == {k: "FAIL" if k == "2024-02-02" else "SUCCESS" for k in keys}
    assert _outbox(engine, "t-range", keys) == {k: 1 for k in keys if k != "2024-02-02"}
    assert _materialized(dagster_pg.instance, range_assets.range_asset, keys) == [1, 0, 1, 1, 1]
    assert "1 of 5 keys not done: failed: 2024-02-02 (RuntimeError" in _failure_text(result)
    assert _tags(dagster_pg, result.run_id) == {
        TAG_OUTCOME: "failed",
        TAG_WINNER: result.run_id,
        TAG_WORK: "failed:1,won:4",
    }


def test_repeated_failures_stop_the_range_and_the_rest_are_not_attempted(
    dagster_pg: DagsterPg, engine: sa.Engine, steer: dict[str, str]
) -> None:
    keys = _days(2, 10, 16)
    _set(steer, range_assets.FAIL_ENV, ",".join(keys[1:]))  # every key but the first fails

    result = _materialize(dagster_pg, [range_assets.range_asset], keys)

    assert not result.success
    # The first key won; three failures in a row (the default bound) stop the range.
    assert _leases(engine, "t-range", keys) == {keys[0]: "SUCCESS", **dict.fromkeys(keys[1:4], "FAIL")}
    text = _failure_text(result)
    assert "6 of 7 keys not done" in text
    assert "not-attempted: 2024-02-14, 2024-02-15, 2024-02-16" in text and "failed: 2024-02-11" in text
    assert _tags(dagster_pg, result.run_id)[TAG_WORK] == "failed:3,not-attempted:3,won:1"
    (record,) = step_records(dagster_pg.instance, result.run_id).values()
    assert "| 2024-02-14 | not-attempted |" in str(record["joblease/results"])
    assert _materialized(dagster_pg.instance, range_assets.range_asset, keys) == [1, 0, 0, 0, 0, 0, 0]


# ---- Seen case 3: a terminated range run dropped the materializations of the keys it finished ---


@pytest.mark.chaos
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_terminated_range_run_keeps_what_it_finished(
    dagster_pg: DagsterPg, engine: sa.Engine, tmp_path: Path, signum: signal.Signals
) -> None:
    keys = _days(3, 1, 4) if signum == signal.SIGTERM else _days(3, 11, 14)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.dagster.range_worker", "range_asset", keys[0], keys[-1]],
        cwd=REPO,
        env=dagster_pg.env(
            **{range_assets.BLOCK_ENV: keys[2], range_assets.READY_ENV: str(ready)},
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=120, interval=0.05)
        assert ready.exists(), proc.communicate()[1]
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run_id = json.loads(out.splitlines()[-1])["run_id"]
    # The keys it finished are materialized (yielded before the interrupt was re-raised) ...
    assert _materialized(dagster_pg.instance, range_assets.range_asset, keys) == [1, 1, 0, 0]
    # ... the key it was in was released for a retry, and the one after was never claimed.
    assert _leases(engine, "t-range", keys) == {keys[0]: "SUCCESS", keys[1]: "SUCCESS", keys[2]: "FAIL"}
    assert _outbox(engine, "t-range", keys) == {keys[0]: 1, keys[1]: 1}
    run = dagster_pg.instance.get_run_by_id(run_id)
    assert run is not None and run.status != dg.DagsterRunStatus.SUCCESS, err
    assert _tags(dagster_pg, run_id)[TAG_WORK] == "failed:1,not-attempted:1,won:2"


# ---- Seen case 4: held keys of a range -------------------------------------------------------------------


def test_held_keys_are_waited_for_after_the_others_and_recorded_when_their_holder_finishes(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    keys = _days(4, 1, 3)
    holder = LeaseService(engine, holder="worker:9", lease_ms=600_000, heartbeat_ms=0)
    held = holder.acquire(JobIdentity.schedule("t-range", keys[1]))
    assert held is not None

    def finish_when_the_others_are_done() -> None:
        # The holder finishes only once the range has done both other keys: a run that waited for the
        # held key before trying the next one would wait here until its held wait ran out.
        wait_until(
            lambda: (
                _leases(engine, "t-range", [keys[0], keys[2]]) == dict.fromkeys([keys[0], keys[2]], "SUCCESS")
            ),
            timeout=120,
        )
        holder.complete(held)

    finisher = threading.Thread(target=finish_when_the_others_are_done)
    finisher.start()
    try:
        result = _materialize(dagster_pg, [range_assets.range_asset], keys, held_wait_ms=180_000)
    finally:
        finisher.join()
    assert result.success
    assert _materialized(dagster_pg.instance, range_assets.range_asset, keys) == [1, 1, 1]
    assert _tags(dagster_pg, result.run_id) == {
        TAG_OUTCOME: "won",
        TAG_WINNER: "multiple",
        TAG_WORK: "won:2,skipped-succeeded:1",
    }


def test_a_key_still_held_when_the_wait_ends_is_named_and_its_neighbours_are_recorded(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    keys = _days(4, 10, 12)
    held = LeaseService(engine, holder="worker:10", lease_ms=600_000, heartbeat_ms=0).acquire(
        JobIdentity.schedule("t-range", keys[1])
    )
    assert held is not None

    result = _materialize(dagster_pg, [range_assets.range_asset], keys, held_wait_ms=300)

    assert not result.success
    assert _materialized(dagster_pg.instance, range_assets.range_asset, keys) == [1, 0, 1]
    assert "held: 2024-04-11 (partition 2024-04-11 of code 't-range' is still held by worker:10" in (
        _failure_text(result)
    )
    assert _tags(dagster_pg, result.run_id)[TAG_WORK] == "held:1,won:2"
    assert _leases(engine, "t-range", keys) == {keys[0]: "SUCCESS", keys[1]: "RUNNING", keys[2]: "SUCCESS"}


# ---- Two range runs over overlapping ranges, in two processes ---------------------------------------------


@pytest.mark.chaos
def test_two_overlapping_range_runs_race_with_one_effect_per_key(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    first, second = _days(5, 1, 20), _days(5, 10, 31)
    results = range_worker.race("range_asset", (first, second), dagster_pg.env())
    every = sorted(set(first) | set(second))
    assert _leases(engine, "t-range", every) == dict.fromkeys(every, "SUCCESS")
    assert _outbox(engine, "t-range", every) == dict.fromkeys(every, 1)  # one effect per key
    # Each key was done by exactly one of the two runs; the other recorded it as a skip.
    did = []
    for r in results:
        (record,) = step_records(dagster_pg.instance, r["run_id"]).values()
        outcomes = record[META_OUTCOMES]
        assert isinstance(outcomes, dict)
        did.append(outcomes.get("won", 0) + outcomes.get("reclaimed", 0))
        assert sum(outcomes.values()) == (len(first) if r is results[0] else len(second))
    assert sum(did) == len(every), did


# ---- The tag diet ----------------------------------------------------------------------------------------


def test_a_leased_step_writes_at_most_four_joblease_tags_with_the_winner_one_click_away(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    day = "2024-06-01"
    won = _materialize(dagster_pg, [range_assets.range_asset], [day])
    skip = _materialize(dagster_pg, [range_assets.range_asset], [day])
    ranged = _materialize(dagster_pg, [range_assets.range_asset], _days(6, 1, 4))
    assert won.success and skip.success and ranged.success
    for result in (won, skip, ranged):
        tags = _tags(dagster_pg, result.run_id)
        assert sorted(tags) == sorted(STEP_TAGS) and len(tags) <= 4, tags
    # In the UI's order (key order after Dagster's own), the outcome comes first and the winner second.
    assert list(_tags(dagster_pg, skip.run_id)) == [TAG_OUTCOME, TAG_WINNER, TAG_WORK]
    assert _tags(dagster_pg, skip.run_id)[TAG_WINNER] == won.run_id
    (record,) = step_records(dagster_pg.instance, skip.run_id).values()
    assert record[META_WINNER] == won.run_id
    (materialization,) = won.asset_materializations_for_node("range_asset")
    assert materialization.metadata[META_WINNER] == dg.MetadataValue.dagster_run(won.run_id)


def test_a_large_range_summarises_its_keys_in_the_metadata(dagster_pg: DagsterPg) -> None:
    partitions = dg.DailyPartitionsDefinition(start_date="2020-01-01", end_date="2021-03-01")  # 425 days
    big = leased_asset(
        code="t-big", name="big", partitions_def=partitions, backfill_policy=range_assets.SINGLE_RUN
    )(lambda run: None)
    all_keys = partitions.get_partition_keys()
    result = dg.materialize(
        [big],
        instance=dagster_pg.instance,
        resources={"joblease": JobLeaseResource()},
        run_config=QUIET,
        tags=_range_tags(all_keys),
    )
    assert result.success
    (record,) = step_records(dagster_pg.instance, result.run_id).values()
    assert record[META_OUTCOMES] == {"won": len(all_keys)}
    first = record[META_FIRST_KEYS]
    assert isinstance(first, dict) and first["won"][:2] == ["2020-01-01", "2020-01-02"]
    assert len(first["won"]) == 20 and "joblease/results" not in record
    assert _tags(dagster_pg, result.run_id)[TAG_WORK] == f"won:{len(all_keys)}"
    # The range's metadata is in that record once; each key's materialization carries only the summary
    # (issue 29, finding 12: a 10,000-key range repeated ~1.7 kB of it 10,000 times).
    materializations = dagster_pg.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=big.key), limit=len(all_keys) + 1
    ).records
    assert len(materializations) == len(all_keys)
    for record_ in materializations:
        materialization = record_.asset_materialization
        assert materialization is not None
        assert set(materialization.metadata) == {META_OUTCOME, META_RUN_KEY, META_OUTCOMES}
        assert materialization.metadata[META_RUN_KEY] == dg.MetadataValue.text("2020-01-01..2021-02-28")


# ---- A per-key body sees its own key (issue 29, finding 3) ------------------------------------------------


def _payloads(engine: sa.Engine, code: str, keys: Sequence[str]) -> dict[str, Any]:
    ids = {JobIdentity.schedule(code, k).idempotency_key: k for k in keys}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(outbox_table.c.idempotency_key, outbox_table.c.payload).where(
                outbox_table.c.idempotency_key.in_(ids)
            )
        ).all()
    return {ids[key]: payload for key, payload in rows}


def test_a_per_key_body_of_a_range_sees_its_own_key_and_time_window(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """A body written for one partition reads the context as it would there: each key's effect covers
    that key's day (the range's window would cover four days; ``partition_key`` would raise)."""

    def one_day(run: Any) -> None:
        context = run.context
        window = context.partition_time_window
        context.log.info(f"doing {context.partition_key}")  # everything else is the step's own context
        payload = {
            "key": context.partition_key,
            "keys": list(context.partition_keys),
            "range": [context.partition_key_range.start, context.partition_key_range.end],
            "is_range": context.has_partition_key_range,
            "output_key": context.asset_partition_key_for_output(),
            "window": [window.start.isoformat(), window.end.isoformat()],
            "run_id": context.run_id,
        }
        with run.transaction() as conn:
            run.enqueue_once(conn, topic=range_assets.TOPIC, payload=payload)

    asset = leased_asset(
        code="t-one-day",
        name="one_day",
        partitions_def=range_assets.days,
        backfill_policy=range_assets.SINGLE_RUN,
    )(one_day)
    keys = _days(5, 1, 4)
    result = _materialize(dagster_pg, [asset], keys)
    assert result.success, _failure_text(result)
    assert _tags(dagster_pg, result.run_id)[TAG_WORK] == "won:4"
    payloads = _payloads(engine, "t-one-day", keys)
    assert sorted(payloads) == keys
    for key, payload in payloads.items():
        day = range_assets.days.time_window_for_partition_key(key)
        assert payload == {
            "key": key,
            "keys": [key],
            "range": [key, key],
            "is_range": False,
            "output_key": key,
            "window": [day.start.isoformat(), day.end.isoformat()],
            "run_id": result.run_id,
        }


# ---- Terminated while waiting for a held key (issue 29, finding 8) --------------------------------------


@pytest.mark.chaos
def test_a_range_run_terminated_while_waiting_for_a_held_key_records_it_not_attempted(
    dagster_pg: DagsterPg, engine: sa.Engine
) -> None:
    """The key is a live worker's (its lease RUNNING, not this run's): this run never held it, so it is
    ``not-attempted``, not ``failed`` ("the lease was released"); the keys done are materialized."""
    keys = _days(8, 1, 3)
    other = LeaseService(engine, holder="worker:8", lease_ms=600_000, heartbeat_ms=0)
    assert other.acquire(JobIdentity.schedule("t-range", keys[1])) is not None
    waiting = "held by worker:8 (attempt 1); waiting up to"
    run_id, err = range_worker.terminated_while(
        dagster_pg.instance,
        "range_asset",
        keys,
        waiting,
        dagster_pg.env(),  # held_wait_ms default: 5 minutes
    )
    assert _tags(dagster_pg, run_id)[TAG_WORK] == "not-attempted:1,won:2", err[-2000:]
    assert _materialized(dagster_pg.instance, range_assets.range_asset, keys) == [1, 0, 1]
    assert _leases(engine, "t-range", keys) == {keys[0]: "SUCCESS", keys[1]: "RUNNING", keys[2]: "SUCCESS"}
