"""The ``joblease`` operator CLI: schema, leases, outbox, dispatch, and the reference receiver and demo.

A thin layer over :mod:`dagster_joblease.admin` and friends. Exit codes: 0 ok; 1 the operation failed or
the database state refused it (unknown key, live lease, storage failure); 2 usage or configuration error
(bad option, malformed/unreachable database URL, a schema that is behind, a refused purge window) — in
every exit-2 case nothing was changed. No output ever contains a password or a full database URL.

``receiver`` and ``demo`` are loaded lazily so ``joblease --help`` never imports Dagster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import sqlalchemy as sa

from dagster_joblease import admin, errors, storage
from dagster_joblease.storage import engine as storage_engine

if TYPE_CHECKING:
    from dagster_joblease.dispatch import Dispatcher, Route
    from dagster_joblease.outbox import GroupPause

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_USAGE = 2
MIN_RETENTION_ENV = admin.MIN_RETENTION_ENV
MIN_REPLAY_WINDOW_ENV = admin.MIN_REPLAY_WINDOW_ENV
ERROR_CELL_CHARS = 60

# -- errors and exit codes -------------------------------------------------------------------------


class CliError(click.ClickException):
    """The operation failed or the rows' state refused it (exit 1)."""

    exit_code = EXIT_FAILED


class CliConfigError(CliError):
    """Usage or configuration error; nothing was changed (exit 2)."""

    exit_code = EXIT_USAGE


def cli_error(message: str, exit_code: int) -> CliError:
    return CliConfigError(message) if exit_code == EXIT_USAGE else CliError(message)


def exit_code_for(exc: errors.JobLeaseError) -> int:
    """2 for configuration and for input refused before any change (ValueError family, schema behind);
    1 for everything the database or the rows' state refused or failed."""
    if isinstance(exc, errors.SchemaNotAtHeadError | errors.ConfigurationError | ValueError):
        return EXIT_USAGE
    return EXIT_FAILED


def _target(url: str) -> str:
    """Where we are connected, for messages: backend, host, port, database — never user, password, query."""
    try:
        parsed = storage_engine.normalize_url(url)
    except errors.ConfigurationError:
        return "the configured database"
    if parsed.get_backend_name() == "sqlite":
        return f"sqlite file {parsed.database}"
    server = f"{parsed.host or 'the local socket'}:{parsed.port or 5432}"
    if not parsed.database:
        return f"{parsed.get_backend_name()} server {server} (the URL names no database)"
    return f"{parsed.get_backend_name()} database {parsed.database!r} on {server}"


POSTGRES_URL_FORM = "postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DATABASE"


def _connect_advice(url: str) -> str:
    """How to fix a URL we could not connect with: what it lacks, else what to check, and its form."""
    where = f"--database-url / ${storage.DATABASE_URL_ENV}"
    try:
        parsed = storage_engine.normalize_url(url)
    except errors.ConfigurationError:
        return f"Check {where}."
    if parsed.get_backend_name() == "sqlite":
        return f"Check {where}."
    if not parsed.database:
        return f"Name the database in {where}: {POSTGRES_URL_FORM}."
    return (
        f"Check that the server is up and that the host, port, user and database in {where} are right "
        f"({POSTGRES_URL_FORM})."
    )


# -- shared state ----------------------------------------------------------------------------------


class State:
    """The configured URL and, once a command needs it, one engine (disposed when the command ends)."""

    def __init__(self, url: str | None) -> None:
        self._url = url
        self._engine: sa.Engine | None = None

    @property
    def url(self) -> str:
        # Resolved on first use, and only named: `db upgrade` creates the file, nothing else does.
        if not self._url:
            self._url = storage_engine.default_sqlite_url(create=False)
        return self._url

    def scrub(self, text: str) -> str:
        """Belt and braces: drop the raw URL, its password and any piece of it from any text we print."""
        return storage_engine.scrub_secrets(text, self._url or None)

    def engine(self, *, require_head: bool = True, create: bool = False) -> sa.Engine:
        """An engine that has connected once; ``require_head``: the schema must be at this package's head.

        Only ``create=True`` (``db upgrade``) may create a SQLite file: opening a mistyped path would
        otherwise create it (and its folder) and then report an empty, uninstalled database.
        """
        if self._engine is None:
            url = self.url
            path = storage_engine.sqlite_file(url)
            if path is not None and not create and not path.is_file():
                raise CliConfigError(
                    f"no such database file: {path}. Check --database-url / ${storage.DATABASE_URL_ENV}, "
                    "or create and install it with `joblease db upgrade`."
                )
            self._engine = storage.create_engine(url)
            try:
                with storage_engine.translate_errors("connect"), self._engine.connect():
                    pass
            except errors.StorageError as exc:
                raise CliConfigError(
                    self.scrub(f"cannot connect to {_target(url)}: {exc}. {_connect_advice(url)}")
                ) from exc
        if require_head:
            storage.require_schema(self._engine)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()


def _state() -> State:
    state = click.get_current_context().find_object(State)
    assert state is not None
    return state


# -- lazy subcommands ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LazyCommand:
    module: str
    attribute: str
    short_help: str


def _unavailable(name: str, spec: LazyCommand, reason: str) -> click.Command:
    def callback(**_: Any) -> None:
        raise CliConfigError(
            f"`joblease {name}` is unavailable: {spec.module}.{spec.attribute} could not be loaded ({reason})"
        )

    return click.Command(
        name,
        callback=callback,
        help=f"Unavailable in this installation: {reason}",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
    )


