"""Holder labels (``dagster:<deployment>/<run_id>``), the holder option of the lease service, and the
fenced takeover of a dead holder's lease, on SQLite and PostgreSQL."""

from __future__ import annotations

import uuid

import dagster as dg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from dagster_joblease import JobIdentity, LeaseService
from dagster_joblease.cli import main as cli
from dagster_joblease.dagster import JobLeaseResource
from dagster_joblease.dagster.holders import (
    DagsterHolder,
    decode_holder,
    default_deployment,
    encode_holder,
    holder_run_finished,
    holder_run_status,
)
from dagster_joblease.errors import ConfigurationError, InvalidLeaseOptionsError, LostLeaseError
from dagster_joblease.storage.schema import lease_table
from tests.conftest import wait_until


def test_holder_labels_round_trip_and_other_holders_are_not_dagster_runs() -> None:
    run_id = str(uuid.uuid4())
    label = encode_holder("prod-eu", run_id)
    assert label == f"dagster:prod-eu/{run_id}"
    assert decode_holder(label) == DagsterHolder("prod-eu", run_id)
    assert str(decode_holder(label)) == label
    for other in (None, "", "vm:1234", "dagster:", "dagster:no-run-id", "dagster:a b/x", "dagster:/x"):
        assert decode_holder(other) is None
    for bad in ("", "a/b", "has space", "x" * 129):
        with pytest.raises(ConfigurationError, match="deployment"):
            encode_holder(bad, run_id)
    with pytest.raises(ConfigurationError, match="run id"):
        encode_holder("prod", "not/a run")
    with pytest.raises(ConfigurationError, match="deployment"):
        JobLeaseResource(database_url="sqlite:////nonexistent/x.sqlite", deployment="bad/name").lease_service  # noqa: B018


def test_holder_option_is_recorded_and_validated(engine: sa.Engine, db_url: str) -> None:
    label = encode_holder("tests", str(uuid.uuid4()))
    service = LeaseService(engine, holder=label)
    first = service.acquire(JobIdentity.schedule("holder-opt", "a"))
    second = service.acquire(JobIdentity.schedule("holder-opt", "b"), holder="plain:1")
    assert first is not None and second is not None
    with engine.connect() as conn:
        holders = dict(conn.execute(sa.select(lease_table.c.run_key, lease_table.c.holder)).all())
    assert holders == {"a": label, "b": "plain:1"}
    for bad in ("", " padded", "x" * 256, "tab\there", 42):
        with pytest.raises(InvalidLeaseOptionsError, match="holder"):
            LeaseService(engine, holder=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidLeaseOptionsError, match="holder"):
            service.acquire(JobIdentity.schedule("holder-opt", "c"), holder=bad)  # type: ignore[arg-type]
    # `joblease leases show` prints the holder.
    shown = CliRunner().invoke(cli, ["--database-url", db_url, "leases", "show", "holder-opt", "a"])
    assert shown.exit_code == 0, shown.output
    assert label in shown.output


def test_a_dead_holder_is_failed_only_when_stale_and_unchanged(
    engine: sa.Engine, other_engine: sa.Engine
) -> None:
    job = JobIdentity.schedule("dead-holder", "k")
    holder = LeaseService(engine, lease_ms=600_000, heartbeat_ms=0)
    mine = holder.acquire(job)
    assert mine is not None
    rival = LeaseService(other_engine, lease_ms=600_000)
    reason = "holder's Dagster run is FAILURE and it stopped heartbeating"
    # A fresh heartbeat, another attempt or another owner token: the holder keeps its lease.
    assert not rival.fail_dead_holder(
        job, attempt=1, owner_token=mine.owner_token, stale_ms=60_000, reason=reason
    )
    assert not rival.fail_dead_holder(job, attempt=2, owner_token=mine.owner_token, stale_ms=1, reason=reason)
    assert not rival.fail_dead_holder(job, attempt=1, owner_token="0" * 32, stale_ms=1, reason=reason)
    holder.heartbeat(mine)  # still ours
    with pytest.raises(InvalidLeaseOptionsError, match="stale_ms"):
        rival.fail_dead_holder(job, attempt=1, stale_ms=0, reason=reason)

    # Stale by 50 ms on the database clock: taken away in one fenced statement.
    wait_until(
        lambda: rival.fail_dead_holder(
            job, attempt=1, owner_token=mine.owner_token, stale_ms=50, reason=reason
        ),
        timeout=10,
    )
    assert not rival.fail_dead_holder(job, attempt=1, stale_ms=50, reason=reason)  # only once
    # The survivor is fenced out of every write; the next claim reclaims it as attempt 2.
    with pytest.raises(LostLeaseError):
        holder.heartbeat(mine)
    with pytest.raises(LostLeaseError), holder.fenced_transaction(mine):
        pass
    taken = rival.acquire(job)
    assert taken is not None and taken.attempt == 2 and taken.previous_error == reason


def test_holder_run_finished_looks_the_run_up_on_this_instance() -> None:
    @dg.op
    def nothing() -> None:
        pass

    @dg.job
    def tiny() -> None:
        nothing()

    with dg.instance_for_test() as instance:
        result = tiny.execute_in_process(instance=instance)
        deployment = default_deployment(instance)
        assert deployment.startswith("storage-") and deployment == default_deployment(instance)
        finished = encode_holder(deployment, result.run_id)
        assert holder_run_finished(instance, finished) is True
        assert holder_run_status(instance, finished) == dg.DagsterRunStatus.SUCCESS
        # Another deployment's run, or a holder that is not a Dagster run: unknown here (None).
        assert holder_run_finished(instance, encode_holder(deployment, str(uuid.uuid4()))) is None
        assert holder_run_finished(instance, "vm:1234") is None
        queued = instance.create_run_for_job(tiny, status=dg.DagsterRunStatus.NOT_STARTED)
        assert holder_run_finished(instance, encode_holder(deployment, queued.run_id)) is False


def test_dagster_side_defaults_recover_in_seconds() -> None:
    timing = JobLeaseResource(database_url="sqlite:///unused.sqlite").timing()
    assert (timing.lease_ms, timing.heartbeat_ms) == (180_000, 10_000)
    assert JobLeaseResource().resolved_held_wait_ms() == 300_000
    short = JobLeaseResource(lease_ms=2_000).timing()
    assert short.heartbeat_ms == 666  # min(10 s, lease / 3)
    with pytest.raises(InvalidLeaseOptionsError, match="held_wait_ms"):
        JobLeaseResource(held_wait_ms=-1).resolved_held_wait_ms()
