"""The fault-injection kit itself: reclaim_now, expire_now, RecordingDownstream's counts and faults,
drain_outbox, the crash helper, the pytest plugin (in a pristine pytest process) and the testing page's
example (docs/testing.md)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from dagster_joblease import Dispatcher, JobIdentity, Lease, LeaseService, Route, enqueue_once, errors
from dagster_joblease.receiver.app import effect_table
from dagster_joblease.storage.schema import lease_table
from dagster_joblease.testing import (
    CrashPoint,
    RecordingDownstream,
    crash_point,
    crash_run_exclusive,
    drain_outbox,
    expire_now,
    reclaim_now,
)
from dagster_joblease.testing.crash import not_arrived
from tests.conftest import DEFAULT_PG_URL, PG_URL_ENV, admin_url

REPO = Path(__file__).resolve().parent.parent
JOB = JobIdentity.schedule("kit-billing", "2026-11-29")
TOPIC = "billing"


def _row(engine: sa.Engine, job: JobIdentity = JOB) -> tuple[str, int, str]:
    t = lease_table
    with engine.connect() as conn:
        status, attempt, token = conn.execute(
            sa.select(t.c.status, t.c.attempt, t.c.owner_token).where(t.c.lock_key == job.idempotency_key)
        ).one()
    return str(status), int(attempt), str(token)


# -- reclaim_now / expire_now ---------------------------------------------------------------------


def test_reclaim_now_fences_out_every_write_of_the_original_holder(
    service: LeaseService, engine: sa.Engine
) -> None:
    original = service.acquire(JOB)
    assert original is not None
    taken = reclaim_now(service, original)
    assert (taken.attempt, taken.reclaimed) == (2, True)
    assert taken.owner_token != original.owner_token
    assert _row(engine) == ("RUNNING", 2, taken.owner_token)

    for write in (service.heartbeat, service.complete, service.release):
        with pytest.raises(errors.LostLeaseError):
            write(original)
    with pytest.raises(errors.LostLeaseError):
        service.fail(original, "too late")
    with pytest.raises(errors.LostLeaseError), service.fenced_transaction(original) as conn:
        enqueue_once(conn, idempotency_key=JOB.idempotency_key, topic=TOPIC, payload={})
    assert original.lost
    service.complete(taken)  # the new holder is unaffected
    assert _row(engine)[:2] == ("SUCCESS", 2)


def test_reclaim_now_of_a_lease_that_is_no_longer_held_raises(service: LeaseService) -> None:
    lease = service.acquire(JOB)
    assert lease is not None
    service.complete(lease)
    with pytest.raises(errors.LostLeaseError, match="reclaim"):
        reclaim_now(service, lease)
    with pytest.raises(errors.ConfigurationError, match="must be a Lease"):
        reclaim_now(service, "lease")  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigurationError, match="must be a LeaseService"):
        reclaim_now(object(), lease)  # type: ignore[arg-type]


def test_run_exclusive_reports_the_loss_even_when_the_callback_swallows_it(service: LeaseService) -> None:
    def careless(lease: Lease) -> str:
        reclaim_now(service, lease)
        try:
            with service.fenced_transaction(lease) as conn:
                enqueue_once(conn, idempotency_key=lease.idempotency_key, topic=TOPIC, payload={})
        except errors.LostLeaseError:
            return "stopped"
        return "wrote"

    with pytest.raises(errors.LostLeaseError) as info:
        service.run_exclusive(JOB, careless)
    assert (info.value.attempt, info.value.action) == (1, "complete")


def test_expire_now_lets_the_next_acquire_reclaim_at_once(service: LeaseService, engine: sa.Engine) -> None:
    assert expire_now(service, JOB) is False  # nothing running yet
    first = service.acquire(JOB)
    assert first is not None
    assert service.acquire(JOB) is None  # held by a live lease
    assert expire_now(service, JOB) is True
    second = service.acquire(JOB)
    assert second is not None and second.attempt == 2
    with pytest.raises(errors.InvalidJobIdentityError):
        expire_now(service, "kit-billing")  # type: ignore[arg-type]


# -- RecordingDownstream ----------------------------------------------------------------------------


def _post(downstream: RecordingDownstream, key: str, body: str = '{"v":1}', timeout: float = 10.0) -> int:
    response = httpx.post(
        downstream.url("/billing"), content=body, headers={"Idempotency-Key": key}, timeout=timeout
    )
    return response.status_code


def test_downstream_counts_posts_and_effects_per_key() -> None:
    with RecordingDownstream() as downstream:
        assert downstream.url("/billing") == downstream.url("billing")
        assert downstream.url().endswith("/")
        assert [_post(downstream, "k1"), _post(downstream, "k1"), _post(downstream, "k2")] == [200, 200, 200]
        assert _post(downstream, "k1", body='{"v":2}') == 422  # same key, another payload
        assert (downstream.posts("k1"), downstream.effects("k1")) == (3, 1)
        assert (downstream.posts("k2"), downstream.effects("k2")) == (1, 1)
        assert (downstream.posts("never"), downstream.effects("never")) == (0, 0)
        assert downstream.keys() == ["k1", "k2"]
        downstream.assert_each_effect_once()
        with pytest.raises(AssertionError, match=r"never: 0 effects, 0 POSTs"):
            downstream.assert_each_effect_once(["k1", "never"])
        with pytest.raises(errors.ConfigurationError, match="not one str"):
            downstream.assert_each_effect_once("k1")
    with pytest.raises(errors.ConfigurationError, match="not running"):
        downstream.url()


def test_downstream_can_keep_its_inbox_in_a_given_postgresql_database(pg_url: str) -> None:
    with RecordingDownstream(pg_url) as downstream:
        downstream.drop_after_apply_next(1)
        with pytest.raises(httpx.TransportError):
            _post(downstream, "k1")
        assert _post(downstream, "k1") == 200
        assert (downstream.posts("k1"), downstream.effects("k1")) == (2, 1)
        assert downstream.engine.dialect.name == "postgresql"
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:  # a given database is kept after close
            kept = conn.execute(sa.select(sa.func.count()).select_from(effect_table)).scalar_one()
    finally:
        engine.dispose()
    assert kept == 1


def test_fail_next_answers_the_status_and_applies_nothing(joblease_downstream: RecordingDownstream) -> None:
    assert _post(joblease_downstream, "before") == 200  # faults count from the call, not from the start
    joblease_downstream.fail_next(2, status=503)
    assert [_post(joblease_downstream, "k1"), _post(joblease_downstream, "k1")] == [503, 503]
    assert joblease_downstream.effects("k1") == 0
    with pytest.raises(AssertionError, match="k1: 0 effects, 2 POSTs"):
        joblease_downstream.assert_each_effect_once()
    assert _post(joblease_downstream, "k1") == 200
    assert (joblease_downstream.posts("k1"), joblease_downstream.effects("k1")) == (3, 1)
    joblease_downstream.assert_each_effect_once()


def test_drop_after_apply_applies_then_hangs_up(joblease_downstream: RecordingDownstream) -> None:
    joblease_downstream.drop_after_apply_next(1)
    with pytest.raises(httpx.TransportError):
        _post(joblease_downstream, "k1")
    assert joblease_downstream.effects("k1") == 1  # applied although the sender saw no answer
    response = httpx.post(
        joblease_downstream.url("/billing"), content='{"v":1}', headers={"Idempotency-Key": "k1"}
    )
    assert response.status_code == 200 and response.headers["Idempotent-Replayed"] == "true"
    assert (joblease_downstream.posts("k1"), joblease_downstream.effects("k1")) == (2, 1)


def test_slow_next_applies_then_answers_after_the_client_gave_up(
    joblease_downstream: RecordingDownstream,
) -> None:
    joblease_downstream.slow_next(1, 2.0)
    with pytest.raises(httpx.ReadTimeout):
        _post(joblease_downstream, "k1", timeout=0.3)
    assert (joblease_downstream.posts("k1"), joblease_downstream.effects("k1")) == (1, 1)


def test_bad_fault_arguments_are_refused(joblease_downstream: RecordingDownstream) -> None:
    with pytest.raises(errors.ConfigurationError):
        joblease_downstream.fail_next(0)
    with pytest.raises(errors.ConfigurationError):
        joblease_downstream.slow_next(1, -1.0)
    with pytest.raises(errors.ConfigurationError):
        joblease_downstream.url("/billing?x=1")


# -- drain_outbox ---------------------------------------------------------------------------------


def _enqueue(engine: sa.Engine, keys: list[str]) -> None:
    with engine.begin() as conn:
        for key in keys:
            enqueue_once(conn, idempotency_key=key, topic=TOPIC, payload={"key": key})


def test_drain_outbox_waits_out_retries_until_everything_is_sent(
    engine: sa.Engine, joblease_downstream: RecordingDownstream
) -> None:
    keys = [f"kit-{n}" for n in range(5)]
    _enqueue(engine, keys)
    joblease_downstream.fail_next(3)
    routes = {TOPIC: Route(joblease_downstream.url(TOPIC))}
    with Dispatcher(engine, routes, backoff_base_ms=1, backoff_max_ms=20) as dispatcher:
        report = drain_outbox(dispatcher)
    assert (report.sent, report.retried, report.dead) == (5, 3, 0)
    joblease_downstream.assert_each_effect_once(keys)


def test_drain_outbox_gives_up_loudly(engine: sa.Engine, joblease_downstream: RecordingDownstream) -> None:
    _enqueue(engine, ["kit-stuck"])
    joblease_downstream.fail_next(10_000)
    routes = {TOPIC: Route(joblease_downstream.url(TOPIC))}
    with (
        Dispatcher(engine, routes, backoff_base_ms=1, backoff_max_ms=5, max_attempts=10_000) as dispatcher,
        pytest.raises(AssertionError, match="1 PENDING rows"),
    ):
        drain_outbox(dispatcher, timeout_s=0.5)


# -- crash_run_exclusive (module-level callbacks: spawn imports them by name) ---------------------


def enqueue_bill(service: LeaseService, lease: Lease) -> None:
    with service.fenced_transaction(lease) as conn:
        enqueue_once(conn, idempotency_key=lease.idempotency_key, topic=TOPIC, payload={"day": "11-29"})


def enqueue_then_crash_then_enqueue_more(service: LeaseService, lease: Lease) -> None:
    enqueue_bill(service, lease)
    crash_point()
    with service.fenced_transaction(lease) as conn:
        enqueue_once(conn, idempotency_key=lease.idempotency_key + ":mail", topic=TOPIC, payload={})


def post_bill(url: str, service: LeaseService, lease: Lease) -> None:
    """An effect straight to the downstream (no outbox): only its Idempotency-Key dedupes a re-run."""
    httpx.post(
        url, content='{"day":"11-29"}', headers={"Idempotency-Key": lease.idempotency_key}
    ).raise_for_status()


@pytest.mark.chaos
@pytest.mark.parametrize(
    ("point", "rows"),
    [(CrashPoint.BEFORE_CALLBACK, 0), (CrashPoint.MARKED, 1), (CrashPoint.AFTER_CALLBACK, 2)],
)
def test_crash_leaves_the_lease_running_and_what_was_committed(
    joblease_service: LeaseService, point: CrashPoint, rows: int
) -> None:
    crashed = crash_run_exclusive(joblease_service, JOB, enqueue_then_crash_then_enqueue_more, at=point)
    assert crashed.exitcode == -9 and crashed.point is point
    assert crashed.lease is not None
    assert (crashed.lease.status, crashed.lease.attempt, crashed.lease.expired) == ("RUNNING", 1, False)
    assert len(crashed.outbox) == rows
    assert [r.idempotency_key for r in crashed.outbox] == [
        JOB.idempotency_key,
        JOB.idempotency_key + ":mail",
    ][:rows]


@pytest.mark.chaos
def test_a_direct_effect_repeated_by_the_rerun_is_deduplicated_downstream(
    service: LeaseService, joblease_downstream: RecordingDownstream
) -> None:
    effect = functools.partial(post_bill, joblease_downstream.url(TOPIC))
    crashed = crash_run_exclusive(service, JOB, effect, at=CrashPoint.AFTER_CALLBACK)
    assert crashed.lease is not None and crashed.lease.status == "RUNNING"
    assert expire_now(service, JOB)
    rerun = service.run_exclusive(JOB, functools.partial(effect, service))
    assert rerun.lease is not None and rerun.lease.attempt == 2
    key = JOB.idempotency_key
    assert (joblease_downstream.posts(key), joblease_downstream.effects(key)) == (2, 1)


@pytest.mark.chaos
def test_crash_helper_says_when_the_point_is_never_reached(joblease_service: LeaseService) -> None:
    with pytest.raises(AssertionError, match=r"never reached 'marked'.*SUCCESS"):
        crash_run_exclusive(joblease_service, JOB, enqueue_bill, at=CrashPoint.MARKED)


def test_crash_helper_refuses_a_callback_spawn_cannot_import(joblease_service: LeaseService) -> None:
    def local(service: LeaseService, lease: Lease) -> None:
        pass

    for fn in (local, lambda service, lease: None):
        with pytest.raises(errors.ConfigurationError, match="module level"):
            crash_run_exclusive(joblease_service, JOB, fn)
    with pytest.raises(errors.ConfigurationError, match="crash point"):
        crash_run_exclusive(joblease_service, JOB, enqueue_bill, at="later")  # type: ignore[arg-type]
    assert joblease_service.acquire(JOB) is not None  # nothing was started


# -- the plugin, in a pristine pytest process --------------------------------------------------------

PLUGIN_TESTS = """
import sys

