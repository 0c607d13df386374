"""The restart chaos test's configuration: which command restarts the server, or why it skips.

These tests never run the command (the shared server must not restart); they check what would run.
"""

from __future__ import annotations

import shutil

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.pg_restart import RESTART_CMD_ENV, restart_command, server_url

LOCAL = make_url("postgresql+psycopg://postgres@127.0.0.1:5433/postgres")
LISTING = (
    "15  main  5432 online postgres /var/lib/postgresql/15/main log\n16  other 5433 online postgres x y\n"
)


def _tools(name: str) -> str | None:
    return f"/usr/bin/{name}"


def test_default_discovers_version_and_cluster_from_the_server() -> None:
    command, reason = restart_command(
        LOCAL, {}, which=_tools, server_major=lambda _: 16, clusters=lambda: LISTING
    )
    assert reason == ""
    assert command == ["pg_ctlcluster", "--skip-systemctl-redirect", "16", "other", "restart"]


def test_default_on_this_machine_uses_the_servers_own_version() -> None:
    url = server_url()
    if shutil.which("pg_ctlcluster") is None:
        pytest.skip("pg_ctlcluster is not installed here; the injected cases above cover the logic")
    command, reason = restart_command(url, {})
    if url.host not in ("127.0.0.1", "localhost", "::1", None):
        assert command is None and url.host in reason
        return
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        major = int(conn.exec_driver_sql("SHOW server_version_num").scalar_one()) // 10_000
    engine.dispose()
    assert command is not None, reason
    assert command[:3] == ["pg_ctlcluster", "--skip-systemctl-redirect", str(major)]


@pytest.mark.parametrize(
    ("url", "env", "which", "needle"),
    [
        (
            "postgresql+psycopg://me:s3cret@db.internal:5432/postgres",
            {},
            _tools,
            "db.internal:5432 is not on this machine",
        ),
        (str(LOCAL), {}, lambda _: None, "pg_ctlcluster/pg_lsclusters are not installed"),
        (str(LOCAL), {RESTART_CMD_ENV: "/nowhere/pg-restart --now"}, lambda _: None, "'/nowhere/pg-restart'"),
        ("postgresql+psycopg://u@127.0.0.1:6000/postgres", {}, _tools, "no local PostgreSQL 15 cluster"),
    ],
)
def test_skips_with_a_reason_when_the_server_cannot_be_restarted(
    url: str, env: dict[str, str], which: object, needle: str
) -> None:
    command, reason = restart_command(
        make_url(url),
        env,
        which=which,
        server_major=lambda _: 15,
        clusters=lambda: LISTING,  # type: ignore[arg-type]
    )
    assert command is None and needle in reason, reason
    assert "s3cret" not in reason
    assert RESTART_CMD_ENV in reason or "is not an executable" in reason


def test_the_environment_overrides_the_command_for_any_server() -> None:
    remote = make_url("postgresql+psycopg://me@db.internal:5432/postgres")
    command, reason = restart_command(
        remote, {RESTART_CMD_ENV: "ssh db.internal 'sudo systemctl restart postgresql'"}, which=_tools
    )
    assert reason == "" and command == ["ssh", "db.internal", "sudo systemctl restart postgresql"]


def test_the_chaos_test_takes_its_command_from_here() -> None:
    """The restart test itself must not hard-code a version or a cluster any more."""
    from pathlib import Path

    source = (Path(__file__).parent / "test_dispatch_chaos.py").read_text(encoding="utf-8")
    assert '"15"' not in source and "restart_command(" in source
