"""The leased op helper and the fenced transaction, on SQLite and PostgreSQL, via Dagster test utilities."""

from __future__ import annotations

import dagster as dg
import pytest
import sqlalchemy as sa

from dagster_joblease import JobIdentity, LeaseService, create_engine
from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_op
from dagster_joblease.errors import (
    ConfigurationError,
    InvalidJobIdentityError,
    InvalidLeaseOptionsError,
    LostLeaseError,
)
from dagster_joblease.storage.schema import outbox_table
from tests.conftest import wait_until


def _outbox_count(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(outbox_table)).scalar_one())
    finally:
        engine.dispose()


def _enqueue(run: LeasedRun) -> str:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="unit", payload={"p": run.partition_key})
    return f"did {run.partition_key}"


enqueue_partition = leased_op(code="unit-op", name="enqueue_partition")(_enqueue)
impatient_enqueue = leased_op(code="unit-op", name="impatient_enqueue", held_wait_ms=200)(_enqueue)


def test_op_under_build_op_context_wins_then_skips(db_url: str) -> None:
    resource = JobLeaseResource(database_url=db_url)
    with dg.build_op_context(partition_key="2024-01-01", resources={"joblease": resource}) as context:
        first = enqueue_partition(context)
    with dg.build_op_context(partition_key="2024-01-01", resources={"joblease": resource}) as context:
        second = enqueue_partition(context)  # an ephemeral run: no stored run to tag, and no error
    key = JobIdentity.schedule("unit-op", "2024-01-01").idempotency_key
    (won,) = first.value
    assert (won.outcome, won.attempt, won.outbox, won.idempotency_key) == ("won", 1, "inserted", key)
    assert won.result == "did 2024-01-01"
    assert first.metadata["joblease/outcome"] == dg.MetadataValue.text("won")
    assert first.metadata["joblease/attempt"] == dg.MetadataValue.int(1)
    (skipped,) = second.value
    assert (skipped.outcome, skipped.attempt, skipped.outbox) == ("skipped-succeeded", 1, "not-enqueued")
    assert first.metadata["joblease/holder"] == dg.MetadataValue.text(won.holder or "")
    assert skipped.holder == won.holder  # build_op_context has no run: the holder is host:pid
    assert _outbox_count(db_url) == 1