import sqlalchemy as sa

from dagster_joblease import JobIdentity
from dagster_joblease.receiver.app import effect_table
from dagster_joblease.storage.schema import lease_table

JOB = JobIdentity.schedule("plugin", "2026-11-29")


def test_first(joblease_service, joblease_downstream):
    assert "dagster" not in sys.modules
    assert joblease_service.acquire(JOB) is not None
    assert joblease_downstream.url().startswith("http://127.0.0.1:")


def test_second_starts_with_empty_tables(joblease_engine, joblease_database_url):
    with joblease_engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(lease_table)).scalar_one() == 0
    print("BACKEND", joblease_engine.dialect.name, "DATABASE", joblease_engine.url.database)
"""


def _run_pytest(folder: Path, *args: str, pg_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (PG_URL_ENV, "PYTEST_ADDOPTS")}
    if pg_url is not None:
        env[PG_URL_ENV] = pg_url
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _databases() -> set[str]:
    engine = sa.create_engine(admin_url(), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())
    finally:
        engine.dispose()


@pytest.mark.chaos
def test_the_plugin_gives_each_test_empty_tables_on_a_throwaway_sqlite_file(tmp_path: Path) -> None:
    (tmp_path / "test_plugin_use.py").write_text(PLUGIN_TESTS)
    done = _run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout and "BACKEND sqlite" in done.stdout


@pytest.mark.chaos
def test_readme_example_and_the_plugin_on_postgresql_drop_their_database(tmp_path: Path) -> None:
    """A user's suite as a user runs it: the docs' example and the plugin's guarantees, on PostgreSQL."""
    (tmp_path / "test_plugin_use.py").write_text(PLUGIN_TESTS)
    (tmp_path / "test_billing.py").write_text(_page_examples()[0])
    done = _run_pytest(tmp_path, pg_url=os.environ.get(PG_URL_ENV, DEFAULT_PG_URL))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 passed" in done.stdout
    found = re.search(r"BACKEND postgresql DATABASE (joblease_kit_\w+)", done.stdout)
    assert found is not None, done.stdout
    assert found.group(1) not in _databases()  # the session's database was dropped


