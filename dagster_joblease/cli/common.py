"""What every command group of the ``joblease`` CLI shares: exit codes and the errors that carry them, the
configured database (one engine per command), lazily loaded subcommands, the duration parameter, tables
and JSON output. No output ever contains a password or a full database URL."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
import sqlalchemy as sa

from dagster_joblease import admin, errors, storage
from dagster_joblease.storage import engine as storage_engine

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_USAGE = 2
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
                    f"or create and install it with `{storage_engine.upgrade_command(url)}`."
                )
            self._engine = storage.create_engine(url)
            try:
                with storage_engine.translate_errors("connect"), self._engine.connect():
                    pass
            except errors.StorageError as exc:
                raise CliConfigError(
                    self.scrub(
                        f"cannot connect to {storage_engine.describe_database(url)}: {exc}. "
                        + _connect_advice(url)
                    )
                ) from exc
        if require_head:
            storage.require_schema(self._engine)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()


def current_state() -> State:
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


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def json_option(fn: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print stable machine-readable JSON (ISO 8601 UTC times)."
    )(fn)


def limit_option(fn: F) -> F:
    return click.option(
        "--limit",
        type=click.IntRange(1, admin.MAX_LIMIT),
        default=100,
        show_default=True,
        help="At most this many rows.",
    )(fn)


def floor_option(flag: int | None, env_name: str, default: int) -> int:
    """The floor a purge asks for: the flag, else the environment's, else the default. The library then
    raises it to the environment's floor, so a flag below that is refused, not obeyed."""
    if flag is not None:
        return flag
    env = admin.env_floor_ms(env_name)
    return default if env is None else env


def routes_from_options(routes_file: Path | None, route_specs: Sequence[str]) -> dict[str, Any]:
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