def test_a_live_lease_elsewhere_is_held_not_a_green_skip(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        held = LeaseService(engine, holder="elsewhere:42").acquire(
            JobIdentity.schedule("unit-op", "2024-01-02")
        )
        assert held is not None
        with (
            dg.build_op_context(
                partition_key="2024-01-02", resources={"joblease": JobLeaseResource(database_url=db_url)}
            ) as context,
            pytest.raises(dg.Failure, match="still held by elsewhere:42") as failure,
        ):
            impatient_enqueue(context)
        assert failure.value.metadata["joblease/outcome"] == dg.MetadataValue.text("held")
        assert _outbox_count(db_url) == 0
        assert LeaseService(engine).heartbeat(held)  # the holder keeps its lease
    finally:
        engine.dispose()


def test_fenced_transaction_rolls_back_when_the_lease_was_reclaimed(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        job = JobIdentity.schedule("unit-fence", "k")
        mine = LeaseService(engine, lease_ms=300, heartbeat_ms=0).acquire(job)
        assert mine is not None
        with LeaseService(engine).fenced_transaction(mine) as conn:  # still ours: commits
            conn.execute(sa.text("SELECT 1"))
        thief = LeaseService(engine, lease_ms=60_000)
        stolen: list[object] = []
        wait_until(lambda: stolen.append(thief.acquire(job)) or stolen[-1] is not None, timeout=10)
        with pytest.raises(LostLeaseError), LeaseService(engine).fenced_transaction(mine) as conn:
            conn.execute(
                outbox_table.insert().values(
                    idempotency_key="v2:never",
                    topic="t",
                    payload={},
                    payload_sha256="0" * 64,
                    status="PENDING",
                    attempts=0,
                    next_attempt_at=sa.func.current_timestamp(),
                    created_at=sa.func.current_timestamp(),
                    updated_at=sa.func.current_timestamp(),
                )
            )
        assert _outbox_count(db_url) == 0
    finally:
        engine.dispose()


def test_expired_but_unclaimed_lease_is_not_ours_either(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        mine = LeaseService(engine, lease_ms=50, heartbeat_ms=0).acquire(
            JobIdentity.schedule("unit-fence", "x")
        )
        assert mine is not None

        def expired() -> bool:
            try:
                with LeaseService(engine).fenced_transaction(mine):
                    return False
            except LostLeaseError:
                return True

        wait_until(expired, timeout=5)
    finally:
        engine.dispose()


@leased_op(code="unit-seed", initial=True)
def seed(run: LeasedRun) -> None:
    assert run.partition_key is None
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="seed", payload={"v": 1})


def test_initial_op_runs_once_forever(sqlite_url: str) -> None:
    resources = {"joblease": JobLeaseResource(database_url=sqlite_url)}
    outcomes = []
    for _ in range(2):
        with dg.build_op_context(resources=resources) as context:
            (result,) = seed(context).value
            outcomes.append((result.outcome, result.partition_key, result.outbox))
    assert outcomes == [("won", None, "inserted"), ("skipped-succeeded", None, "not-enqueued")]


def test_a_schedule_op_without_a_partition_is_a_configuration_error(sqlite_url: str) -> None:
    with (
        dg.build_op_context(resources={"joblease": JobLeaseResource(database_url=sqlite_url)}) as context,
        pytest.raises(ConfigurationError, match="initial=True"),
    ):
        enqueue_partition(context)


def test_bad_options_and_codes_fail_before_any_database_work() -> None:
    resource = JobLeaseResource(database_url="sqlite:////nonexistent-dir/never.sqlite", lease_ms=1)
    with pytest.raises(InvalidLeaseOptionsError, match="lease_ms"):
        resource.lease_service  # noqa: B018
    with pytest.raises(InvalidJobIdentityError, match="code"):
        leased_op(code="  ")


def test_default_url_is_the_embedded_sqlite_under_dagster_home(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JOBLEASE_DATABASE_URL", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    assert JobLeaseResource().resolved_url() == f"sqlite:///{tmp_path}/joblease.sqlite"
    monkeypatch.setenv("JOBLEASE_DATABASE_URL", "sqlite:///elsewhere.sqlite")
    assert JobLeaseResource().resolved_url() == "sqlite:///elsewhere.sqlite"
    assert (
        JobLeaseResource(database_url="sqlite:///explicit.sqlite").resolved_url()
        == "sqlite:///explicit.sqlite"
    )


@leased_op(code="unit-ordered", name="ordered_enqueue")
def ordered_enqueue(run: LeasedRun) -> None:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="crm", payload={"p": run.partition_key}, ordering_key="customer-42")


def test_the_run_and_the_resource_enqueue_with_an_ordering_key(sqlite_url: str) -> None:
    resource = JobLeaseResource(database_url=sqlite_url)
    for day in ("2024-01-02", "2024-01-01"):
        with dg.build_op_context(partition_key=day, resources={"joblease": resource}) as context:
            ordered_enqueue(context)
    with resource.transaction() as conn:
        assert resource.enqueue_once(
            conn, idempotency_key="by-hand", topic="crm", payload={}, ordering_key="customer-42"
        )
    t = outbox_table
    with resource.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.payload, t.c.ordering_key).order_by(t.c.id)).all()
    assert [(r.payload.get("p"), r.ordering_key) for r in rows] == [
        ("2024-01-02", "customer-42"),
        ("2024-01-01", "customer-42"),
        (None, "customer-42"),
    ]