def test_loading_the_plugin_imports_no_dagster() -> None:
    program = (
        "import json, sys, dagster_joblease.testing.plugin\n"
        "heavy = ('dagster', 'dagster_postgres', 'dagster_joblease.dagster')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_plugin_is_registered_under_pytest11() -> None:
    from importlib.metadata import entry_points

    assert [(ep.name, ep.value) for ep in entry_points(group="pytest11") if ep.name == "joblease"] == [
        ("joblease", "dagster_joblease.testing.plugin")
    ]


# -- docs/testing.md -------------------------------------------------------------------------------------


def _page_examples() -> list[str]:
    page = (REPO / "docs" / "testing.md").read_text()
    section = page.split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_docs_examples_are_the_sample_user_project_tests() -> None:
    examples = _page_examples()
    assert examples == [
        (REPO / "tests" / "test_user_project.py").read_text(),
        (REPO / "tests" / "dagster" / "test_user_dagster_project.py").read_text(),
    ]


@pytest.mark.parametrize(
    ("message", "exitcode", "why"),
    [
        (
            ("finished", "the callback completed and the run was recorded SUCCESS"),
            0,
            "the callback completed",
        ),
        (
            ("finished", "run_exclusive raised RuntimeError: boom"),
            0,
            "run_exclusive raised RuntimeError: boom",
        ),
        (None, -9, "it died first (exit code -9)"),  # the pipe closed without a word
        (None, None, "it died first (exit code None)"),
    ],
)
def test_the_crash_helper_says_why_the_child_did_not_arrive(
    message: tuple[str, str | None] | None, exitcode: int | None, why: str
) -> None:
    assert not_arrived(message, exitcode).startswith(why)
