"""The Components in a freshly scaffolded Dagster project, as a user adds them.

``create-dagster project`` (this environment's, at Dagster's pin; no ``uv sync``, no download) makes the
project; ``dg scaffold defs`` adds the four joblease components; ``dg list components`` lists them and
``dg check defs`` validates the location; then the definitions are loaded in-process
(``dg.load_from_defs_folder``) and a leased partition runs twice (one win, one recorded skip) and a
dispatcher run delivers its effect once, all against real PostgreSQL and a real HTTP downstream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from dagster_joblease import errors, identity
from dagster_joblease.dagster.metadata import TAG_OUTCOME
from dagster_joblease.testing import RecordingDownstream
from tests.dagster.conftest import DagsterPg

BIN = Path(sys.executable).parent
COMPONENTS = "dagster_joblease.dagster.components"
TYPES = [
    "JobLeaseResourceComponent",
    "JobLeaseDeliveryComponent",
    "LeasedScheduleComponent",
    "ReconciliationSensorComponent",
]

BILLING_PY = """
import dagster as dg

from dagster_joblease.dagster import LeasedRun, leased_asset, leased_op

daily = dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="UTC")


@leased_op(code="daily-billing")
def bill_day(run: LeasedRun) -> None:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="billing.daily", payload={"billingDate": run.partition_key})


@dg.job(partitions_def=daily)
def daily_billing_job() -> None:
    bill_day()


