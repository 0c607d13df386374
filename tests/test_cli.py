"""The ``joblease`` CLI against real PostgreSQL: every command, bad input, exit codes, no leaked secrets."""

from __future__ import annotations

import json
import os
import pty
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import make_url

from dagster_joblease import admin, cli, errors
from dagster_joblease.cli import common
from dagster_joblease.identity import JobIdentity
from dagster_joblease.lease import LeaseService
from dagster_joblease.receiver import effect_count
from dagster_joblease.storage import create_engine
from dagster_joblease.storage import engine as storage_engine
from dagster_joblease.storage.schema import HEAD_REVISION, lease_table, outbox_table
from tests.admin_helpers import DAY_MS, add_outbox_row, backdate_finished, count, lease_statuses
from tests.conftest import _admin_execute, admin_url
from tests.receiver_proc import start_receiver

SECRET = "S3cr3t-Pa55w0rd"


def run(url: str | None, *args: str, env: dict[str, str] | None = None) -> Result:
    prefix = [] if url is None else ["--database-url", url]
    return CliRunner().invoke(cli.main, [*prefix, *args], env=env, catch_exceptions=False)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A PostgreSQL database on which the joblease schema was never installed."""
    name = f"joblease_empty_{uuid.uuid4().hex[:10]}"
    _admin_execute(f'CREATE DATABASE "{name}"')
    yield admin_url().set(database=name).render_as_string(hide_password=False)
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _tables(url: str) -> list[str]:
    engine = create_engine(url, poolclass=sa.pool.NullPool)
    try:
        return sorted(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.fixture
def populated(pg_url: str) -> Iterator[tuple[str, sa.Engine, dict[str, str]]]:
    """Leases in every state and outbox rows in every state; yields (url, engine, names → keys)."""
    engine = create_engine(pg_url)
    svc = LeaseService(engine)
    svc.run_exclusive(JobIdentity.initial("bootstrap"), lambda _: None)
    done = svc.acquire(JobIdentity.schedule("daily-billing", "2026-01-01"))
    assert done is not None
    svc.complete(done, {"rows": 3})
    live = svc.acquire(JobIdentity.schedule("daily-billing", "2026-01-02"), lease_ms=600_000)
    assert live is not None

    def boom(_: object) -> None:
        raise RuntimeError("upstream 503\nwith a second line")

    with pytest.raises(RuntimeError):
        svc.run_exclusive(JobIdentity.schedule("export", "2026-01-01"), boom)
    add_outbox_row(engine, "k-pending", "billing")
    add_outbox_row(
        engine, "k-dead", "billing", status="DEAD", attempts=1, last_status=400, last_error="400: bad"
    )
    add_outbox_row(
        engine, "k-dead-mail", "mail", status="DEAD", attempts=10, last_status=503, last_error="503"
    )
    add_outbox_row(engine, "k-sent", "billing", status="SENT", attempts=1, sent_ago_ms=2 * DAY_MS)
    keys = {"live": live.idempotency_key, "bootstrap": JobIdentity.initial("bootstrap").idempotency_key}
    yield pg_url, engine, keys
    engine.dispose()


def test_help_of_every_command_and_no_dagster_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("JOBLEASE_DATABASE_URL", raising=False)
    paths = [
        [],
        ["db"],
        ["db", "upgrade"],
        ["db", "current"],
        ["db", "check"],
        ["leases"],
        ["leases", "list"],
        ["leases", "show"],
        ["leases", "fail"],
        ["leases", "purge"],
        ["outbox"],
        ["outbox", "stats"],
        ["outbox", "list"],
        ["outbox", "requeue"],
        ["outbox", "purge"],
        ["dispatch"],
        ["receiver"],
        ["demo"],
    ]
    for path in paths:
        result = run(None, *path, "--help")
        assert result.exit_code == 0, (path, result.output)
        assert "Usage: " in result.output
    top = run(None, "--help").output
    for name in ("db", "leases", "outbox", "dispatch", "receiver", "demo", "JOBLEASE_DATABASE_URL"):
        assert name in top
    assert list(tmp_path.iterdir()) == []  # --help never creates the default SQLite folder
    assert "--force" in run(None, "leases", "fail", "--help").output
    assert "two holders" in run(None, "leases", "fail", "--help").output

    probe = (
        "import sys\nfrom click.testing import CliRunner\nfrom dagster_joblease.cli import main\n"
        "r = CliRunner().invoke(main, ['--help'])\nassert r.exit_code == 0, r.output\n"
        "print('dagster' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_lazy_subcommand_that_cannot_load_gives_a_clear_error() -> None:
    group = common.JobleaseGroup(
        name="joblease",
        lazy_subcommands={
            "ghost": common.LazyCommand("dagster_joblease.no_such_module", "ghost_command", "Ghost.")
        },
    )
    assert "Ghost." in CliRunner().invoke(group, ["--help"]).output
    result = CliRunner().invoke(group, ["ghost", "--anything"])
    assert result.exit_code == 2
    assert "`joblease ghost` is unavailable" in result.output
    assert "dagster_joblease.no_such_module" in result.output


def test_schema_behind_exits_2_and_changes_nothing_until_db_upgrade(empty_pg_url: str) -> None:
    commands = [
        ["leases", "list"],
        ["leases", "show", "bootstrap"],
        ["leases", "fail", "1"],
        ["leases", "purge", "--finished-before", "30d"],
        ["outbox", "stats"],
        ["outbox", "list"],
        ["outbox", "requeue", "--all-dead"],
        ["outbox", "purge", "--sent-before", "7d"],
        ["dispatch", "--once", "--route", "t=http://127.0.0.1:9/t"],
    ]
    for command in commands:
        result = run(empty_pg_url, *command)
        assert result.exit_code == 2, (command, result.output)
        assert f"run `joblease --database-url {empty_pg_url} db upgrade`" in result.output  # this database
    assert _tables(empty_pg_url) == []

    current = run(empty_pg_url, "db", "current", "--json")
    assert current.exit_code == 0
    assert json.loads(current.output) == {
        "current_revision": None,
        "head_revision": HEAD_REVISION,
        "at_head": False,
    }
    check = run(empty_pg_url, "db", "check")
    assert check.exit_code == 2
    assert "schema is behind" in check.output and "add_table: joblease_lease" in check.output
    assert _tables(empty_pg_url) == []

    upgrade = run(empty_pg_url, "db", "upgrade")
    assert upgrade.exit_code == 0 and f"upgraded from none to {HEAD_REVISION}" in upgrade.output
    assert f"already at head revision {HEAD_REVISION}" in run(empty_pg_url, "db", "upgrade").output
    assert run(empty_pg_url, "db", "check").output.startswith("schema matches the models")
    assert "status:   at head" in run(empty_pg_url, "db", "current").output
    assert run(empty_pg_url, "leases", "list").output.strip() == "no leases match"


def test_db_check_reports_drift_with_exit_1(pg_url: str) -> None:
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX ix_joblease_outbox_dead")
    engine.dispose()
    result = run(pg_url, "db", "check")
    assert result.exit_code == 1
    assert "ix_joblease_outbox_dead" in result.output
    doc = json.loads(run(pg_url, "db", "check", "--json").output)
    assert doc["ok"] is False and doc["current_revision"] == HEAD_REVISION and doc["differences"]


def test_bad_urls_exit_2_without_leaking_the_password(tmp_path: Path) -> None:
    port = closed_port()
    unreachable = f"postgresql+psycopg://joblease:{SECRET}@127.0.0.1:{port}/joblease"
    for args in (["leases", "list"], ["db", "upgrade"], ["db", "current"], ["outbox", "stats", "--json"]):
        result = run(unreachable, *args)
        assert result.exit_code == 2, result.output
        assert f"cannot connect to the PostgreSQL database 'joblease' on 127.0.0.1:{port}" in result.output
        assert SECRET not in result.output and "joblease:" not in result.output

    env_result = run(None, "leases", "list", env={"JOBLEASE_DATABASE_URL": unreachable})
    assert env_result.exit_code == 2 and SECRET not in env_result.output

    for malformed in (
        f"postgresql+psycopg://joblease:{SECRET}@127.0.0.1:notaport/db",
        f"mysql://joblease:{SECRET}@127.0.0.1/db",
        f"postgresql+psycopg2://joblease:{SECRET}@127.0.0.1/db",
        "not a url",
    ):
        result = run(malformed, "leases", "list")
        assert result.exit_code == 2, (malformed, result.output)
        assert SECRET not in result.output
        assert result.output.startswith("Error: ")


def test_own_schema_via_search_path_and_no_prepared_statements(empty_pg_url: str) -> None:
    """The operations guide's URLs: a dedicated schema via options, and PgBouncer-safe prepare_threshold."""
    engine = sa.create_engine(empty_pg_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE SCHEMA joblease")
    url = f"{empty_pg_url}?options=-csearch_path%3Djoblease&prepare_threshold=none"
    assert run(url, "db", "upgrade").exit_code == 0
    assert run(url, "db", "check").exit_code == 0
    assert run(url, "leases", "list").output.strip() == "no leases match"
    with engine.connect() as conn:
        placed = conn.execute(
            sa.text(
                "SELECT table_schema, table_name FROM information_schema.tables "
                "WHERE table_name LIKE 'joblease%'"
            )
        ).all()
    assert sorted(placed) == [
        ("joblease", "joblease_alembic_version"),
        ("joblease", "joblease_inbox"),
        ("joblease", "joblease_lease"),
        ("joblease", "joblease_outbox"),
        ("joblease", "joblease_outbox_event"),
        ("joblease", "joblease_route_group"),
    ]
    engine.dispose()

    def prepared_after_repeats(engine_url: str) -> int:
        eng = create_engine(engine_url)  # every entry point builds its engine here
        try:
            with eng.connect() as conn:
                for _ in range(8):
                    conn.execute(
                        sa.text("SELECT count(*) FROM joblease_lease WHERE status = :s"), {"s": "FAIL"}
                    )
                return int(conn.execute(sa.text("SELECT count(*) FROM pg_prepared_statements")).scalar_one())
        finally:
            eng.dispose()

    plain = make_url(url).difference_update_query(["prepare_threshold"]).render_as_string(hide_password=False)
    assert prepared_after_repeats(plain) > 0  # psycopg's default: prepared after 5 executions
    assert prepared_after_repeats(url) == 0
    bad = run(f"{empty_pg_url}?prepare_threshold=soon", "leases", "list")
    assert bad.exit_code == 2 and "prepare_threshold='soon'" in bad.output


def test_leases_list_show_and_json(populated: tuple[str, sa.Engine, dict[str, str]]) -> None:
    url, _, keys = populated
    table = run(url, "leases", "list")
    assert table.exit_code == 0
    lines = table.output.splitlines()
    assert lines[0].split() == [
        "ID",
        "CODE",
        "RUN",
        "KEY",
        "STATUS",
        "ATTEMPT",
        "REMAINING",
        "HEARTBEAT",
        "HOLDER",
        "LAST",
        "ERROR",
    ]
    assert len(lines) == 5
    assert "RuntimeError: upstream 503 with a second line" in table.output
    (live_line,) = [line for line in lines if "RUNNING" in line]
    assert "2026-01-02" in live_line and ("9m" in live_line or "10m" in live_line)
    assert "every 1m, last " in live_line and "STALE" not in live_line  # the holder's own interval
    assert lines[0].index("STATUS") == live_line.index("RUNNING")

    rows = json.loads(run(url, "leases", "list", "--json").output)
    assert [r["status"] for r in rows] == ["FAIL", "RUNNING", "SUCCESS", "SUCCESS"]
    assert set(rows[1]) >= {
        "id",
        "idempotency_key",
        "code",
        "run_key",
        "remaining_ms",
        "expires_at",
        "last_error",
    }
    assert rows[1]["expires_at"].endswith("+00:00") and 0 < rows[1]["remaining_ms"] <= 600_000
    assert (rows[1]["heartbeat_ms"], rows[1]["stale"]) == (60_000, False)
    assert [
        r["code"] for r in json.loads(run(url, "leases", "list", "--code", "export", "--json").output)
    ] == ["export"]
    assert len(json.loads(run(url, "leases", "list", "--status", "SUCCESS", "--json").output)) == 2
    assert json.loads(run(url, "leases", "list", "--older-than", "1h", "--json").output) == []
    assert run(url, "leases", "list", "--older-than", "5x").exit_code == 2

    by_key = run(url, "leases", "show", keys["live"])
    assert by_key.exit_code == 0 and "status        RUNNING" in by_key.output
    assert "heartbeats    every 1m, last " in by_key.output
    shown = json.loads(run(url, "leases", "show", "daily-billing", "2026-01-01", "--json").output)
    assert shown["status"] == "SUCCESS" and shown["result"] == {"rows": 3}
    assert (
        json.loads(run(url, "leases", "show", "bootstrap", "--json").output)["idempotency_key"]
        == keys["bootstrap"]
    )
    assert (
        json.loads(run(url, "leases", "show", "--id", str(shown["id"]), "--json").output)["id"] == shown["id"]
    )

    unknown = run(url, "leases", "show", "v2:" + "0" * 64)
    assert unknown.exit_code == 1 and "no lease with key v2:000" in unknown.output
    hint = run(url, "leases", "show", "daily-billing")
    assert hint.exit_code == 1 and "give the run key too" in hint.output
    assert run(url, "leases", "show").exit_code == 2


def test_leases_fail_and_purge(populated: tuple[str, sa.Engine, dict[str, str]]) -> None:
    url, engine, keys = populated
    before = lease_statuses(engine)
    refused = run(url, "leases", "fail", keys["live"])
    assert refused.exit_code == 1
    assert "live lease" in refused.output and "--force" in refused.output and "twice" in refused.output
    assert lease_statuses(engine) == before

    mixed = run(url, "leases", "fail", keys["bootstrap"], "999999")
    assert mixed.exit_code == 1
    assert "SUCCESS is final" in mixed.output and "no lease with id 999999" in mixed.output
    # A lone word is an INITIAL job's code, as on `leases show` (it was a usage error before the two
    # commands took the same positional form): no such lease, exit 1, with the show's hint.
    unknown = run(url, "leases", "fail", "not-a-key")
    assert unknown.exit_code == 1 and "no lease for INITIAL run 'not-a-key'" in unknown.output
    assert run(url, "leases", "fail", "not-a-key", "2026-01-02", "x").exit_code == 2

    forced = run(url, "leases", "fail", "--force", "--reason", "node lost", keys["live"])
    assert forced.exit_code == 0, forced.output
    assert (
        "warning: lease" in forced.output and "is now FAIL" in forced.output and "attempt 2" in forced.output
    )
    row = json.loads(run(url, "leases", "show", keys["live"], "--json").output)
    assert row["status"] == "FAIL" and row["last_error"].startswith("admin reset of attempt 1: node lost")
    assert "was already FAIL" in run(url, "leases", "fail", keys["live"]).output

    backdate_finished(engine, 10 * DAY_MS)
    before = lease_statuses(engine)
    too_short = run(url, "leases", "purge", "--finished-before", "1d")
    assert too_short.exit_code == 2 and "minimum replay window of 7d" in too_short.output
    assert "Nothing was deleted" in too_short.output and lease_statuses(engine) == before
    env_floor = run(
        url, "leases", "purge", "--finished-before", "8d", env={admin.MIN_REPLAY_WINDOW_ENV: "9d"}
    )
    assert env_floor.exit_code == 2 and lease_statuses(engine) == before
    assert "would delete 3 " in run(url, "leases", "purge", "--finished-before", "7d", "--dry-run").output
    purged = run(url, "leases", "purge", "--finished-before", "7d")
    assert purged.exit_code == 0 and "deleted 3 finished SCHEDULE lease row(s)" in purged.output
    assert [r["code"] for r in json.loads(run(url, "leases", "list", "--json").output)] == ["bootstrap"]
    assert count(engine, lease_table) == 1


def test_outbox_commands(populated: tuple[str, sa.Engine, dict[str, str]]) -> None:
    url, engine, _ = populated
    stats = run(url, "outbox", "stats")
    assert stats.exit_code == 0
    assert "due now: 1" in stats.output and "TOPIC" in stats.output
    doc = json.loads(run(url, "outbox", "stats", "--json").output)
    assert doc["by_status"] == {"PENDING": 1, "SENT": 1, "DEAD": 2, "SKIPPED": 0}
    assert doc["due"] == 1 and doc["total"] == 4
    assert {"topic": "mail", "status": "DEAD", "count": 1} in doc["by_topic"]

    dead = run(url, "outbox", "list", "--status", "dead")
    assert dead.exit_code == 0 and "400: bad" in dead.output and "LAST STATUS" in dead.output
    rows = json.loads(run(url, "outbox", "list", "--status", "dead", "--json").output)
    assert [r["idempotency_key"] for r in rows] == ["k-dead-mail", "k-dead"]
    assert run(url, "outbox", "list", "--status", "lost").exit_code == 2

    assert run(url, "outbox", "requeue").exit_code == 2
    assert run(url, "outbox", "requeue", "1", "--all-dead").exit_code == 2
    unknown = run(url, "outbox", "requeue", "99999")
    assert unknown.exit_code == 1 and "no outbox row with id 99999" in unknown.output
    one = run(url, "outbox", "requeue", str(rows[1]["id"]))
    assert one.exit_code == 0 and "requeued 1 row(s)" in one.output
    requeued = json.loads(
        run(url, "outbox", "list", "--topic", "billing", "--status", "pending", "--json").output
    )
    assert "k-dead" in [r["idempotency_key"] for r in requeued]
    assert "requeued 1 row(s)" in run(url, "outbox", "requeue", "--topic", "mail").output
    assert "requeued 0 row(s)" in run(url, "outbox", "requeue", "--all-dead").output

    refused = run(url, "outbox", "purge", "--sent-before", "1h")
    assert refused.exit_code == 2 and "minimum retention of 1d" in refused.output
    assert count(engine, outbox_table) == 4
    purged = run(url, "outbox", "purge", "--sent-before", "1d", "--min-retention", "1d")
    assert purged.exit_code == 0 and "deleted 1 SENT or SKIPPED outbox row(s)" in purged.output
    assert count(engine, outbox_table) == 3


def _run_on_a_terminal(argv: list[str]) -> str:
    """Run ``argv`` with stdout on a pseudo-terminal (so isatty() is true); return what it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    return b"".join(chunks).decode()


def test_dispatch_once_delivers_and_parks_the_poison_row(pg_url: str, tmp_path: Path) -> None:
    engine = create_engine(pg_url)
    for i in range(5):
        add_outbox_row(engine, f"bill-{i}", "billing")
    add_outbox_row(engine, "poison-1", "poison")
    with start_receiver(pg_url, always_status_for_topic={"poison": 400}) as receiver:
        routes = tmp_path / "routes.toml"
        routes.write_text(f'[billing]\nurl = "{receiver.url}/billing"\ntimeout_s = 5\n')
        result = run(
            pg_url, "dispatch", "--once", "--routes", str(routes), "--route", f"poison={receiver.url}/poison"
        )
        # A pass that dead-lettered a row fails (exit 1), naming how many and how to requeue.
        assert result.exit_code == 1, result.output
        assert "1 row(s) were dead-lettered in this pass" in result.stderr
        assert "joblease outbox requeue --all-dead" in result.stderr
        assert "batch 1: claimed 6 sent 5 retried 0 dead 1" in result.output
        assert "warning: outbox row" in result.stderr and "topic poison) is DEAD: HTTP 400" in result.stderr
        assert "DEAD" not in result.stdout
        assert "done: claimed 6, sent 5, retried 0, dead 1" in result.output
        assert effect_count(engine) == 5

        loop = run(
            pg_url,
            "dispatch",
            "--loop",
            "--max-batches",
            "1",
            "--poll-interval",
            "0.05",
            "--json",
            "--route",
            f"billing={receiver.url}/billing",
        )
        assert loop.exit_code == 0, loop.output
        assert json.loads(loop.output)["claimed"] == 0

        for i in range(3):
            add_outbox_row(engine, f"tty-{i}", "billing")
        route = f"billing={receiver.url}/billing"
        cmd = [sys.executable, "-m", "dagster_joblease", "--database-url", pg_url, "dispatch", "--once"]
        screen = _run_on_a_terminal([*cmd, "--route", route])
        assert "\r1 batches  claimed 3  sent 3  retried 0  dead 0" in screen
        assert "batch 1:" not in screen and screen.rstrip().endswith(
            "done: claimed 3, sent 3, retried 0, dead 0"
        )
        assert effect_count(engine) == 8
    assert run(pg_url, "dispatch", "--once").exit_code == 2
    assert run(pg_url, "dispatch", "--route", "x=http://127.0.0.1:9/x").exit_code == 2
    assert run(pg_url, "dispatch", "--once", "--route", "nonsense").exit_code == 2
    engine.dispose()


def test_installed_console_script_and_python_m(populated: tuple[str, sa.Engine, dict[str, str]]) -> None:
    url, _, keys = populated
    script = Path(sys.executable).with_name("joblease")
    env = {**os.environ, "JOBLEASE_DATABASE_URL": url}
    listed = subprocess.run(
        [str(script), "leases", "list", "--json"], capture_output=True, text=True, env=env
    )
    assert listed.returncode == 0, listed.stderr
    assert keys["live"] in [r["idempotency_key"] for r in json.loads(listed.stdout)]
    failed = subprocess.run(
        [str(script), "leases", "fail", keys["live"]], capture_output=True, text=True, env=env
    )
    assert failed.returncode == 1 and "--force" in failed.stderr and failed.stdout == ""
    module = subprocess.run(
        [sys.executable, "-m", "dagster_joblease", "outbox", "stats", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert module.returncode == 0, module.stderr
    assert json.loads(module.stdout)["due"] == 1
    usage = subprocess.run(
        [sys.executable, "-m", "dagster_joblease", "--help"], capture_output=True, text=True
    )
    assert usage.returncode == 0 and usage.stdout.startswith("Usage: joblease ")


def test_duration_and_human_formats() -> None:
    convert = common.DURATION.convert
    assert convert("90s", None, None) == 90_000
    assert convert("1h30m", None, None) == 5_400_000
    assert convert("7d", None, None) == 7 * DAY_MS
    assert convert("500ms", None, None) == 500
    with pytest.raises(click.BadParameter):
        convert("7 days", None, None)
    assert [admin.human_ms(v) for v in (None, 850, 12_500, 252_000, 7_500_000, 7 * DAY_MS, -120_000)] == [
        "-",
        "850ms",
        "12.5s",
        "4m12s",
        "2h05m",
        "7d",
        "-2m",
    ]


def test_default_is_the_embedded_sqlite_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("JOBLEASE_DATABASE_URL", raising=False)
    assert run(None, "leases", "list").exit_code == 2  # not installed yet: run `joblease db upgrade`
    upgraded = run(None, "db", "upgrade")
    assert upgraded.exit_code == 0
    assert f"the SQLite file {tmp_path / '.joblease' / 'joblease.sqlite'}: upgraded" in upgraded.output
    assert (tmp_path / ".joblease" / "joblease.sqlite").is_file()
    assert run(None, "leases", "list").output.strip() == "no leases match"
    assert json.loads(run(None, "outbox", "stats", "--json").output)["total"] == 0


def _insert_far_future_rows(engine: sa.Engine) -> None:
    """Rows an older version could write (lease_ms = 2**53-1 put expiry in year 287453): inserted
    directly with SQL, in each backend's own stored form."""
    far = (
        "'287453-01-01 00:00:00+00'"
        if engine.dialect.name == "postgresql"
        else "'287453-01-01 00:00:00.000000'"
    )
    now = "now()" if engine.dialect.name == "postgresql" else "'2026-01-01 00:00:00.000000'"
    key = JobIdentity.schedule("legacy", "2026-01-01").idempotency_key
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO joblease_lease (lock_key, job_type, code, run_key, status, owner_token, attempt, "
            "lease_ms, holder, created_at, acquired_at, heartbeat_at, expires_at) VALUES "
            f"('{key}', 'SCHEDULE', 'legacy', '2026-01-01', 'RUNNING', 'tok', 1, {2**53 - 1}, 'old:1', "
            f"{now}, {now}, {now}, {far})"
        )
    add_outbox_row(engine, "k-far", "billing", attempts=3)
    o = outbox_table
    with engine.begin() as conn:
        conn.execute(sa.update(o).values(next_attempt_at=sa.literal_column(far)))


def test_listing_survives_rows_with_an_expiry_past_year_9999(db_url: str) -> None:
    engine = create_engine(db_url)
    _insert_far_future_rows(engine)
    key = JobIdentity.schedule("legacy", "2026-01-01").idempotency_key
    listed = run(db_url, "leases", "list")
    assert listed.exit_code == 0, listed.output
    assert "legacy" in listed.output and "RUNNING" in listed.output
    (row,) = json.loads(run(db_url, "leases", "list", "--json").output)
    assert row["expires_at"].startswith("9999-") and row["remaining_ms"] > 100 * 365 * DAY_MS
    shown = run(db_url, "leases", "show", key)
    assert shown.exit_code == 0 and "9999-" in shown.output, shown.output
    assert run(db_url, "leases", "show", "--id", str(row["id"])).exit_code == 0
    assert run(db_url, "leases", "list", "--status", "running", "--older-than", "1d").exit_code == 0
    assert run(db_url, "outbox", "list").exit_code == 0
    assert run(db_url, "outbox", "stats").exit_code == 0

    refused = run(db_url, "leases", "fail", key)
    assert refused.exit_code == 1 and "live lease" in refused.output
    forced = run(db_url, "leases", "fail", "--force", key)
    assert forced.exit_code == 0 and "is now FAIL" in forced.output, forced.output
    again = LeaseService(engine).acquire(JobIdentity.schedule("legacy", "2026-01-01"))
    assert again is not None and again.attempt == 2
    engine.dispose()


def test_floors_from_the_environment_are_floors(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """JOBLEASE_*_MIN_* floors cannot be lowered by a flag or by a library caller; only raised."""
    engine = create_engine(pg_url)
    svc = LeaseService(engine)
    assert svc.run_exclusive(JobIdentity.schedule("nightly", "2026-01-01"), lambda _: None).acquired
    backdate_finished(engine, 2 * DAY_MS)
    add_outbox_row(engine, "k-sent", "billing", status="SENT", attempts=1, sent_ago_ms=2 * DAY_MS)
    lease_env = {admin.MIN_REPLAY_WINDOW_ENV: "9d"}
    outbox_env = {admin.MIN_RETENTION_ENV: "3d"}

    lowered = run(
        pg_url, "leases", "purge", "--finished-before", "1d", "--min-replay-window", "0s", env=lease_env
    )
    assert lowered.exit_code == 2, lowered.output
    assert admin.MIN_REPLAY_WINDOW_ENV in lowered.output and "Nothing was deleted" in lowered.output
    lowered = run(pg_url, "outbox", "purge", "--sent-before", "1d", "--min-retention", "0s", env=outbox_env)
    assert lowered.exit_code == 2, lowered.output
    assert admin.MIN_RETENTION_ENV in lowered.output and "Nothing was deleted" in lowered.output
    assert count(engine, lease_table) == 1 and count(engine, outbox_table) == 1

    monkeypatch.setenv(admin.MIN_REPLAY_WINDOW_ENV, "9d")
    monkeypatch.setenv(admin.MIN_RETENTION_ENV, "3d")
    with pytest.raises(errors.RetentionWindowError, match=admin.MIN_REPLAY_WINDOW_ENV):
        admin.purge_leases(engine, finished_before_ms=DAY_MS, min_replay_window_ms=0)
    with pytest.raises(errors.RetentionWindowError, match=admin.MIN_RETENTION_ENV):
        admin.purge_sent(engine, older_than_ms=DAY_MS, min_retention_ms=0)
    monkeypatch.setenv(admin.MIN_RETENTION_ENV, "soon")
    with pytest.raises(errors.ConfigurationError, match=admin.MIN_RETENTION_ENV):
        admin.purge_sent(engine, older_than_ms=DAY_MS, min_retention_ms=0)
    monkeypatch.delenv(admin.MIN_REPLAY_WINDOW_ENV)
    monkeypatch.delenv(admin.MIN_RETENTION_ENV)
    assert count(engine, lease_table) == 1 and count(engine, outbox_table) == 1

    bad = run(pg_url, "outbox", "purge", "--sent-before", "7d", env={admin.MIN_RETENTION_ENV: "soon"})
    assert bad.exit_code == 2 and admin.MIN_RETENTION_ENV in bad.output
    # A flag may raise the floor above the environment's, and without the variable it sets it.
    raised = run(
        pg_url,
        "outbox",
        "purge",
        "--sent-before",
        "1d",
        "--min-retention",
        "2d",
        env={admin.MIN_RETENTION_ENV: "1d"},
    )
    assert raised.exit_code == 2 and "minimum retention of 2d" in raised.output
    ok = run(
        pg_url,
        "outbox",
        "purge",
        "--sent-before",
        "1d",
        "--min-retention",
        "1d",
        env={admin.MIN_RETENTION_ENV: "1d"},
    )
    assert ok.exit_code == 0 and "deleted 1 SENT" in ok.output
    ok = run(pg_url, "leases", "purge", "--finished-before", "1d", "--min-replay-window", "1d")
    assert ok.exit_code == 0 and "deleted 1 finished" in ok.output
    engine.dispose()


AWKWARD_PASSWORDS = ["p@ss#w/rd", "se@cr3t@x", "a/b@c#d?e", "Zq@w!x:y"]


def _fragments(password: str) -> list[str]:
    """The password and every piece of it (of 3+ characters) a mis-parse at @ # / ? : could show."""
    pieces = {password}
    for i in range(len(password)):
        for j in range(i + 3, len(password) + 1):
            if any(c in password[i:j] for c in "@#/?:") or j - i >= 4:
                pieces.add(password[i:j])
    return sorted(pieces, key=len, reverse=True)


@pytest.mark.parametrize("password", AWKWARD_PASSWORDS)
def test_unencoded_password_characters_never_leak(password: str) -> None:
    port = closed_port()
    urls = [
        f"postgresql+psycopg://joblease:{password}@127.0.0.1:{port}/joblease",
        f"postgresql://joblease:{password}@localhost/joblease?application_name=x",
    ]
    for url in urls:
        outputs = [
            run(url, "leases", "list"),
            run(url, "db", "upgrade"),
            run(url, "outbox", "stats", "--json"),
            run(None, "leases", "list", env={"JOBLEASE_DATABASE_URL": url}),
            run(url, "receiver", "--port", "0", "--no-migrate"),
            run(None, "receiver", "--port", "0", "--no-migrate", env={"JOBLEASE_DATABASE_URL": url}),
        ]
        for result in outputs:
            assert result.exit_code != 0, result.output
            text = result.output
            for fragment in _fragments(password):
                assert fragment not in text, (fragment, text)
        for shown in (storage_engine.redact_url(url), storage_engine.scrub_secrets(f"boom {url} !", url)):
            for fragment in _fragments(password):
                assert fragment not in shown, (fragment, shown)
    # The same password percent-encoded is a normal, unambiguous URL: host and database stay readable.
    from urllib.parse import quote

    encoded = f"postgresql+psycopg://joblease:{quote(password, safe='')}@127.0.0.1:{port}/joblease"
    result = run(encoded, "leases", "list")
    assert result.exit_code == 2 and f"on 127.0.0.1:{port}" in result.output
    assert (
        storage_engine.redact_url(encoded) == f"postgresql+psycopg://joblease:***@127.0.0.1:{port}/joblease"
    )


READ_AND_ADMIN_COMMANDS = [
    ["db", "current"],
    ["db", "check"],
    ["leases", "list"],
    ["leases", "show", "bootstrap"],
    ["leases", "fail", "1"],
    ["leases", "purge", "--finished-before", "30d"],
    ["outbox", "stats", "--json"],
    ["outbox", "list"],
    ["outbox", "requeue", "--all-dead"],
    ["outbox", "purge", "--sent-before", "7d"],
    ["dispatch", "--once", "--route", "t=http://127.0.0.1:9/t"],
]


def test_commands_other_than_db_upgrade_never_create_a_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "typo" / "joblease.sqlite"
    url = f"sqlite:///{missing}"
    for command in READ_AND_ADMIN_COMMANDS:
        result = run(url, *command)
        assert result.exit_code == 2, (command, result.output)
        assert f"no such database file: {missing}" in result.output, result.output
        assert f"joblease --database-url {url} db upgrade" in result.output  # the command for that file
    assert not (tmp_path / "typo").exists()

    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    monkeypatch.delenv("JOBLEASE_DATABASE_URL", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    for command in READ_AND_ADMIN_COMMANDS:
        assert run(None, *command).exit_code == 2, command
    assert list(workdir.iterdir()) == []  # no ./.joblease/
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    assert run(None, "outbox", "stats").exit_code == 2
    assert not (tmp_path / "dagster_home").exists()

    created = run(url, "db", "upgrade")
    assert created.exit_code == 0 and missing.is_file()
    assert run(url, "outbox", "stats", "--json").exit_code == 0


def test_leases_show_arguments_are_unambiguous(populated: tuple[str, sa.Engine, dict[str, str]]) -> None:
    url, _, keys = populated
    for lone in ("2026-01-02", "20260102", "2026-01-02-12:00", "42"):
        result = run(url, "leases", "show", lone)
        assert result.exit_code == 2, (lone, result.output)
        assert f"{lone!r} looks like a run key" in result.output and "--run-key" in result.output
    explicit = json.loads(
        run(url, "leases", "show", "--code", "daily-billing", "--run-key", "2026-01-02", "--json").output
    )
    assert explicit["idempotency_key"] == keys["live"]
    positional = json.loads(run(url, "leases", "show", "daily-billing", "2026-01-02", "--json").output)
    assert positional["id"] == explicit["id"]
    initial = json.loads(run(url, "leases", "show", "--code", "bootstrap", "--json").output)
    assert initial["idempotency_key"] == keys["bootstrap"]
    assert (
        json.loads(run(url, "leases", "show", "--key", keys["live"], "--json").output)["id"] == explicit["id"]
    )
    for bad in (
        ["--run-key", "2026-01-02"],
        ["daily-billing", "--code", "daily-billing"],
        ["--code", "daily-billing", "--id", "1"],
        [keys["live"], "2026-01-02"],
        ["--key", "daily-billing"],
    ):
        result = run(url, "leases", "show", *bad)
        assert result.exit_code == 2, (bad, result.output)
    assert "--code CODE" in run(url, "leases", "show", "--help").output
