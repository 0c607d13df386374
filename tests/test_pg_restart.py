"""The restart chaos test's configuration: a private cluster unless the environment names a command.

These tests never run the command; they check what would run.
"""

from __future__ import annotations

from pathlib import Path

from tests.pg_restart import RESTART_CMD_ENV, restart_command


def _tools(name: str) -> str | None:
    return f"/usr/bin/{name}"


def test_unset_restarts_no_server_of_the_machines() -> None:
    assert restart_command({}, which=_tools) == (None, "")
    assert restart_command({RESTART_CMD_ENV: "   "}, which=_tools) == (None, "")


def test_the_environment_names_the_command_for_the_test_server() -> None:
    command, reason = restart_command(
        {RESTART_CMD_ENV: "ssh db.internal 'sudo systemctl restart postgresql'"}, which=_tools
    )
    assert reason == "" and command == ["ssh", "db.internal", "sudo systemctl restart postgresql"]


def test_a_command_that_is_not_here_is_a_reason_not_a_restart() -> None:
    command, reason = restart_command({RESTART_CMD_ENV: "/nowhere/pg-restart --now"}, which=lambda _: None)
    assert command is None and "'/nowhere/pg-restart'" in reason and RESTART_CMD_ENV in reason


def test_the_chaos_test_restarts_a_private_cluster_unless_told_otherwise() -> None:
    """Running the suite must never restart the machine's own PostgreSQL on its own initiative."""
    source = (Path(__file__).parent / "test_dispatch_chaos.py").read_text(encoding="utf-8")
    assert "pg_ctlcluster" not in source and "restart_command(" in source and "private_cluster(" in source