@leased_asset(code="daily-report", partitions_def=daily)
def daily_report(run: LeasedRun) -> None:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="billing.daily", payload={"reportDate": run.partition_key})
"""


def _dg(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, dagster_pg: DagsterPg) -> Iterator[Path]:
    """One scaffolded project for the module (scaffolding costs tens of seconds on a loaded machine)."""
    tmp_path = tmp_path_factory.mktemp("components")
    name = f"jl_components_{uuid.uuid4().hex[:8]}"
    env = dagster_pg.env(
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        DAGSTER_DG_UPDATE_CHECK_ENABLED="0",  # no PyPI look-up for a newer create-dagster / dg
        DAGSTER_DISABLE_TELEMETRY="1",
        COLUMNS="250",  # dg's tables wrap the type names at 80 columns
    )
    _dg([str(BIN / "create-dagster"), "project", "--no-uv-sync", name], tmp_path, env)
    root = tmp_path / name
    (root / "src" / name / "defs" / "billing.py").write_text(BILLING_PY)
    for type_name, path in zip(
        TYPES, ["joblease/resource", "joblease/delivery", "billing_schedule", "report_reconcile"], strict=True
    ):
        _dg([str(BIN / "dg"), "scaffold", "defs", f"{COMPONENTS}.{type_name}", path], root, env)
    # The scaffolded reconcile sensor targets the job; point this one at the leased asset instead.
    reconcile = root / "src" / name / "defs" / "report_reconcile" / "defs.yaml"
    text = reconcile.read_text()
    assert "job: daily_billing_job" in text and "code: daily-billing" in text
    reconcile.write_text(
        text.replace("job: daily_billing_job", "asset: daily_report").replace(
            "code: daily-billing", "code: daily-report"
        )
    )
    sys.path.insert(0, str(root / "src"))
    try:
        yield root
    finally:
        sys.path.remove(str(root / "src"))
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


@pytest.mark.timeout(600)
def test_a_scaffolded_project_declares_runs_and_delivers_with_the_components(
    project: Path,
    dagster_pg: DagsterPg,
    joblease_downstream: RecordingDownstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = joblease_downstream.url("/billing.daily")
    env = dagster_pg.env(
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        DAGSTER_DG_UPDATE_CHECK_ENABLED="0",
        COLUMNS="250",
        BILLING_API_URL=url,
    )
    listed = _dg([str(BIN / "dg"), "list", "components"], project, env).stdout
    for type_name in TYPES:
        assert f"{COMPONENTS}.{type_name}" in listed
    # One plain line each (dg shows a docstring's first paragraph; RST markup would show raw).
    out = _dg([str(BIN / "dg"), "list", "components", "--json"], project, env).stdout
    # dg 1.13 prints {"items": [...]}, dg 1.12 the bare list.
    listing = json.loads(out[min(i for i in (out.find('{"items"'), out.find("[{")) if i >= 0) :])
    items = listing["items"] if isinstance(listing, dict) else listing
    summaries = {i["key"].rsplit(".", 1)[-1]: i["summary"] for i in items if i["key"].startswith(COMPONENTS)}
    assert sorted(summaries) == sorted(TYPES)
    for type_name, summary in summaries.items():
        assert 0 < len(summary) <= 90 and "\n" not in summary, (type_name, summary)
        assert not any(mark in summary for mark in ("`", ":class:", ":func:")), (type_name, summary)
    checked = _dg([str(BIN / "dg"), "check", "defs"], project, env)
    assert "All definitions loaded successfully" in checked.stdout + checked.stderr

    monkeypatch.setenv("BILLING_API_URL", url)  # the route's url_env, read when the run starts
    defs = dg.load_from_defs_folder(path_within_project=project)
    repo = defs.get_repository_def()
    assert sorted(s.name for s in repo.schedule_defs) == ["daily_billing_job_schedule"]
    # The resource component brings the location's not-run sensors (on by default: a re-execution whose
    # leased step never ran must not keep its parent's copied outcome tags).
    assert sorted(s.name for s in repo.sensor_defs) == [
        "daily_report_reconcile",
        "joblease_not_run_canceled",
        "joblease_not_run_failure",
        "joblease_not_run_success",
        "outbox_dispatch_sensor",
    ]
    assert repo.get_sensor_def("joblease_not_run_success").default_status == dg.DefaultSensorStatus.RUNNING
    # Scaffolded stopped: a new project's route points at a receiver nobody has started yet.
    assert repo.get_sensor_def("outbox_dispatch_sensor").default_status == dg.DefaultSensorStatus.STOPPED
    assert {c.name for spec in repo.asset_checks_defs_by_key.values() for c in spec.check_specs} >= {
        "no_dead_rows",
        "delivery_backlog",
        "no_unrouted_rows",
    }

    # The schedule's own evaluation asks for yesterday's partition under the lease's run key.
    schedule = repo.get_schedule_def("daily_billing_job_schedule")
    window = dg.DailyPartitionsDefinition(start_date="2024-01-01").time_window_for_partition_key("2024-01-03")
    tick = window.start.replace(hour=2)
    resources = dict(defs.resources or {})  # the daemon gives a tick the location's resources
    with dg.build_schedule_context(
        scheduled_execution_time=tick, repository_def=repo, resources=resources
    ) as context:
        requests = schedule.evaluate_tick(context).run_requests or []
    assert [(r.run_key, r.partition_key) for r in requests] == [("2024-01-02", "2024-01-02")]

    job = defs.resolve_job_def("daily_billing_job")
    runs = [
        job.execute_in_process(partition_key="2024-01-02", instance=dagster_pg.instance, raise_on_error=False)
        for _ in range(2)
    ]
    assert all(r.success for r in runs)
    outcomes = [dagster_pg.instance.get_run_by_id(r.run_id).tags[TAG_OUTCOME] for r in runs]  # type: ignore[union-attr]
    assert outcomes == ["won", "skipped-succeeded"]
    # Done now: the next tick for that partition launches nothing and names the run that did it.
    with dg.build_schedule_context(
        scheduled_execution_time=tick, repository_def=repo, resources=resources
    ) as context:
        again = schedule.evaluate_tick(context)
    assert not again.run_requests
    assert (again.skip_message or "").startswith(
        f"skipped: daily-billing@2024-01-02 is already done by run {runs[0].run_id}"
    )

    dispatched = defs.resolve_job_def("outbox_dispatch_job").execute_in_process(
        instance=dagster_pg.instance, raise_on_error=False
    )
    assert dispatched.success
    key = identity.idempotency_key("SCHEDULE", "daily-billing", "2024-01-02")
    assert joblease_downstream.effects(key) == 1
    assert joblease_downstream.keys() == [key]


def test_a_component_names_what_it_cannot_find(project: Path) -> None:
    schedule = next(project.glob("src/*/defs/billing_schedule/defs.yaml"))
    original = schedule.read_text()
    schedule.write_text(original.replace("job: daily_billing_job", "job: daily_biling_job"))
    try:
        with pytest.raises(Exception) as raised:
            dg.load_from_defs_folder(path_within_project=project)
    finally:
        schedule.write_text(original)
    chain = _chain(raised.value)
    found = [e for e in chain if isinstance(e, errors.ConfigurationError)]
    assert found, chain
    assert str(found[0]) == (
        "LeasedScheduleComponent 'daily-billing': job 'daily_biling_job' of defs path 'billing.py' not "
        "found; that path defines ['daily_billing_job']"
    )


def test_a_target_module_not_written_yet_says_what_to_write(project: Path) -> None:
    """Scaffolds written before billing.py: the first check says what to write."""
    billing = next(project.glob("src/*/defs/billing.py"))
    moved = billing.with_name("billing.py.later")
    billing.rename(moved)
    try:
        with pytest.raises(Exception) as raised:
            dg.load_from_defs_folder(path_within_project=project)
    finally:
        moved.rename(billing)
    found = [e for e in _chain(raised.value) if isinstance(e, errors.ConfigurationError)]
    assert found, _chain(raised.value)
    message = str(found[0])
    assert message.startswith(
        "LeasedScheduleComponent 'daily-billing': target defs_path 'billing.py' does not "
    )
    assert "write the Python module that defines a partitioned job 'daily_billing_job' there first" in message


def _chain(exc: BaseException | None) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def test_secrets_are_environment_variable_names_not_values() -> None:
    from dagster_joblease.dagster.components import JobLeaseResourceComponent, RouteSpec

    with pytest.raises(errors.ConfigurationError) as raised:
        JobLeaseResourceComponent(database_url_env="postgresql://app:pw@db/app").build_resource()
    # The message shows a URL with its password hidden, and another non-name value not at all: the old
    # message printed both back while saying never to put a secret there.
    assert str(raised.value) == (
        "JobLeaseResourceComponent database_url_env must be the *name* of an environment variable (letters, "
        "digits, underscore; e.g. JOBLEASE_DATABASE_URL), never the secret itself; got the URL "
        "'postgresql://app:***@db/app' (password hidden). Put the value in that variable and write its name "
        "here."
    )
    with pytest.raises(errors.ConfigurationError) as raised:
        RouteSpec(url="https://x.test/a", secret_headers={"Authorization": "Bearer abc"}).build("billing")
    assert str(raised.value) == (
        "JobLeaseDeliveryComponent route 'billing' secret_headers['Authorization'] must be the *name* of an "
        "environment variable (letters, digits, underscore; e.g. JOBLEASE_DATABASE_URL), never the secret "
        "itself; got a value of 10 characters (not shown: it may be a secret). Put the value in that "
        "variable and write its name here."
    )
    assert "abc" not in str(raised.value)
    resource = JobLeaseResourceComponent(database_url_env="BILLING_DB_URL").build_resource()
    assert isinstance(resource.database_url, dg.EnvVar)
    assert resource.database_url.env_var_name == "BILLING_DB_URL"


def test_route_options_pass_through_to_route() -> None:
    from dagster_joblease.dagster.components import RouteSpec

    route = RouteSpec(url="https://x.test/a", options={"max_in_flight": 2, "rate": 5}).build("billing")
    assert (route.url, route.max_in_flight, route.rate) == ("https://x.test/a", 2, 5)
    with pytest.raises(errors.ConfigurationError) as raised:
        RouteSpec(url="https://x.test/a", options={"timeout_s": 3, "burst": 1}).build("billing")
    message = str(raised.value)
    assert message.startswith(
        "JobLeaseDeliveryComponent route 'billing': options ['burst', 'timeout_s'] are not Route options; "
        "allowed: ['"
    )
    assert message.endswith("(url, headers, secret_headers and timeout_s are attributes of their own)")