class JobleaseGroup(click.Group):
    """The top-level group: lazy subcommands (the click docs' LazyGroup pattern, with static short help so
    ``--help`` imports nothing) and one place that maps library errors onto messages and exit codes."""

    def __init__(self, *args: Any, lazy_subcommands: Mapping[str, LazyCommand] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_subcommands])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = self.lazy_subcommands.get(cmd_name)
        if spec is None:
            return super().get_command(ctx, cmd_name)
        try:
            command = getattr(importlib.import_module(spec.module), spec.attribute)
        except (ImportError, AttributeError) as exc:
            return _unavailable(cmd_name, spec, f"{type(exc).__name__}: {exc}")
        if not isinstance(command, click.Command):
            return _unavailable(cmd_name, spec, f"{spec.attribute} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: list[tuple[str, str]] = []
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max((len(n) for n in names), default=0)
        for name in names:
            spec = self.lazy_subcommands.get(name)
            if spec is not None:
                rows.append((name, spec.short_help))
                continue
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.JobLeaseError as exc:
            state = ctx.find_object(State)
            message = str(exc) if state is None else state.scrub(str(exc))
            raise cli_error(message, exit_code_for(exc)) from exc


LAZY_SUBCOMMANDS = {
    "receiver": LazyCommand(
        "dagster_joblease.receiver",
        "receiver_command",
        "Run the reference downstream HTTP receiver (inbox).",
    ),
    "demo": LazyCommand(
        "dagster_joblease.dagster.demo",
        "demo_command",
        "Run the end-to-end demo (Dagster, leases, outbox, receiver).",
    ),
    "demo-ui": LazyCommand(
        "dagster_joblease.dagster.demo",
        "demo_ui_command",
        "Serve the Dagster UI on a kept demo's runs (dg dev and a receiver).",
    ),
}

# -- parameters and formatting ---------------------------------------------------------------------


class Duration(click.ParamType[int]):
    """``90s``, ``30m``, ``2h``, ``7d``, ``1w``, ``1h30m``, ``500ms`` → milliseconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        ms = admin.parse_duration_ms(str(value))
        if ms is None:
            self.fail(f"{value!r} is not a duration; use e.g. 90s, 30m, 2h, 7d or 1h30m", param, ctx)
        return ms


DURATION = Duration()


human_ms = admin.human_ms


def _cell(value: Any, limit: int | None) -> str:
    text = "-" if value is None or value == "" else " ".join(str(value).split())
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def render_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], limits: Mapping[str, int] = {}
) -> str:
    """Columns aligned on the widest cell; cells on one line, long ones cut with an ellipsis."""
    body = [[_cell(v, limits.get(h)) for h, v in zip(headers, row, strict=True)] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [list(headers), *body]
    ]
    return "\n".join(lines)


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def json_option(fn: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print stable machine-readable JSON (ISO 8601 UTC times)."
    )(fn)


# -- the group -------------------------------------------------------------------------------------


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


# -- db --------------------------------------------------------------------------------------------


@main.group()
def db() -> None:
    """Install, inspect and check the joblease schema."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Upgrade the joblease tables to this package's head revision (idempotent; safe to run concurrently)."""
    state = _state()
    engine = state.engine(require_head=False, create=True)
    for warning in storage.upgrade_warnings(engine):
        click.echo(f"warning: {warning}", err=True)
    before = storage.migrate(engine, warn=False)  # the warnings above, printed, not logged
    head = storage.head_revision()
    if before == head:
        click.echo(f"{_target(state.url)}: already at head revision {head}")
    else:
        click.echo(f"{_target(state.url)}: upgraded from {before or 'none'} to {head}")


@db.command("current")
@json_option
def db_current(as_json: bool) -> None:
    """Show the schema revision of the database and the one this package needs."""
    state = _state()
    current = storage.current_revision(state.engine(require_head=False))
    head = storage.head_revision()
    if as_json:
        _echo_json({"current_revision": current, "head_revision": head, "at_head": current == head})
        return
    verdict = "at head" if current == head else "behind: run `joblease db upgrade`"
    click.echo(
        f"database: {_target(state.url)}\ncurrent:  {current or 'none (not installed)'}\nhead:     {head}"
    )
    click.echo(f"status:   {verdict}")


@db.command("check")
@json_option
def db_check(as_json: bool) -> None:
    """Compare the live schema with the package's models.

    Exit 0 when they match; 2 when the schema is behind (run `joblease db upgrade`); 1 when it is at head
    but differs (changed by hand) — the differences are listed.
    """
    diff = storage.check_schema(_state().engine(require_head=False))
    behind = diff.db_revision != diff.head_revision
    if as_json:
        _echo_json(
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
                f"needs {diff.head_revision}; run `joblease db upgrade`"
            )
        if diff.differences:
            click.echo("differences between the live schema and the models:")
            for line in diff.differences:
                click.echo(f"  - {line}")
    if not diff.ok:
        sys.exit(EXIT_USAGE if behind else EXIT_FAILED)


# -- leases ----------------------------------------------------------------------------------------


@main.group()
def leases() -> None:
    """Inspect, reset and purge lease rows (one per logical run)."""


def _remaining(row: admin.LeaseRow) -> str:
    if row.status != "RUNNING":
        return "-"
    if row.expired:
        return f"expired {human_ms(-(row.remaining_ms or 0))} ago"
    return human_ms(row.remaining_ms)


def _heartbeat(row: admin.LeaseRow) -> str:
    """The holder's own interval (what "stale" is judged by), its last heartbeat's age, STALE past it."""
    if row.heartbeat_ms is None:
        every = "every ? (pre-0002 row)"
    elif row.heartbeat_ms == 0:
        every = "none (expiry only)"
    else:
        every = f"every {human_ms(row.heartbeat_ms)}"
    if row.heartbeat_age_ms is None:
        return every
    return f"{every}, last {human_ms(max(row.heartbeat_age_ms, 0))} ago" + (" STALE" if row.stale else "")


@leases.command("list", short_help="List leases with remaining time on the database clock.")
@click.option("--code", help="Only this job code.")
@click.option(
    "--status",
    type=click.Choice(["running", "success", "fail"], case_sensitive=False),
    help="Only this status.",
)
@click.option(
    "--older-than", type=DURATION, help="Only runs whose current attempt started longer ago (30m, 2h, 7d)."
)
@click.option("--expired", is_flag=True, help="Only RUNNING rows past their expiry (holder stalled or dead).")
@click.option(
    "--limit",
    type=click.IntRange(1, admin.MAX_LIMIT),
    default=100,
    show_default=True,
    help="At most this many rows.",
)
@json_option
def leases_list(
    code: str | None, status: str | None, older_than: int | None, expired: bool, limit: int, as_json: bool
) -> None:
    """List leases, newest attempt first. REMAINING is the holder's lease left on the database clock;
    HEARTBEAT is the interval the holder recorded (stale is judged by it, not by yours) and, while it
    runs, its last heartbeat's age (STALE past two intervals: it may still be working until it expires)."""
    rows = admin.list_leases(
        _state().engine(),
        code=code,
        status=status,
        older_than_ms=older_than,
        expired_only=expired,
        limit=limit,
    )
    if as_json:
        _echo_json([r.to_json() for r in rows])
        return
    if not rows:
        click.echo("no leases match")
        return
    click.echo(
        render_table(
            ["ID", "CODE", "RUN KEY", "STATUS", "ATTEMPT", "REMAINING", "HEARTBEAT", "HOLDER", "LAST ERROR"],
            [
                [
                    r.id,
                    r.code,
                    r.run_key,
                    r.status,
                    r.attempt,
                    _remaining(r),
                    _heartbeat(r),
                    r.holder,
                    r.last_error,
                ]
                for r in rows
            ],
            {"LAST ERROR": ERROR_CELL_CHARS, "RUN KEY": 40, "HOLDER": 40},
        )
    )


_KEY_RE = re.compile(r"v2:[0-9a-f]{64}")
# A lone value made only of digits and date/time punctuation: a partition or tick key, or an id.
_RUN_KEY_LIKE = re.compile(r"\d[\d\-:T/._+Z ]*")


def lease_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The one option form that names a lease, the same on every per-lease command."""
    for option in reversed(
        [
            click.option("--key", "key_opt", metavar="KEY", help="The lease's v2: idempotency key."),
            click.option("--code", "code_opt", metavar="CODE", help="The job code (alone: an INITIAL run)."),
            click.option(
                "--run-key", "run_key_opt", metavar="RUN_KEY", help="With --code: that SCHEDULE run."
            ),
            click.option("--id", "lease_id", type=int, help="The lease's numeric row id."),
        ]
    ):
        fn = option(fn)
    return fn


def _optioned_lease(
    key_opt: str | None, code_opt: str | None, run_key_opt: str | None, lease_id: int | None
) -> tuple[str | int, str | None] | None:
    """The lease the options name, as (v2 key | code | id, run key); None when no option was given."""
    if lease_id is not None:
        return lease_id, None
    if key_opt is not None:
        if not _KEY_RE.fullmatch(key_opt.strip()):
            raise click.BadParameter(f"{key_opt!r} is not a v2: idempotency key", param_hint="--key")
        return key_opt.strip(), None
    if code_opt is not None:
        return code_opt, run_key_opt
    return None


def _one_way(given: list[str], forms: str, run_key_opt: str | None, code_opt: str | None) -> None:
    if run_key_opt is not None and code_opt is None:
        raise click.UsageError("--run-key needs --code CODE: a run key alone does not name a run")
    if len(given) != 1:
        raise click.UsageError(
            f"name the lease in exactly one way: {forms} (got {', '.join(given) if given else 'none'})"
        )


def _positional_lease(command: str, key_or_code: str, run_key: str | None) -> str:
    """``KEY`` or ``CODE [RUN_KEY]`` given positionally (the same on `leases show` and `leases fail`).

    A lone value that looks like a run key (a date, a time, a number) is refused rather than read as an
    INITIAL job's code."""
    text = key_or_code.strip()
    if _KEY_RE.fullmatch(text):
        if run_key is not None:
            raise click.UsageError(f"a v2: key names one lease by itself; drop {run_key!r}")
        return text
    if run_key is None and _RUN_KEY_LIKE.fullmatch(text):
        raise click.UsageError(
            f"{text!r} looks like a run key (a date, a time or a number), not a job code. Give its "
            f"code too: `joblease leases {command} --code CODE --run-key {text}`; for an INITIAL job whose "
            f"code really is {text!r}, `--code {text}`; for a lease id, `--id {text}`."
        )
    return key_or_code


@leases.command("show", short_help="Show one lease by key, code [run key] or id.")
@click.argument("key_or_code", required=False, metavar="[KEY | CODE [RUN_KEY]]")
@click.argument("run_key", required=False, metavar="")
@lease_options
@json_option
def leases_show(
    key_or_code: str | None,
    run_key: str | None,
    key_opt: str | None,
    code_opt: str | None,
    run_key_opt: str | None,
    lease_id: int | None,
    as_json: bool,
) -> None:
    """Show one lease, named in exactly one way (the options are the same on `leases fail`):

    \b
      joblease leases show --code CODE --run-key RUN_KEY   a SCHEDULE run (or: show CODE RUN_KEY)
      joblease leases show --code CODE                     an INITIAL run (CODE alone works unless it
                                                           looks like a run key: a date, a time, a number)
      joblease leases show --key v2:…                      (or: show v2:…)
      joblease leases show --id N

    A lone positional value that looks like a run key (2024-02-03) is refused rather than read as an
    INITIAL job's code; give its code too. No such lease: close run keys (or codes) are suggested.
    """
    given = [
        name
        for name, value in (
            ("KEY | CODE [RUN_KEY]", key_or_code),
            ("--key", key_opt),
            ("--code", code_opt),
            ("--id", lease_id),
        )
        if value is not None
    ]
    _one_way(
        given,
        "KEY, CODE [RUN_KEY], --key KEY, --code CODE [--run-key RUN_KEY] or --id N",
        run_key_opt,
        code_opt,
    )
    target: str | int
    optioned = _optioned_lease(key_opt, code_opt, run_key_opt, lease_id)
    if optioned is not None:
        target, run_key = optioned
    else:
        assert key_or_code is not None
        target = _positional_lease("show", key_or_code, run_key)
    row = admin.show_lease(_state().engine(), target, run_key)
    if as_json:
        _echo_json(row.to_json())
        return
    fields = [
        ("id", row.id),
        ("key", row.idempotency_key),
        ("type", row.job_type),
        ("code", row.code),
        ("run key", row.run_key),
        ("status", row.status),
        ("attempt", row.attempt),
        ("holder", row.holder),
        ("lease length", human_ms(row.lease_ms)),
        ("remaining", _remaining(row)),
        ("heartbeats", _heartbeat(row)),
        ("created", row.created_at.isoformat()),
        ("acquired", row.acquired_at.isoformat()),
        ("heartbeat", row.heartbeat_at.isoformat()),
        ("expires", row.expires_at.isoformat()),
        ("finished", row.finished_at.isoformat() if row.finished_at else None),
        ("last error", row.last_error),
        ("result", None if row.result is None else json.dumps(row.result, ensure_ascii=False)),
    ]
    width = max(len(k) for k, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {'-' if value is None else value}")


def _lease_ref(text: str) -> str | int:
    return int(text) if text.isdigit() else text


def _is_key_or_id(text: str) -> bool:
    return text.isdigit() or bool(_KEY_RE.fullmatch(text.strip()))


def _refs_to_fail(keys: tuple[str, ...], optioned: tuple[str | int, str | None] | None) -> list[str | int]:
    """The leases `leases fail` names: by an option, by keys or ids, or by CODE [RUN_KEY] as on `show`.
    A code (and run key) is looked up first, so a near miss gets the same hints as `leases show`."""
    if optioned is None and all(_is_key_or_id(ref) for ref in keys):
        return [_lease_ref(ref) for ref in keys]
    if optioned is None:
        if len(keys) > 2 or _is_key_or_id(keys[0]):
            bad = next(ref for ref in keys if not _is_key_or_id(ref))
            raise click.UsageError(
                f"{bad!r} is neither a v2: key nor a numeric lease id: several positional arguments of "
                "`leases fail` are keys or ids; a run by its code is CODE [RUN_KEY] alone, or "
                "`--code CODE --run-key RUN_KEY`."
            )
        code, run_key = keys[0], (keys[1] if len(keys) == 2 else None)
        optioned = _positional_lease("fail", code, run_key), run_key
    target, run_key = optioned
    if isinstance(target, str) and not _KEY_RE.fullmatch(target):
        return [admin.show_lease(_state().engine(), target, run_key).id]
    return [target]


@leases.command("fail", short_help="Reset stuck or failed runs so the next claim retries them.")
@click.argument("keys", nargs=-1, required=False, metavar="[KEY_OR_ID... | CODE [RUN_KEY]]")
@lease_options
@click.option(
    "--force",
    is_flag=True,
    help="Also reset a live RUNNING lease. Risk: two holders — the old one may still be running its effect; "
    "its fenced writes will fail, but an effect it already started may happen twice (harmless only if the "
    "downstream deduplicates by the idempotency key).",
)
@click.option(
    "--reason", default="marked failed by an operator", show_default=True, help="Recorded in last_error."
)
def leases_fail(
    keys: tuple[str, ...],
    key_opt: str | None,
    code_opt: str | None,
    run_key_opt: str | None,
    lease_id: int | None,
    force: bool,
    reason: str,
) -> None:
    """Reset stuck or failed runs to FAIL so the next claim retries them with the same idempotency key.

    The lease is named as on `leases show`, by options or positionally:

    \b
      joblease leases fail --code CODE --run-key RUN_KEY   a SCHEDULE run (or: fail CODE RUN_KEY)
      joblease leases fail --code CODE                     an INITIAL run (or: fail CODE, unless CODE
                                                           looks like a run key: a date, a time, a number)
      joblease leases fail --key v2:… | --id N             (or: fail v2:… | fail N)
      joblease leases fail KEY_OR_ID...                    several v2: keys or numeric ids at once

    The old holder is fenced out (new owner token). A live lease is refused unless --force; a SUCCESS
    row is always refused (purge it instead).
    """
    given = [
        name
        for name, value in (
            ("KEY_OR_ID... | CODE [RUN_KEY]", keys or None),
            ("--key", key_opt),
            ("--code", code_opt),
            ("--id", lease_id),
        )
        if value is not None
    ]
    _one_way(
        given,
        "--code CODE [--run-key RUN_KEY], --key KEY, --id N, KEY_OR_ID... or CODE [RUN_KEY]",
        run_key_opt,
        code_opt,
    )
    refs = _refs_to_fail(keys, _optioned_lease(key_opt, code_opt, run_key_opt, lease_id))
    engine = _state().engine()
    worst = 0
    for ref in refs:
        try:
            outcome = admin.reset_lease(engine, ref, force=force, reason=reason)
        except (errors.NotFoundError, admin.AdminRefusedError, admin.AdminArgumentError) as exc:
            click.echo(f"Error: {ref}: {exc}", err=True)
            worst = max(worst, exit_code_for(exc))
            continue
        row = outcome.lease
        if outcome.was_live:
            click.echo(
                f"warning: lease {row.id} was live; its old holder may still run its effect and a retry may "
                "repeat it — harmless only if the downstream deduplicates by the idempotency key",
                err=True,
            )
        run = row.code if row.run_key is None else f"{row.code} / {row.run_key}"
        click.echo(
            f"lease {row.id} ({run}) {'is now' if outcome.changed else 'was already'} FAIL: the next claim "
            f"retries it as attempt {row.attempt + 1} with key {row.idempotency_key}"
        )
    if worst:
        sys.exit(worst)


def _floor_option(flag: int | None, env_name: str, default: int) -> int:
    """The floor a purge asks for: the flag, else the environment's, else the default. The library then
    raises it to the environment's floor, so a flag below that is refused, not obeyed."""
    if flag is not None:
        return flag
    env = admin.env_floor_ms(env_name)
    return default if env is None else env


@leases.command("purge", short_help="Delete finished SCHEDULE rows older than a window.")
@click.option(
    "--finished-before", type=DURATION, required=True, help="Delete rows finished longer ago (e.g. 30d)."
)
@click.option(
    "--min-replay-window",
    type=DURATION,
    help="Refuse a --finished-before below this: a purged run key can run again. Default: "
    f"${MIN_REPLAY_WINDOW_ENV}, else 7d. ${MIN_REPLAY_WINDOW_ENV} is a floor: this flag can raise it, "
    "never lower it.",
)
@click.option("--dry-run", is_flag=True, help="Only count the rows that would be deleted.")
def leases_purge(finished_before: int, min_replay_window: int | None, dry_run: bool) -> None:
    """Delete SUCCESS/FAIL rows of SCHEDULE runs finished before the window (INITIAL, RUNNING rows kept).

    After a purge the same (code, run key) can win a fresh lease again (attempt 1, same key), so the window
    must cover every way that run key could be replayed (late ticks, backfills, re-executions).
    """
    count = admin.purge_leases(
        _state().engine(),
        finished_before_ms=finished_before,
        min_replay_window_ms=_floor_option(
            min_replay_window, MIN_REPLAY_WINDOW_ENV, admin.DEFAULT_MIN_REPLAY_WINDOW_MS
        ),
        dry_run=dry_run,
    )
    click.echo(f"{'would delete' if dry_run else 'deleted'} {count} finished SCHEDULE lease row(s)")


# -- outbox ----------------------------------------------------------------------------------------


@main.group()
def outbox() -> None:
    """Inspect, requeue and purge outbox rows."""


@outbox.command("stats", short_help="Counts by status and topic, due backlog and its age.")
@json_option
def outbox_stats(as_json: bool) -> None:
    """Counts by status and by topic, the due backlog and the age of its oldest row (database clock)."""
    stats = admin.outbox_stats(_state().engine())
    if as_json:
        _echo_json(stats.to_json())
        return
    click.echo(render_table(["STATUS", "COUNT"], [[s, n] for s, n in stats.by_status.items()]))
    click.echo(f"due now: {stats.due}   oldest due waiting: {human_ms(stats.oldest_due_age_ms)}")
    if stats.by_topic:
        click.echo("")
        click.echo(
            render_table(["TOPIC", "STATUS", "COUNT"], [[t.topic, t.status, t.count] for t in stats.by_topic])
        )


def _next_attempt(row: admin.OutboxRow) -> str:
    if row.status != "PENDING" or row.due_in_ms is None:
        return "-"
    if row.claimed:
        return "in flight"
    return f"in {human_ms(row.due_in_ms)}" if row.due_in_ms > 0 else f"due {human_ms(-row.due_in_ms)} ago"


@outbox.command("list", short_help="List outbox rows with their last status and error.")
@click.option(
    "--status",
    type=click.Choice(["pending", "sent", "dead", "skipped"], case_sensitive=False),
    help="Only this status.",
)
@click.option("--topic", help="Only this topic.")
@click.option(
    "--limit",
    type=click.IntRange(1, admin.MAX_LIMIT),
    default=100,
    show_default=True,
    help="At most this many rows.",
)
@json_option
def outbox_list(status: str | None, topic: str | None, limit: int, as_json: bool) -> None:
    """List outbox rows (newest first, without payloads) with their last HTTP status and error."""
    rows = admin.list_outbox(_state().engine(), status=status, topic=topic, limit=limit)
    if as_json:
        _echo_json([r.to_json() for r in rows])
        return
    if not rows:
        click.echo("no outbox rows match")
        return
    headers = ["ID", "TOPIC", "STATUS", "ATTEMPTS", "NEXT ATTEMPT", "LAST STATUS", "LAST ERROR"]
    cells = [
        [r.id, r.topic, r.status, r.attempts, _next_attempt(r), r.last_status, r.last_error] for r in rows
    ]
    if any(r.ordering_key is not None for r in rows):  # the column only when some row has a key
        headers.insert(2, "ORDERING KEY")
        for row, cell in zip(rows, cells, strict=True):
            cell.insert(2, row.ordering_key)
    click.echo(
        render_table(headers, cells, {"LAST ERROR": ERROR_CELL_CHARS, "TOPIC": 40, "ORDERING KEY": 40})
    )
    _echo_blocked_keys()


def _echo_blocked_keys() -> None:
    """The ordering keys DEAD rows block (count, and the first few with their blocking row), if any."""
    from dagster_joblease import delivery_status

    with storage_engine.translate_errors("list blocked ordering keys"), _state().engine().connect() as conn:
        count, blocked = delivery_status.blocked_keys(conn)
    if count:
        click.echo("")
        click.echo(_blocked_keys_text(count, blocked))


def _blocked_keys_text(count: int, blocked: Sequence[Any]) -> str:
    lines = [f"{count} ordering key(s) blocked by a DEAD row (their later rows wait):"]
    lines += [f"  {b.describe()}" for b in blocked]
    if count > len(blocked):
        lines.append(f"  … and {count - len(blocked)} more")
    lines.append(
        "unblock: `joblease outbox requeue ID` (send it again) or `joblease outbox skip ID` (give up)"
    )
    return "\n".join(lines)


@outbox.command("status", short_help="Per topic and limit group: due, in flight, paused, limits.")
@click.option(
    "--routes",
    "routes_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The dispatcher's routes file, to show each topic's limit group (optional).",
)
@click.option("--route", "route_specs", multiple=True, metavar="TOPIC=URL", help="A route; repeat for more.")
@json_option
def outbox_status(routes_file: Path | None, route_specs: tuple[str, ...], as_json: bool) -> None:
    """Delivery status on the database clock: per topic the rows due, in flight, waiting (backoff or
    pause), retrying, dead and skipped (never sent by a person's decision: not dead); per limit group the
    requests in flight (every dispatcher), the limits in force, and a pause (until when, and why). Give
    the routes to see which group each topic is in."""
    from dagster_joblease import delivery_status

    routes = _routes(routes_file, route_specs) if routes_file or route_specs else {}
    status = delivery_status.delivery_status(
        _state().engine(), topic_groups={t: str(r.limit_group) for t, r in routes.items()}
    )
    if as_json:
        _echo_json(status.to_json())
        return
    if not status.topics:
        click.echo("no pending, dead or skipped outbox rows")
    else:
        click.echo(
            render_table(
                ["TOPIC", "GROUP", "DUE", "IN FLIGHT", "WAITING", "RETRYING", "DEAD", "SKIPPED"],
                [
                    [t.topic, t.limit_group, t.due, t.in_flight, t.waiting, t.retrying, t.dead, t.skipped]
                    for t in status.topics
                ],
                {"TOPIC": 40, "GROUP": 40},
            )
        )
    if status.groups:
        click.echo("")
        click.echo(
            render_table(
                ["LIMIT GROUP", "IN FLIGHT", "RATE", "PAUSED UNTIL", "REASON"],
                [
                    [
                        g.limit_group,
                        f"{g.in_flight}/{g.max_in_flight}" if g.max_in_flight else g.in_flight,
                        f"{g.rate}/s (booked {human_ms(g.rate_busy_ms)} ahead)" if g.rate else None,
                        f"{g.paused_until} (in {human_ms(g.pause_remaining_ms)})" if g.paused_until else None,
                        g.pause_reason,
                    ]
                    for g in status.groups
                ],
                {"LIMIT GROUP": 40, "REASON": ERROR_CELL_CHARS},
            )
        )
    if status.blocked_key_count:
        click.echo("")
        click.echo(_blocked_keys_text(status.blocked_key_count, status.blocked_keys))


@outbox.command("requeue", short_help="Make dead rows due again with their original key.")
@click.argument("row_id", type=int, required=False, metavar="[ID]")
@click.option("--all-dead", is_flag=True, help="Requeue every DEAD row.")
@click.option("--topic", help="Requeue every DEAD row of this topic.")
def outbox_requeue(row_id: int | None, all_dead: bool, topic: str | None) -> None:
    """Make rows due again with their original idempotency key: one ID, --all-dead, or --topic T.

    Attempts restart at 0 and the claim is cleared; the last status and error stay visible until the next
    attempt. SENT rows, and rows a dispatcher is delivering right now, are refused. A SKIPPED row (`outbox
    skip`) is requeued by its ID only: --all-dead and --topic take DEAD rows.
    """
    if row_id is None and not all_dead and topic is None:
        raise click.UsageError("give an ID, --all-dead or --topic TOPIC")
    if row_id is not None and (all_dead or topic is not None):
        raise click.UsageError("give either an ID or --all-dead/--topic, not both")
    count = admin.requeue(_state().engine(), row_id=row_id, all_dead=all_dead, topic=topic)
    click.echo(
        f"requeued {count} row(s); they keep their idempotency keys and are due now. Their retention "
        "clock restarts: a route's dedupe_window counts from the next attempt (requeueing a row that was "
        "dead-lettered past its window sends it again, which you decided is right)"
    )


@outbox.command("skip", short_help="Never send a DEAD row: it becomes SKIPPED, its ordering key flows.")
@click.argument("row_id", type=int, metavar="ID")
def outbox_skip(row_id: int) -> None:
    """Mark DEAD row ID SKIPPED: a person decided it is never sent. It no longer counts as dead (`outbox
    status`, the no_dead_rows check), keeps its ordering key, and no longer holds that key's later rows
    back: they are delivered again, in order. Its last error says it was skipped by an operator, and when
    (the database clock). `joblease outbox requeue ID` makes it PENDING again (it is then sent);
    `outbox purge` deletes it once it was skipped longer ago than --sent-before.

    Refused (exit 1) for a row that is not DEAD (PENDING, SENT, or already SKIPPED), or missing."""
    key = admin.skip(_state().engine(), row_id)
    flows = (
        "" if key is None else f"; ordering key {key!r} released, its later rows are claimed again in order"
    )
    click.echo(f"skipped outbox row {row_id}: SKIPPED, never sent{flows}")


@outbox.command("resume", short_help="End a limit group's pause now.")
@click.argument("group")
def outbox_resume(group: str) -> None:
    """End limit group GROUP's pause now (a downstream's Retry-After, or consecutive connection failures),
    for every dispatcher: each claims the group's rows again at its next claim. Rows the pause deferred
    keep their next attempt time; rows given back by the pause are due at once.

    Exits 1, naming the groups that are paused, when GROUP has no pause in force.
    """
    from dagster_joblease.storage import route_groups

    engine = _state().engine()
    with storage_engine.translate_errors("end a limit group's pause"), engine.begin() as conn:
        ended = route_groups.resume(conn, group)
        paused = [] if ended else sorted(n for n, s in route_groups.read_states(conn).items() if s.paused)
    if ended is None:
        others = f"; paused now: {', '.join(paused)}" if paused else "; no limit group is paused now"
        click.echo(f"limit group {group!r} is not paused{others}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(
        f"limit group {group}: pause ended (it was paused until {ended.paused_until}: "
        f"{ended.pause_reason or 'no reason recorded'}); dispatchers claim its rows again at their next claim"
    )


@outbox.command("purge", short_help="Delete SENT (and SKIPPED) rows older than a window.")
@click.option(
    "--sent-before",
    type=DURATION,
    required=True,
    help="Delete SENT rows delivered longer ago (e.g. 7d), and SKIPPED rows skipped longer ago (their "
    "updated_at, set to the database clock by the skip).",
)
@click.option(
    "--min-retention",
    type=DURATION,
    help="Refuse a --sent-before below this; set it to at least the downstream's deduplication window. "
    f"Default: ${MIN_RETENTION_ENV}, else 24h. ${MIN_RETENTION_ENV} is a floor: this flag can raise it, "
    "never lower it.",
)
@click.option("--dry-run", is_flag=True, help="Only count the rows that would be deleted.")
def outbox_purge(sent_before: int, min_retention: int | None, dry_run: bool) -> None:
    """Delete SENT rows older than the window, and SKIPPED rows skipped before it (by updated_at, which
    `outbox skip` sets to the database clock); PENDING and DEAD rows are kept.

    After a purge, enqueueing the same key again delivers it again, so the window must be at least the
    downstream's deduplication window.
    """
    count = admin.purge_sent(
        _state().engine(),
        older_than_ms=sent_before,
        min_retention_ms=_floor_option(min_retention, MIN_RETENTION_ENV, admin.DEFAULT_MIN_RETENTION_MS),
        dry_run=dry_run,
    )
    click.echo(f"{'would delete' if dry_run else 'deleted'} {count} SENT or SKIPPED outbox row(s)")


# -- dispatch --------------------------------------------------------------------------------------


def _routes(routes_file: Path | None, route_specs: Sequence[str]) -> dict[str, Any]:
    """The routes of ``--routes FILE`` and ``--route TOPIC=URL`` (the latter win on the same topic)."""
    try:
        from dagster_joblease import dispatch
    except ImportError as exc:
        raise CliConfigError(f"dispatch is unavailable in this installation: {exc}") from exc
    routes: dict[str, Any] = dict(dispatch.load_routes(routes_file)) if routes_file else {}
    for spec in route_specs:
        topic, sep, url = spec.partition("=")
        if not sep or not topic.strip() or not url.strip():
            raise click.BadParameter(f"{spec!r} is not TOPIC=URL", param_hint="--route")
        routes[topic.strip()] = dispatch.Route(url.strip())
    return routes


class _LogToProgress(logging.Handler):
    def __init__(self, progress: _Progress) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.log(f"{record.levelname.lower()}: {record.getMessage()}")


@contextlib.contextmanager
def _library_logs(progress: _Progress, level: int) -> Iterator[None]:
    """Route the package's log records through the progress printer for the duration of a command."""
    logger = logging.getLogger("dagster_joblease")
    handler = _LogToProgress(progress)
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


class _Progress:
    """One rewritten line on a terminal, plain lines otherwise; totals for the final summary."""

    def __init__(self, *, tty: bool, quiet: bool) -> None:
        self.tty = tty
        self.quiet = quiet
        self.batches = 0
        self.totals = {"claimed": 0, "sent": 0, "retried": 0, "dead": 0}
        self.expired = 0
        self.paused: dict[str, tuple[str, str]] = {}
        self.limited: set[str] = set()
        self._line_open = False

    def __call__(self, report: Any) -> None:
        self.batches += 1
        for name in self.totals:
            self.totals[name] += int(getattr(report, name))
        self.expired += int(getattr(report, "expired", 0))
        self.paused.update(getattr(report, "paused", {}))
        self.limited |= set(getattr(report, "limited", ()))
        if self.quiet:
            return
        if self.tty:
            line = "  ".join(f"{k} {v}" for k, v in self.totals.items())
            sys.stdout.write(f"\r{self.batches} batches  {line}\033[K")
            sys.stdout.flush()
            self._line_open = True
        elif report.claimed:
            click.echo(
                f"batch {self.batches}: claimed {report.claimed} sent {report.sent} "
                f"retried {report.retried} dead {report.dead}"
            )

    def log(self, message: str) -> None:
        """A library warning (a dead row, a lost claim, a database hiccup) on stderr, below the live line."""
        self._newline()
        click.echo(message, err=True)

    def _newline(self) -> None:
        if self._line_open:
            sys.stdout.write("\n")
            self._line_open = False

    def summary(self) -> str:
        self._newline()
        t = self.totals
        return f"done: claimed {t['claimed']}, sent {t['sent']}, retried {t['retried']}, dead {t['dead']}"


@main.command("dispatch")
@click.option("--once", "mode", flag_value="once", help="Deliver every row due now, then exit.")
@click.option(
    "--loop", "mode", flag_value="loop", help="Keep polling until SIGTERM/SIGINT (or --max-batches)."
)
@click.option(
    "--routes",
    "routes_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="TOML or JSON file: {topic: {url, headers, secret_headers, timeout_s}}.",
)
@click.option("--route", "route_specs", multiple=True, metavar="TOPIC=URL", help="A route; repeat for more.")
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Attempts before a retryable failure parks a row as DEAD.",
)
@click.option(
    "--concurrency", type=click.IntRange(1, 256), default=8, show_default=True, help="Deliveries in flight."
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, admin.MAX_LIMIT),
    default=100,
    show_default=True,
    help="Rows claimed per batch.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.01),
    default=1.0,
    show_default=True,
    help="Seconds between polls when idle (--loop).",
)
@click.option("--max-batches", type=click.IntRange(min=1), help="Stop after this many claim batches.")
@click.option(
    "-v", "--verbose", is_flag=True, help="Also log each retry (warnings are always shown on stderr)."
)
@json_option
def dispatch_command(
    mode: str | None,
    routes_file: Path | None,
    route_specs: tuple[str, ...],
    max_attempts: int,
    concurrency: int,
    batch_size: int,
    poll_interval: float,
    max_batches: int | None,
    verbose: bool,
    as_json: bool,
) -> None:
    """Deliver due outbox rows over HTTP (Idempotency-Key header).

    --once delivers every row due now and exits; --loop keeps polling.

    Prints a live progress line on a terminal, plain lines otherwise, and a final summary (claimed, sent,
    retried, dead); dead rows and other warnings go to stderr, and so do a paused limit group (until when,
    and why) and due rows of topics these routes do not route. With --json, stdout holds only the final
    totals as JSON.

    Exit code with --once: 1 when this pass dead-lettered rows (the message says how many and how to
    requeue them), else 0; rows of unrouted topics and pauses are reported, not failed.
    """
    once = _dispatch_mode(mode, routes_file, route_specs)
    from dagster_joblease import dispatch

    routes = _routes(routes_file, route_specs)
    engine = _state().engine()
    progress = _Progress(tty=sys.stdout.isatty() and not as_json, quiet=as_json)
    with (
        _library_logs(progress, logging.INFO if verbose else logging.WARNING),
        dispatch.Dispatcher(engine, routes, max_attempts=max_attempts, concurrency=concurrency) as dispatcher,
    ):
        if once:
            _dispatch_once(dispatcher, progress, batch_size=batch_size, max_batches=max_batches)
        else:
            _dispatch_loop(
                dispatcher,
                progress,
                poll_interval=poll_interval,
                batch_size=batch_size,
                max_batches=max_batches,
            )
    _report_dispatch(engine, routes, progress, as_json=as_json)
    if progress.totals["dead"] and once:
        sys.exit(EXIT_FAILED)


