"""``joblease db``: install, inspect and check the schema."""

from __future__ import annotations

import sys

import click

from dagster_joblease import storage
from dagster_joblease.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    current_state,
    echo_json,
    json_option,
)
from dagster_joblease.storage import engine as storage_engine


@click.group()
def db() -> None:
    """Install, inspect and check the joblease schema."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Upgrade the joblease tables to this package's head revision (idempotent; safe to run concurrently)."""
    state = current_state()
    engine = state.engine(require_head=False, create=True)
    for warning in storage.upgrade_warnings(engine):
        click.echo(f"warning: {warning}", err=True)
    before = storage.migrate(engine, warn=False)  # the warnings above, printed, not logged
    head = storage.head_revision()
    where = storage_engine.describe_database(state.url)
    if before == head:
        click.echo(f"{where}: already at head revision {head}")
    else:
        click.echo(f"{where}: upgraded from {before or 'none'} to {head}")


@db.command("current")
@json_option
def db_current(as_json: bool) -> None:
    """Show the schema revision of the database and the one this package needs."""
    state = current_state()
    current = storage.current_revision(state.engine(require_head=False))
    head = storage.head_revision()
    if as_json:
        echo_json({"current_revision": current, "head_revision": head, "at_head": current == head})
        return
    verdict = "at head" if current == head else f"behind: {storage_engine.upgrade_advice(state.url)}"
    installed = current or "none (not installed)"
    where = storage_engine.describe_database(state.url)
    click.echo(f"database: {where}\ncurrent:  {installed}\nhead:     {head}")
    click.echo(f"status:   {verdict}")


@db.command("check")
@json_option
def db_check(as_json: bool) -> None:
    """Compare the live schema with the package's models.

    Exit 0 when they match; 2 when the schema is behind (run `joblease db upgrade`); 1 when it is at head
    but differs (changed by hand) — the differences are listed.
    """
    state = current_state()
    diff = storage.check_schema(state.engine(require_head=False))
    behind = diff.db_revision != diff.head_revision
    if as_json:
        echo_json(
            {
                "ok": diff.ok,
                "current_revision": diff.db_revision,
                "head_revision": diff.head_revision,
                "differences": list(diff.differences),
            }
        )
    elif diff.ok:
        click.echo(f"schema matches the models (revision {diff.head_revision})")
    else:
        if behind:
            click.echo(
                f"schema is behind: database at {diff.db_revision or 'none (not installed)'}, this package "
                f"needs {diff.head_revision}; {storage_engine.upgrade_advice(state.url)}"
            )
        if diff.differences:
            click.echo("differences between the live schema and the models:")
            for line in diff.differences:
                click.echo(f"  - {line}")
    if not diff.ok:
        sys.exit(EXIT_USAGE if behind else EXIT_FAILED)
