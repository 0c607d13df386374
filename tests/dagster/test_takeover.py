"""A held partition is never a green skip; a dead holder is taken over in seconds, not at lease expiry.

Real Dagster runs on a PostgreSQL-backed instance. The holder is either a lease recorded as another
deployment's run (only its own finish or its lease expiry can free it), or a real run whose op runs in its
own step process (multiprocess executor), which the test marks canceled and then SIGKILLs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster.holders import encode_holder, holder_run_finished
from dagster_joblease.dagster.metadata import (
    META_ATTEMPT,
    META_ERROR,
    META_HOLDER,
    META_OUTBOX,
    META_WINNER,
    TAG_OUTCOME,
    TAG_WINNER,
    TAG_WORK,
)
from dagster_joblease.dagster.ops import step_records
from dagster_joblease.storage.schema import lease_table
from tests.conftest import wait_until
from tests.dagster import jobs
from tests.dagster.conftest import DagsterPg

REPO = Path(__file__).resolve().parents[2]
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def _row(url: str, job: JobIdentity) -> Any:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(
                sa.select(lease_table).where(lease_table.c.lock_key == job.idempotency_key)
            ).one()
    finally:
        engine.dispose()


def _tags(instance: dg.DagsterInstance, run_id: str) -> dict[str, str]:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return dict(run.tags)


def _waiting_run_logged(instance: dg.DagsterInstance) -> bool:
    """A waiting_job run has said it is waiting for the holder (it saw the partition held)."""
    for run in instance.get_runs(
        dg.RunsFilter(job_name="waiting_job", statuses=[dg.DagsterRunStatus.STARTED])
    ):
        if any("waiting up to" in (entry.user_message or "") for entry in instance.all_logs(run.run_id)):
            return True
    return False


@pytest.mark.parametrize("holder_ends", ["succeeds", "fails", "expires"])
def test_a_run_waits_for_a_live_holder_and_mirrors_how_it_ended(
    dagster_pg: DagsterPg, holder_ends: str
) -> None:
    day = {"succeeds": "2024-06-01", "fails": "2024-06-02", "expires": "2024-06-04"}[holder_ends]
    job = JobIdentity.schedule("t-wait", day)
    other_run = str(uuid.uuid4())  # a run of another deployment: this instance cannot see it
    holder = encode_holder("other-deployment", other_run)
    engine = create_engine(dagster_pg.joblease_url)
    # A holder that stops heartbeating on another deployment: only its expiry frees the partition.
    lease_ms = 1_500 if holder_ends == "expires" else 600_000
    service = LeaseService(engine, lease_ms=lease_ms, heartbeat_ms=0, holder=holder)
    held = service.acquire(job)
    assert held is not None
    assert holder_run_finished(dagster_pg.instance, holder) is None

    def finish_holder() -> None:
        if holder_ends == "expires":
            return
        wait_until(lambda: _waiting_run_logged(dagster_pg.instance), timeout=60, interval=0.1)
        if holder_ends == "succeeds":
            service.complete(held)
        elif holder_ends == "fails":
            service.fail(held, "RuntimeError: the holder's body failed")

    finisher = threading.Thread(target=finish_holder)
    finisher.start()
    try:
        result = jobs.waiting_job().execute_in_process(
            partition_key=day, instance=dagster_pg.instance, run_config=QUIET
        )
    finally:
        finisher.join()
        engine.dispose()
    assert result.success
    tags = _tags(dagster_pg.instance, result.run_id)
    (facts,) = step_records(dagster_pg.instance, result.run_id).values()
    row = _row(dagster_pg.joblease_url, job)
    if holder_ends == "succeeds":
        assert (tags[TAG_OUTCOME], tags[TAG_WINNER]) == ("skipped-succeeded", other_run)
        assert (facts[META_WINNER], facts[META_HOLDER], facts[META_ATTEMPT]) == (other_run, holder, 1)
        assert facts[META_OUTBOX] == "not-enqueued"
        assert (row.status, row.attempt, row.holder) == ("SUCCESS", 1, holder)
    else:
        own = f"dagster:tests/{result.run_id}"
        assert (tags[TAG_OUTCOME], tags[TAG_WINNER]) == ("reclaimed", result.run_id)
        assert (facts[META_WINNER], facts[META_HOLDER], facts[META_ATTEMPT]) == (result.run_id, own, 2)
        assert facts[META_OUTBOX] == "inserted"
        assert (row.status, row.attempt, row.holder) == ("SUCCESS", 2, own)


def _ready(ready: Path) -> bool:
    return ready.exists() and len(ready.read_text().split()) == 2


def _start_blocking_run(dagster_pg: DagsterPg, day: str, ready: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.dagster.blocking_run", day, str(ready)],
        cwd=REPO,
        env=dagster_pg.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.chaos
def test_a_killed_holder_is_taken_over_in_seconds_and_a_live_one_never(
    dagster_pg: DagsterPg, tmp_path: Path
) -> None:
    day = "2024-06-03"
    job = JobIdentity.schedule("t-wait", day)
    instance = dagster_pg.instance
    ready = tmp_path / "ready"
    proc = _start_blocking_run(dagster_pg, day, ready)
    try:
        wait_until(lambda: _ready(ready) or proc.poll() is not None, timeout=120)
        assert ready.exists(), proc.communicate()[1]
        step_pid, holder_run_id = ready.read_text().split()
        holder = f"dagster:tests/{holder_run_id}"
        assert _row(dagster_pg.joblease_url, job).holder == holder
        assert int(step_pid) != proc.pid  # the op runs in its own step process

        # A forced termination marks the run CANCELED at once, while its step process lives on and
        # heartbeats: a finished run alone is no proof of a dead holder.
        holder_run = instance.get_run_by_id(holder_run_id)
        assert holder_run is not None
        instance.report_run_canceled(holder_run, message="terminated by the test (forced)")
        assert holder_run_finished(instance, holder) is True
        impatient = jobs.impatient_job().execute_in_process(
            partition_key=day, instance=instance, run_config=QUIET, raise_on_error=False
        )
        assert not impatient.success
        tags = _tags(instance, impatient.run_id)
        (facts,) = step_records(instance, impatient.run_id).values()
        assert (tags[TAG_OUTCOME], facts[META_HOLDER], facts[META_ATTEMPT]) == ("held", holder, 1)
        assert "still held by " + holder in str(facts[META_ERROR])
        assert (impatient.get_step_failure_events()[0].step_failure_data.error or "") != ""
        row = _row(dagster_pg.joblease_url, job)
        assert (row.status, row.attempt, row.holder) == ("RUNNING", 1, holder)

        # Now the step process dies as in an OOM kill: no release, no more heartbeats.
        os.kill(int(step_pid), signal.SIGKILL)
        killed = time.monotonic()
        result = jobs.waiting_job().execute_in_process(partition_key=day, instance=instance)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
    assert result.success
    tags = _tags(instance, result.run_id)
    (facts,) = step_records(instance, result.run_id).values()
    assert (tags[TAG_OUTCOME], facts[META_ATTEMPT], tags[TAG_WINNER]) == ("reclaimed", 2, result.run_id)
    row = _row(dagster_pg.joblease_url, job)
    assert (row.status, row.attempt, row.holder) == ("SUCCESS", 2, f"dagster:tests/{result.run_id}")
    # The lease was 10 minutes long: only the dead-holder takeover can have freed it.
    print(f"\ndead holder taken over {took:.1f} s after SIGKILL (lease 600 s, holder's heartbeat 5 s)")
    messages = [entry.user_message or "" for entry in instance.all_logs(result.run_id)]
    # The killed run could not tag itself; the run that took its lease over did.
    dead = _tags(instance, holder_run_id)
    assert (dead[TAG_OUTCOME], dead[TAG_WINNER], dead[TAG_WORK]) == ("lost", "none", "lost:1")
    (said,) = step_records(instance, holder_run_id).values()
    assert (said[META_HOLDER], said[META_ATTEMPT], said[META_OUTBOX]) == (holder, 1, "unknown")
    assert str(said[META_ERROR]).startswith(f"attempt 1: holder {holder} is dead")
    # CANCELED as reported, or FAILURE once the run worker saw its step process die.
    assert any(f"holder {holder} is dead (its Dagster run is " in m for m in messages), messages
