"""The ``joblease`` operator CLI: schema, leases, outbox, dispatch, and the reference receiver and demo.

One module per command group (:mod:`~dagster_joblease.cli.db`, :mod:`~dagster_joblease.cli.leases`,
:mod:`~dagster_joblease.cli.outbox`, :mod:`~dagster_joblease.cli.dispatch`,
:mod:`~dagster_joblease.cli.receiver`, :mod:`~dagster_joblease.cli.demo`), each a thin layer over
:mod:`dagster_joblease.admin` and friends; what they share is :mod:`~dagster_joblease.cli.common`.
Exit codes: 0 ok; 1 the operation failed or the database state refused it (unknown key, live lease,
storage failure); 2 usage or configuration error (bad option, malformed/unreachable database URL, a
schema that is behind, a refused purge window) — in every exit-2 case nothing was changed. No output ever
contains a password or a full database URL.

``receiver`` and ``demo`` are loaded lazily so ``joblease --help`` never imports Starlette or Dagster.
"""

from __future__ import annotations

import click

from dagster_joblease import storage
from dagster_joblease.cli import db, dispatch, leases, outbox
from dagster_joblease.cli.common import JobleaseGroup, LazyCommand, State

__all__ = ["main"]

LAZY_SUBCOMMANDS = {
    "receiver": LazyCommand(
        "dagster_joblease.cli.receiver",
        "receiver_command",
        "Run the reference downstream HTTP receiver (inbox).",
    ),
    "demo": LazyCommand(
        "dagster_joblease.cli.demo",
        "demo_command",
        "Run the end-to-end demo (Dagster, leases, outbox, receiver).",
    ),
    "demo-ui": LazyCommand(
        "dagster_joblease.cli.demo",
        "demo_ui_command",
        "Serve the Dagster UI on a kept demo's runs (dg dev and a receiver).",
    ),
}


@click.group(
    cls=JobleaseGroup,
    lazy_subcommands=LAZY_SUBCOMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.option(
    "--database-url",
    envvar=storage.DATABASE_URL_ENV,
    show_envvar=True,
    metavar="URL",
    help="SQLAlchemy URL of the joblease database, e.g. postgresql+psycopg://user@host:5432/db "
    "(default: the embedded SQLite file under $DAGSTER_HOME, else ./.joblease/joblease.sqlite).",
)
@click.version_option(package_name="dagster-joblease", prog_name="joblease")
@click.pass_context
def main(ctx: click.Context, database_url: str | None) -> None:
    """Operate dagster-joblease: schema, leases, outbox, dispatch.

    Exit codes: 0 ok; 1 the operation failed or was refused by the rows' state (unknown key, live lease,
    database failure); 2 usage or configuration error (bad option, malformed or unreachable database URL,
    schema behind: run `joblease db upgrade`, purge window below its minimum) — nothing was changed.
    """
    state = State(database_url)
    ctx.obj = state
    ctx.call_on_close(state.close)


main.add_command(db.db)
main.add_command(leases.leases)
main.add_command(outbox.outbox)
main.add_command(dispatch.dispatch_command)