def _dispatch_mode(mode: str | None, routes_file: Path | None, route_specs: tuple[str, ...]) -> bool:
    """Whether `dispatch` runs --once (else --loop); a usage error without a mode or without routes."""
    if mode is None:
        raise click.UsageError("give --once or --loop")
    if not routes_file and not route_specs:
        raise click.UsageError("no routes: give --routes FILE or --route TOPIC=URL")
    return mode == "once"


def _dispatch_once(
    dispatcher: Dispatcher, progress: _Progress, *, batch_size: int, max_batches: int | None
) -> None:
    """Claim and deliver batches until one claims nothing (or ``max_batches`` ran)."""
    while max_batches is None or progress.batches < max_batches:
        report = dispatcher.dispatch(limit=batch_size)
        progress(report)
        if report.claimed == 0:
            return


def _dispatch_loop(
    dispatcher: Dispatcher,
    progress: _Progress,
    *,
    poll_interval: float,
    batch_size: int,
    max_batches: int | None,
) -> None:
    """Poll until stopped (SIGTERM/SIGINT) or ``max_batches`` ran; the run's totals become the progress'."""
    totals = dispatcher.run(
        poll_interval_s=poll_interval, max_batches=max_batches, on_report=progress, limit=batch_size
    )
    progress.totals = {k: int(getattr(totals, k)) for k in progress.totals}
    progress.expired, progress.paused = totals.expired, totals.paused


