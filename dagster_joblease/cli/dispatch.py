"""``joblease dispatch``: deliver due outbox rows over HTTP, once or in a loop, with live progress."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import sqlalchemy as sa

from dagster_joblease import admin
from dagster_joblease.cli.common import (
    EXIT_FAILED,
    current_state,
    echo_json,
    json_option,
    routes_from_options,
)
from dagster_joblease.storage import engine as storage_engine

if TYPE_CHECKING:
    from dagster_joblease.dispatch import Dispatcher, Route
    from dagster_joblease.outbox import GroupPause


class _LogToProgress(logging.Handler):
    def __init__(self, progress: _BatchTotals) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.log(f"{record.levelname.lower()}: {record.getMessage()}")


@contextlib.contextmanager
def _library_logs(progress: _BatchTotals, level: int) -> Iterator[None]:
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


class _BatchTotals:
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


@click.command("dispatch")
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

    routes = routes_from_options(routes_file, route_specs)
    engine = current_state().engine()
    progress = _BatchTotals(tty=sys.stdout.isatty() and not as_json, quiet=as_json)
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
    dispatcher: Dispatcher, progress: _BatchTotals, *, batch_size: int, max_batches: int | None
) -> None:
    """Claim and deliver batches until one claims nothing (or ``max_batches`` ran)."""
    while max_batches is None or progress.batches < max_batches:
        report = dispatcher.dispatch(limit=batch_size)
        progress(report)
        if report.claimed == 0:
            return


def _dispatch_loop(
    dispatcher: Dispatcher,
    progress: _BatchTotals,
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
    engine: sa.Engine, routes: Mapping[str, Route], progress: _BatchTotals, *, as_json: bool
) -> None:
    """The final summary (or the JSON totals) on stdout, then the notes on stderr: the pauses of these
    routes' groups and the due rows of topics they do not route, read after the pass."""
    from dagster_joblease import outbox

    groups = {topic: str(route.limit_group) for topic, route in routes.items()}
    with storage_engine.translate_errors("read pauses"), engine.connect() as conn:
        pauses = outbox.paused_groups(conn, groups)
    unrouted, unrouted_topics = outbox.unrouted_due(engine, topics=list(routes))
    if as_json:
        echo_json(
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
