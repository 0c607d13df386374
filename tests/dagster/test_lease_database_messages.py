"""Every message about the lease database names it and the command that fixes *that* database; the
embedded default says where leases live when Dagster's runs do not last; a bad URL fails early and
briefly (issue 40, findings 1, 2 and 7)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from dagster_joblease.dagster.ops import LeasedRun, leased_op
from dagster_joblease.dagster.resource import JobLeaseResource
from dagster_joblease.errors import ConfigurationError

BIN = Path(sys.executable).parent


@leased_op(code="i40-day")
def do_day(run: LeasedRun) -> None:
    with run.transaction() as conn:
        run.enqueue_once(conn, topic="i40", payload={"day": run.partition_key})


@dg.job(partitions_def=dg.DailyPartitionsDefinition(start_date="2024-01-01"))
def day_job() -> None:
    do_day()


def _errors(info: dg.SerializableErrorInfo | None) -> Iterator[dg.SerializableErrorInfo]:
    while info is not None:
        yield info
        info = info.cause or info.context


def _run(resource: JobLeaseResource, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    return day_job.execute_in_process(
        partition_key="2024-01-01", resources={"joblease": resource}, instance=instance, raise_on_error=False
    )


def _failure_errors(result: dg.ExecuteInProcessResult) -> list[dg.SerializableErrorInfo]:
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.RUN_FAILURE]
    failures += [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    failures += [e for e in result.all_events if e.event_type == dg.DagsterEventType.RESOURCE_INIT_FAILURE]
    found = [info for e in failures for info in _errors(getattr(e.event_specific_data, "error", None))]
    assert found, [e.event_type for e in result.all_events]
    return found


def _logs(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id)]


def test_a_schema_not_installed_names_the_database_and_the_command_that_fixes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 1: the resource reads another variable than $JOBLEASE_DATABASE_URL; the message names that
    file and a command for it, and running the command as printed makes the next run pass (before, the
    message said `joblease db upgrade`, which upgraded the default file and left this one as it was)."""
    file = tmp_path / "elsewhere" / "leases.sqlite"
    monkeypatch.setenv("OTHER_LEASE_URL", f"sqlite:///{file}")
    monkeypatch.delenv("JOBLEASE_DATABASE_URL", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    resource = JobLeaseResource(database_url=dg.EnvVar("OTHER_LEASE_URL"), migrate_on_first_use=False)
    with dg.DagsterInstance.ephemeral() as instance:
        failed = _run(resource, instance)
        assert not failed.success
        messages = " | ".join(e.message for e in _failure_errors(failed))
        assert f"the SQLite file {file}" in messages, messages
        match = re.search(r"run `(joblease --database-url [^`]+ db upgrade)`", messages)
        assert match, messages
        env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path)}  # no JOBLEASE_DATABASE_URL
        subprocess.run([str(BIN / "joblease"), *shlex.split(match[1])[1:]], cwd=tmp_path, env=env, check=True)
        assert _run(resource, instance).success


def test_an_unparseable_database_url_fails_when_the_definitions_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 7: a URL that cannot be parsed is refused when the resource is built (the code location
    loads), naming where it came from; before, it passed until the first run."""
    monkeypatch.setenv("JOBLEASE_DATABASE_URL", "postgres:/app@db.internal/app")
    with pytest.raises(ConfigurationError, match=r"\$JOBLEASE_DATABASE_URL: the database URL could not be"):
        dg.Definitions(jobs=[day_job], resources={"joblease": JobLeaseResource()})
    monkeypatch.setenv("JOBLEASE_DATABASE_URL", "mysql://app@db/app")
    with pytest.raises(ConfigurationError, match="unsupported database backend 'mysql'"):
        JobLeaseResource()
    monkeypatch.delenv("JOBLEASE_DATABASE_URL")
    monkeypatch.setenv("MY_URL", "nonsense")
    with pytest.raises(ConfigurationError, match=r"\$MY_URL"):
        JobLeaseResource(database_url=dg.EnvVar("MY_URL"))
    monkeypatch.delenv("MY_URL")
    JobLeaseResource(database_url=dg.EnvVar("MY_URL"))  # unset when loading: left to the run


def test_an_unreachable_database_fails_the_run_without_our_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 7: the run's error says which database and why, with no chain of our own frames and
    SQLAlchemy's under it (before: a StorageError caused by a StorageError caused by the driver's)."""
    monkeypatch.chdir(tmp_path)
    resource = JobLeaseResource(database_url="postgresql+psycopg://nobody:s3cret@127.0.0.1:1/nowhere")
    with dg.DagsterInstance.ephemeral() as instance:
        result = _run(resource, instance)
    assert not result.success
    infos = _failure_errors(result)
    ours = [i for i in infos if "cannot use the joblease database" in i.message]
    assert ours, [i.message for i in infos]
    for info in ours:
        assert "the PostgreSQL database 'nowhere' on 127.0.0.1:1" in info.message
        assert "s3cret" not in info.message
        assert info.cause is None and info.context is None, info.to_string()


def test_leases_in_the_fallback_file_warn_and_a_skip_names_an_absent_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 2: without $DAGSTER_HOME the leases live in ./.joblease/ (which git ignores), each run says
    so in its log, and a later instance's skip says the winner is a run it does not have; once
    $DAGSTER_HOME is set, a run names the lease file left behind instead of silently ignoring it."""
    monkeypatch.delenv("JOBLEASE_DATABASE_URL", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    resource = JobLeaseResource()
    with dg.DagsterInstance.ephemeral() as first:
        won = _run(resource, first)
        assert won.success
        logs = _logs(first, won.run_id)
    leases = tmp_path / ".joblease" / "joblease.sqlite"
    warned = [m for m in logs if f"this run's leases are kept in the SQLite file {leases}" in m]
    assert warned and "its runs are discarded when it goes, the leases stay" in warned[0], logs
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert ".joblease" not in status.stdout
    with dg.DagsterInstance.ephemeral() as second:
        skipped = _run(resource, second)
        assert skipped.success
        logs = _logs(second, skipped.run_id)
    absent = [m for m in logs if f"run {won.run_id}, which did i40-day@2024-01-01, is not on this" in m]
    assert absent, logs
    show = f"joblease --database-url sqlite:///{leases} leases show --code i40-day --run-key 2024-01-01"
    assert show in absent[0]
    # DAGSTER_HOME set later: the leases move to a file of its own, and the one left behind is named.
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.local_temp(str(home)) as lasting:
        again = _run(resource, lasting)
        assert again.success
        logs = _logs(lasting, again.run_id)
    behind = [m for m in logs if f"{leases} holds leases from runs made here without DAGSTER_HOME" in m]
    assert behind and f"the SQLite file {home / 'joblease.sqlite'}" in behind[0], logs