def _report_dispatch(
    engine: sa.Engine, routes: Mapping[str, Route], progress: _Progress, *, as_json: bool
) -> None:
    """The final summary (or the JSON totals) on stdout, then the notes on stderr: the pauses of these
    routes' groups and the due rows of topics they do not route, read after the pass."""
    from dagster_joblease import outbox

    groups = {topic: str(route.limit_group) for topic, route in routes.items()}
    with storage_engine.translate_errors("read pauses"), engine.connect() as conn:
        pauses = outbox.paused_groups(conn, groups)
    unrouted, unrouted_topics = outbox.unrouted_due(engine, topics=list(routes))
    if as_json:
        _echo_json(
            {
                **progress.totals,
                "batches": progress.batches,
                "expired": progress.expired,
                "paused": [dataclasses.asdict(p) for p in pauses],
                "unrouted_due": unrouted,
                "unrouted_due_topics": unrouted_topics,
            }
        )
    else:
        click.echo(progress.summary())
    dead = progress.totals["dead"]
    for note in dispatch_notes(
        pauses, unrouted_topics, unrouted=unrouted, dead=dead, expired=progress.expired
    ):
        click.echo(note, err=True)


def dispatch_notes(
    pauses: Sequence[GroupPause],
    unrouted_topics: Mapping[str, int],
    *,
    unrouted: int,
    dead: int,
    expired: int,
) -> list[str]:
    """What `dispatch` says on stderr after its summary: each paused group, the due rows of topics these
    routes do not route (named with their counts), and the rows dead-lettered in this pass (how many were
    past their dedupe window, and how to requeue them)."""
    notes = [f"paused: {p.describe()}" for p in pauses]
    if unrouted:
        named = ", ".join(f"{t} ({n})" for t, n in unrouted_topics.items())
        notes.append(
            f"{unrouted} due row(s) of topics this location does not route: {named} (left for the "
            "dispatcher that routes them)"
        )
    if dead:
        notes.append(
            f"{dead} row(s) were dead-lettered in this pass ({expired} past their route's "
            "dedupe_window: reconcile those effects first); fix the cause, then requeue deliberately: "
            "`joblease outbox requeue --all-dead` (or --topic TOPIC, or one ID)"
        )
    return notes
